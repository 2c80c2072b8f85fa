"""The queue between user threads and the background coordinator thread."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional

from .errors import DuplicateNameError
from .handles import Handle
from .messages import Request


@dataclasses.dataclass
class Entry:
    """A submitted collective: its request plus the local tensors it works on.

    Attributes:
        request: what was asked for (sent to the coordinator).
        tensor: input tensor (torch, contiguous).
        output: tensor the result is written to (may be ``tensor`` for in-place
            ops), or None when the executor allocates it.
        handle: completed when the collective finishes.
        finish: optional hook turning the raw result into what the handle holds.
        enqueued_at: monotonic time of submission (stall inspector, timeline).
        negotiated_at: monotonic time the ranks agreed to run it (set only while
            a timeline records: the end of NEGOTIATE, the start of QUEUE).
        origin: the front end that submitted it (named when its name clashes).
    """

    request: Request
    tensor: Any
    output: Any
    handle: Handle
    finish: Optional[Callable[[Any], Any]] = None
    enqueued_at: float = 0.0
    set_id: int = 0
    negotiated_at: float = 0.0
    origin: str = ""


class TensorQueue:
    """Thread-safe FIFO of entries, refusing a name already in flight."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: List[Entry] = []
        self._inflight: Dict[str, Entry] = {}  # name -> entry, until completed
        self.wakeup = threading.Event()

    def put(self, entries: List[Entry]) -> None:
        """Add entries atomically (a group is drained in one piece).

        Raises:
            DuplicateNameError: a name is in flight already or repeats within
                ``entries``; ``holder`` is the in-flight entry (or None).
        """
        inflight = self._inflight
        with self._lock:
            if len(entries) == 1:
                entry = entries[0]
                name = entry.request.name
                if name in inflight:
                    raise _duplicate(name, inflight[name])
                inflight[name] = entry
                self._pending.append(entry)
            else:
                names = [e.request.name for e in entries]
                dup = [n for n in names if n in inflight]
                if dup or len(set(names)) != len(names):
                    dup = dup or [n for n in names if names.count(n) > 1]
                    raise _duplicate(dup[0], inflight.get(dup[0]))
                for entry in entries:
                    inflight[entry.request.name] = entry
                self._pending.extend(entries)
        # Cheaper than set() when already set: the loop has not drained since.
        if not self.wakeup.is_set():
            self.wakeup.set()

    def drain(self) -> List[Entry]:
        with self._lock:
            entries, self._pending = self._pending, []
            self.wakeup.clear()
        return entries

    def release(self, name: str) -> None:
        with self._lock:
            self._inflight.pop(name, None)

    def release_many(self, names: Iterable[str]) -> None:
        """:meth:`release` for several names under one lock acquisition."""
        pop = self._inflight.pop
        with self._lock:
            for name in names:
                pop(name, None)

    def inflight(self) -> int:
        with self._lock:
            return len(self._inflight)

    def waiting_since(self) -> dict:
        """Snapshot ``{name: submission time}`` of every collective not yet completed."""
        with self._lock:
            return {name: entry.enqueued_at for name, entry in self._inflight.items()}


def _duplicate(name: str, holder: Optional[Entry]) -> DuplicateNameError:
    error = DuplicateNameError(
        f"a collective named {name!r} is already in flight; wait for it "
        f"(synchronize its handle) before submitting the name again")
    error.holder = holder
    return error
