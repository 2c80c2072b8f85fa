"""The rank side of :class:`hvdlike.ray.RayExecutor`: one Ray actor per rank.

The actor is a plain class turned into a Ray actor by the executor (so this
module imports no Ray). It reports where it runs, takes the job's ``HVDLIKE_*``
variables (secret included) through a method call on Ray's own channel, and
runs the user's functions in its process. A function that raises leaves the
runtime aborted, so peers blocked in a collective fail at once instead of
waiting for a timeout, and the exception goes back as an outcome with its
traceback.
"""

from __future__ import annotations

import contextlib
import os
import socket
import traceback
from typing import Any, Callable, Dict, Mapping, Optional, Sequence


def _abort_runtime(reason: str) -> None:
    from hvdlike.core import api

    try:
        current = api.runtime()
    except Exception:  # not initialized: nothing to stop
        return
    if current.topology.size > 1:
        current.abort(reason)
    api.shutdown()


_PLAIN = (type(None), bool, int, float, complex, str, bytes)
UNPICKLABLE = "UnpicklableResult"
"""The outcome ``type`` of a result that cannot be pickled (a job error, not a lost rank)."""


def outcome_of(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
               sent: bool = True) -> dict:
    """Call ``fn``; return ``{"ok": True, "value": ...}`` or the failure with its traceback.

    A value that cannot be pickled is a failure of this rank too: Ray would
    fail to send it back only after this method returned, with its own error
    and no rank named (and an elastic driver would take it for a lost node).
    ``sent=False`` (the executable object, which stays in the actor) skips that.
    """
    try:
        value = fn(*args, **dict(kwargs))
    except SystemExit as exc:
        if exc.code in (0, None) and os.environ.get("HVDLIKE_ELASTIC_WORKER"):
            raise  # an elastic rank left out of the job: not a failure
        return _failed(exc)
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the driver
        return _failed(exc)
    problem = unpicklable(value) if sent else ""
    if problem:
        return _not_sendable(value, problem)
    return {"ok": True, "value": value}


def unpicklable(value: Any) -> str:
    """Why ``value`` cannot be pickled as Ray would send it ('' when it can).

    Ray pickles results with its cloudpickle; trying the same here costs one
    extra serialization of the result, which is skipped for plain scalars.
    """
    if isinstance(value, _PLAIN):
        return ""
    try:
        from ray import cloudpickle as pickler
    except ImportError:  # pragma: no cover - the executor always runs under Ray
        import pickle as pickler
    try:
        pickler.dumps(value)
    except Exception as exc:  # noqa: BLE001 - any pickling failure
        return f"{type(exc).__name__}: {exc}"
    return ""


def _not_sendable(value: Any, problem: str) -> dict:
    """The failure outcome of a result that cannot be pickled back to the driver.

    The runtime is left as it is: the function has returned on this rank, so
    no peer waits for it in a collective.
    """
    message = (f"the function's result ({type(value).__module__}.{type(value).__qualname__}) "
               f"cannot be pickled to send it to the driver: {problem}")
    return {"ok": False, "type": UNPICKLABLE, "message": message, "traceback": ""}


def _failed(exc: BaseException) -> dict:
    """The outcome of a failure (called while it is being handled, for its traceback)."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    _abort_runtime(f"raised {type(exc).__name__}" + (f": {text}" if text else ""))
    return {"ok": False, "type": type(exc).__name__, "message": str(exc),
            "traceback": traceback.format_exc()}


@contextlib.contextmanager
def _logging_to(queue: Any):
    """``ray_logger.log`` in this actor sends to ``queue`` (the driver's callbacks) meanwhile."""
    from . import ray_logger

    ray_logger.configure(queue)
    try:
        yield
    finally:
        ray_logger.configure(None)


class RankFailure(Exception):
    """A rank's function raised; the message carries its traceback (``run_remote``)."""


class Worker:
    """One rank. Methods are called by the executor only."""

    def __init__(self):
        self.executable = None

    def where(self) -> Dict[str, Any]:
        """This actor's Ray node id, host name, address, process id and Ray GPU ids."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(),
                "hostname": socket.gethostname(),
                "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "gpu_ids": [str(i) for i in ray.get_gpu_ids()]}

    def set_env(self, env: Mapping[str, str]) -> None:
        """Take the job's variables; ``hvdlike.init()`` in this process reads them."""
        os.environ.update(env)

    def start_executable(self, cls: Optional[type], args: Sequence[Any],
                         kwargs: Mapping[str, Any]) -> dict:
        if cls is None:
            return {"ok": True, "value": None}
        result = outcome_of(cls, args, kwargs, sent=False)
        if result["ok"]:
            self.executable, result["value"] = result["value"], None
        return result

    def execute(self, fn: Callable[[Any], Any], queue: Any = None) -> dict:
        """``fn(executable)``, the object made by ``start(executable_cls=...)`` (or None)."""
        with _logging_to(queue):
            return outcome_of(fn, (self.executable,), {})

    def run(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
            queue: Any = None) -> dict:
        """``fn(*args, **kwargs)``; ``ray_logger.log`` sends to ``queue`` meanwhile."""
        with _logging_to(queue):
            return outcome_of(fn, args, kwargs)

    def run_elastic(self, env: Mapping[str, str], fn: Callable[[Any], Any], cls: Optional[type],
                    args: Sequence[Any], kwargs: Mapping[str, Any], queue: Any = None) -> dict:
        """One rank of an elastic job: take its variables, build the executable, run ``fn``.

        A rank the job leaves out of a generation ends with ``SystemExit(0)``
        inside ``hvd.elastic.run``: that is ``{"ok": True, "left": True}``.
        """
        self.set_env(env)
        made = self.start_executable(cls, args, kwargs)
        if not made["ok"]:
            return made
        try:
            with _logging_to(queue):
                return outcome_of(fn, (self.executable,), {})  # its value checked picklable there
        except SystemExit:  # outcome_of lets only an elastic rank's clean exit through
            return {"ok": True, "left": True}

    def call(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """Like :meth:`run`, but returns the value itself and raises :class:`RankFailure`."""
        outcome = outcome_of(fn, args, kwargs)
        if not outcome["ok"]:
            raise RankFailure(f"{outcome['type']}: {outcome['message']}\n{outcome['traceback']}")
        return outcome["value"]
