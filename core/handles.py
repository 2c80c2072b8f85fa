"""Handles: what an asynchronous collective returns and ``synchronize`` waits on."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from .errors import HvdlikeInternalError


class Handle:
    """The pending result of one collective.

    Completed exactly once by the runtime, with a result or an exception.
    ``poll()`` never blocks; ``wait()`` blocks until completion, checking
    ``alive`` so a dead runtime turns into an error instead of a hang.
    """

    __slots__ = ("name", "_event", "_result", "_error", "_callbacks", "_lock")

    def __init__(self, name: str):
        self.name = name
        self._event = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._callbacks = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = "done" if self._event.is_set() else "pending"
        return f"<hvdlike Handle {self.name!r} {state}>"

    def done(self) -> bool:
        return self._event.is_set()

    def set_result(self, result: Any) -> None:
        self._finish(result, None)

    def set_error(self, error: BaseException) -> None:
        self._finish(None, error)

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self, result: Any, error: Optional[BaseException]) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._result, self._error = result, error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    def wait(self, alive: Callable[[], Optional[BaseException]] = lambda: None,
             timeout: Optional[float] = None) -> Any:
        """Block until done; return the result or raise the error.

        Args:
            alive: returns the runtime's fatal error if it has died, else None.
            timeout: seconds before giving up with ``TimeoutError``; None waits
                as long as the runtime lives.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._event.wait(0.05):
            fatal = alive()
            if fatal is not None and not self._event.is_set():
                kind = type(fatal) if isinstance(fatal, HvdlikeInternalError) \
                    else HvdlikeInternalError
                raise kind(f"collective {self.name!r} cannot complete: {fatal}") from fatal
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"collective {self.name!r} did not complete in {timeout}s")
        if self._error is not None:
            raise self._error
        return self._result
