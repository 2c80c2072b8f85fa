"""The retry loop behind ``hvd.elastic.run``.

A lost peer surfaces as ``HorovodInternalError`` from a collective: restore the
last commit, re-form, sync, call again. New or removed hosts surface as
:class:`HostsUpdatedInterrupt` from a commit: re-form without restoring (every
rank is at the same commit). Any other exception is the user's and propagates:
the process fails with its traceback, and the launcher treats it as a lost rank.
"""

from __future__ import annotations

import functools
from typing import Callable, List, Optional

from hvdlike.core.errors import (DeadlockError, HorovodInternalError, HostsUpdatedInterrupt,
                                 MismatchError)
from hvdlike.core.log import logger

from . import worker as worker_mod

Translator = Callable[[BaseException], Optional[BaseException]]
_TRANSLATORS: List[Translator] = []


def register_translator(translator: Translator) -> None:
    """Let the loop see through a framework's wrapping of hvdlike's exceptions.

    ``translator(exc)`` returns the hvdlike exception that ``exc`` carries, or
    None when it carries none. Registering the same function twice is a no-op.
    """
    if translator not in _TRANSLATORS:
        _TRANSLATORS.append(translator)


def _translate(exc: BaseException) -> BaseException:
    """The hvdlike exception ``exc`` stands for (``exc`` itself if none does)."""
    for translator in list(_TRANSLATORS):
        try:
            found = translator(exc)
        except Exception:  # noqa: BLE001 - a broken translator must not hide exc
            logger.exception("elastic: exception translator %r failed", translator)
            continue
        if found is not None:
            return found
    return exc


def _reraise(caught: BaseException, exc: BaseException):
    """Propagate ``exc``; when it was unwrapped from ``caught``, without the wrapper."""
    if exc is caught:
        raise caught
    raise exc.with_traceback(exc.__traceback__) from None


_WARNED_RESTARTS = []


def _warn_under_restarting_agent(is_elastic: Callable[[], bool]) -> None:
    """Once per process: say that torchrun's restarts do not resume from a commit.

    ``torchrun --max-restarts N`` answers a failure by starting every worker
    again from the top of its script; ``state.commit()`` lives in the workers'
    memory, so the new workers start from what the script loads, not from the
    last commit. Users who moved from ``hvdlike-run --min-np`` may expect more.
    """
    import os

    if _WARNED_RESTARTS or is_elastic():
        return
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0").strip()
    if not restarts.isdigit() or int(restarts) == 0:
        return
    _WARNED_RESTARTS.append(True)
    logger.warning(
        "hvd.elastic.run under torchrun --max-restarts: a failure restarts every worker from "
        "the start of its script, so commits (state.commit()) do not carry over; save a "
        "checkpoint and load it at start to resume, or launch with hvdlike-run --min-np to "
        "re-form in place from the last commit")


def run_fn(func: Callable, reset: Callable[[], None],
           is_elastic: Optional[Callable[[], bool]] = None) -> Callable:
    """Wrap ``func(state, *args, **kwargs)`` in the elastic retry loop.

    Args:
        func: the training function; its first argument is a :class:`State`.
        reset: leaves the current generation and joins the next (shutdown + init).
        is_elastic: whether a re-form is possible (default: the launcher runs
            this job elastically); when not, errors propagate unchanged.
    """
    if is_elastic is None:
        def is_elastic() -> bool:
            return worker_mod.context().enabled

    name = getattr(func, "__qualname__", None) or repr(func)

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        missing = [m for m in ("sync", "restore", "on_reset") if not hasattr(state, m)]
        if missing:
            raise TypeError(
                f"hvd.elastic.run: the first argument of {name}() must be the elastic state "
                f"(hvd.elastic.TorchState, ObjectState ...), got {type(state).__name__} (it has no "
                f"{', '.join(missing)})")
        _warn_under_restarting_agent(is_elastic)
        skip_sync = False
        reformed = False
        while True:
            try:
                if reformed:
                    # Inside the try: a reset callback's collective that fails on a
                    # peer lost during the re-form is retried like any other.
                    reformed = False
                    state.on_reset()
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except Exception as caught:  # noqa: BLE001 - sorted out just below
                exc = _translate(caught)
                if isinstance(exc, HorovodInternalError):
                    if not is_elastic() or isinstance(exc, (MismatchError, DeadlockError)):
                        # Ranks that disagree, or wait on each other, would do so again
                        # after a re-form (and nobody left: no new generation would come).
                        _reraise(caught, exc)
                    logger.warning("collective failed (%s); restoring the last commit and "
                                   "re-forming", exc)
                    state.restore()
                    skip_sync = False
                elif isinstance(exc, HostsUpdatedInterrupt):
                    if not is_elastic():
                        _reraise(caught, exc)
                    skip_sync = exc.skip_sync
                else:
                    _reraise(caught, exc)
            reset()
            reformed = True

    return wrapper


def reset() -> None:
    """Leave the current generation and join the launcher's next one (shutdown + init).

    The next runtime continues this one's knobs, process sets, timeline and
    tuning (:mod:`.carry`).
    """
    from hvdlike.core import api, current

    from . import carry as carry_mod

    live = current.SLOT.runtime
    carried = carry_mod.capture(live) if live is not None else None
    worker_mod.reset(lambda: carry_mod.resume(carried), api.shutdown)


def run(func: Callable) -> Callable:
    """Decorator: run ``func(state, ...)`` and re-form the job when ranks come or go.

    On ``HorovodInternalError`` (a lost peer) the last commit is restored; on
    ``HostsUpdatedInterrupt`` the state is kept. Either way the runtime is
    re-initialized with the launcher's next generation, rank 0's state is
    broadcast, and ``func`` is called again. Other exceptions propagate. Every
    front end's ``hvd.elastic.run`` is this function.
    """
    return run_fn(func, reset)
