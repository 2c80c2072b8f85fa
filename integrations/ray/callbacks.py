"""The driver side of ``run(..., callbacks=[...])``: a queue the ranks log into.

Horovod's Ray executors call each callback with every value a rank logs with
``ray_logger.log`` while the job runs. Here a Ray queue actor (no CPU) carries
the values; a driver thread hands each one to every callback in order, and
what is still queued when the ranks end is handed over before ``run`` returns.
A callback that raises stops the callbacks; ``run`` then raises its error
(after the job, whose result would otherwise hide it).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Sequence

from hvdlike.core.errors import ConfigError, HvdlikeError

POLL_SECONDS = 0.1


def check(where: str, callbacks: Optional[Sequence[Callable[[Any], Any]]]) -> List[Callable]:
    """``callbacks`` as a list of callables (None: none)."""
    if callbacks is None:
        return []
    if callable(callbacks) or not isinstance(callbacks, (list, tuple)):
        raise ConfigError(f"{where}: callbacks={callbacks!r} must be a list of callables")
    for item in callbacks:
        if not callable(item):
            raise ConfigError(f"{where}: callbacks: {item!r} is not callable")
    return list(callbacks)


class Callbacks:
    """A context manager: ``queue`` for the ranks while the job runs (None without callbacks)."""

    def __init__(self, where: str, callbacks: Optional[Sequence[Callable[[Any], Any]]]):
        self.where = where
        self.callbacks = check(where, callbacks)
        self.queue = None
        self.error: Optional[BaseException] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "Callbacks":
        import ray

        if not self.callbacks or not ray.is_initialized():  # not started: run() says so
            return self
        from ray.util.queue import Queue

        self.queue = Queue(actor_options={"num_cpus": 0})
        self._thread = threading.Thread(target=self._pump, daemon=True,
                                        name="hvdlike.ray callbacks")
        self._thread.start()
        return self

    def _pump(self) -> None:
        while not self._stop.is_set():
            self._hand_over(block=True)
        self._hand_over(block=False)  # what the ranks logged just before they ended

    def _hand_over(self, block: bool) -> None:
        from ray.util.queue import Empty

        while self.error is None:
            try:
                item = self.queue.get(timeout=POLL_SECONDS) if block else self.queue.get_nowait()
            except Empty:
                return
            except Exception:  # noqa: BLE001 - the queue actor is gone (Ray shut down)
                return
            for callback in self.callbacks:
                try:
                    callback(item)
                except BaseException as exc:  # noqa: BLE001 - reported by run()
                    self.error = exc
                    return

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        try:
            self.queue.shutdown()
        except Exception:  # noqa: BLE001 - already gone
            pass
        if self.error is not None and exc_type is None:
            raise HvdlikeError(f"{self.where}: a callback raised {type(self.error).__name__}: "
                               f"{self.error}") from self.error
