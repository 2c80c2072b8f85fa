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


def outcome_of(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict:
    """Call ``fn``; return ``{"ok": True, "value": ...}`` or the failure with its traceback."""
    try:
        return {"ok": True, "value": fn(*args, **dict(kwargs))}
    except SystemExit as exc:
        if exc.code in (0, None) and os.environ.get("HVDLIKE_ELASTIC_WORKER"):
            raise  # an elastic rank left out of the job: not a failure
        return _failed(exc)
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the driver
        return _failed(exc)


def _failed(exc: BaseException) -> dict:
    """The outcome of a failure (called while it is being handled, for its traceback)."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    _abort_runtime(f"raised {type(exc).__name__}" + (f": {text}" if text else ""))
    return {"ok": False, "type": type(exc).__name__, "message": str(exc),
            "traceback": traceback.format_exc()}


class RankFailure(Exception):
    """A rank's function raised; the message carries its traceback (``run_remote``)."""


class Worker:
    """One rank. Methods are called by the executor only."""

    def __init__(self):
        self.executable = None

    def where(self) -> Dict[str, Any]:
        """This actor's Ray node id, host name, address and process id."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(),
                "hostname": socket.gethostname(),
                "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}

    def set_env(self, env: Mapping[str, str]) -> None:
        """Take the job's variables; ``hvdlike.init()`` in this process reads them."""
        os.environ.update(env)

    def start_executable(self, cls: Optional[type], args: Sequence[Any],
                         kwargs: Mapping[str, Any]) -> dict:
        if cls is None:
            return {"ok": True, "value": None}
        result = outcome_of(cls, args, kwargs)
        if result["ok"]:
            self.executable, result["value"] = result["value"], None
        return result

    def execute(self, fn: Callable[[Any], Any]) -> dict:
        """``fn(executable)``, the object made by ``start(executable_cls=...)`` (or None)."""
        return outcome_of(fn, (self.executable,), {})

    def run(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict:
        return outcome_of(fn, args, kwargs)

    def run_elastic(self, env: Mapping[str, str], fn: Callable[[Any], Any], cls: Optional[type],
                    args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict:
        """One rank of an elastic job: take its variables, build the executable, run ``fn``.

        A rank the job leaves out of a generation ends with ``SystemExit(0)``
        inside ``hvd.elastic.run``: that is ``{"ok": True, "left": True}``.
        """
        self.set_env(env)
        made = self.start_executable(cls, args, kwargs)
        if not made["ok"]:
            return made
        try:
            return outcome_of(fn, (self.executable,), {})
        except SystemExit:  # outcome_of lets only an elastic rank's clean exit through
            return {"ok": True, "left": True}

    def call(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """Like :meth:`run`, but returns the value itself and raises :class:`RankFailure`."""
        outcome = outcome_of(fn, args, kwargs)
        if not outcome["ok"]:
            raise RankFailure(f"{outcome['type']}: {outcome['message']}\n{outcome['traceback']}")
        return outcome["value"]
