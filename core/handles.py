"""Handles: what an asynchronous collective returns and ``synchronize`` waits on.

A handle is a few slots, not a ``threading.Event``: collectives are
submitted and completed by the hundred per step, and most handles are
already complete when someone waits on them. An event to block on is made
only when a thread actually waits on a pending handle. One lock per runtime
(shared by all of its handles) orders completion against waiting;
:func:`finish_many` completes a whole fused batch under a single acquisition.
The lock is held only for a few attribute writes, never while waiting.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, Optional, Sequence

from .errors import HvdlikeInternalError

class Handle:
    """The pending result of one collective.

    Completed exactly once by the runtime, with a result or an exception.
    ``poll()`` never blocks; ``wait()`` blocks until completion, checking
    ``alive`` so a dead runtime turns into an error instead of a hang.

    Args:
        name: the collective's name.
        lock: guards the done flag, waiter and callbacks; the runtime passes
            its own, shared by all its handles (None: a lock of its own).
    """

    __slots__ = ("name", "_lock", "_done", "_result", "_error", "_waiter")

    def __init__(self, name: str, lock: Optional[threading.Lock] = None):
        self.name = name
        self._lock = threading.Lock() if lock is None else lock
        self._done = False
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._waiter: Optional[threading.Event] = None  # made by the first wait()

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"<hvdlike Handle {self.name!r} {state}>"

    def done(self) -> bool:
        return self._done

    def set_result(self, result: Any) -> None:
        self._finish(result, None)

    def set_error(self, error: BaseException) -> None:
        self._finish(None, error)

    def _finish(self, result: Any, error: Optional[BaseException]) -> None:
        with self._lock:
            if self._done:
                return
            self._result, self._error = result, error
            self._done = True
            waiter = self._waiter
        if waiter is not None:
            waiter.set()

    def wait(self, alive: Callable[[], Optional[BaseException]] = lambda: None,
             timeout: Optional[float] = None) -> Any:
        """Block until done; return the result or raise the error.

        Args:
            alive: returns the runtime's fatal error if it has died, else None.
            timeout: seconds before giving up with ``TimeoutError``; None waits
                as long as the runtime lives.
        """
        if not self._done:
            self._block(alive, timeout)
        if self._error is not None:
            raise self._error
        return self._result

    def _block(self, alive: Callable[[], Optional[BaseException]],
               timeout: Optional[float]) -> None:
        with self._lock:
            if self._done:
                return
            waiter = self._waiter
            if waiter is None:
                waiter = self._waiter = threading.Event()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not waiter.wait(0.05):
            fatal = alive()
            if fatal is not None and not self._done:
                kind = type(fatal) if isinstance(fatal, HvdlikeInternalError) \
                    else HvdlikeInternalError
                raise kind(f"collective {self.name!r} cannot complete: {fatal}") from fatal
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"collective {self.name!r} did not complete in {timeout}s")


def finish_many(handles: Sequence[Handle], results: Sequence[Any],
                errors: Optional[Dict[int, BaseException]] = None) -> None:
    """Complete ``handles[i]`` with ``results[i]`` (or ``errors[i]``), under one lock.

    Equivalent to calling ``set_result``/``set_error`` on each in order; waiters
    are woken after the lock is released. The handles must
    share one lock (they come from one runtime).
    """
    if not handles:
        return
    wake = []
    with handles[0]._lock:  # one runtime's handles share one lock
        for i, (handle, result) in enumerate(zip(handles, results)):
            if handle._done:
                continue
            if errors and i in errors:
                handle._error = errors[i]
            else:
                handle._result = result
            handle._done = True
            if handle._waiter is not None:
                wake.append(handle._waiter)
    for waiter in wake:
        waiter.set()
