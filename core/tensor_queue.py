"""The queue between user threads and the background coordinator thread."""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional

from .errors import DuplicateNameError
from .handles import Handle
from .messages import OpType, Request


class Entry:
    """A submitted collective: its request plus the local tensors it works on.

    Attributes:
        request: what was asked for (sent to the coordinator).
        tensor: input tensor (torch, contiguous).
        output: tensor the result is written to (may be ``tensor`` for in-place
            ops), or None when the executor allocates it.
        handle: completed when the collective finishes (made by the runtime on
            submission, with the runtime's handle lock).
        finish: optional hook turning the raw result into what the handle holds.
        enqueued_at: monotonic time of submission (stall inspector, timeline).
        negotiated_at: monotonic time the ranks agreed to run it (set only while
            a timeline records: the end of NEGOTIATE, the start of QUEUE).
        origin: the front end that submitted it (named when its name clashes).

    A plain class with ``__slots__``: one is made per submitted tensor, and
    without an instance dictionary it is one allocation instead of two (one
    less object for the cyclic garbage collector to visit).
    """

    __slots__ = ("request", "tensor", "output", "handle", "finish", "enqueued_at", "set_id",
                 "negotiated_at", "origin")

    def __init__(self, request: Request, tensor: Any, output: Any, handle: Optional[Handle],
                 finish: Optional[Callable[[Any], Any]] = None, enqueued_at: float = 0.0,
                 set_id: int = 0, negotiated_at: float = 0.0, origin: str = ""):
        self.request = request
        self.tensor = tensor
        self.output = output
        self.handle = handle
        self.finish = finish
        self.enqueued_at = enqueued_at
        self.set_id = set_id
        self.negotiated_at = negotiated_at
        self.origin = origin

    def __repr__(self) -> str:
        name = getattr(self.request, "name", None)
        return f"<hvdlike Entry {name!r}>"


class TensorQueue:
    """Thread-safe FIFO of entries, refusing a name already in flight.

    No lock on the per-tensor path: a thread blocked on a queue lock held by a
    thread the GIL had just switched away from waits for two GIL hand-offs
    (up to the 5 ms switch interval each), which submitting hundreds of
    tensors per step hit constantly. Instead every step is one atomic
    operation of a built-in container (``dict.setdefault``/``pop``/``copy``,
    ``deque.append``/``popleft``). One thread drains (the background thread).
    """

    def __init__(self):
        self._pending: "collections.deque" = collections.deque()  # entries, or a group's list
        self._inflight: Dict[str, Entry] = {}  # name -> entry, until completed
        self.wakeup = threading.Event()

    def put(self, entries: List[Entry]) -> None:
        """Add entries atomically (a group is drained in one piece).

        Raises:
            DuplicateNameError: a name is in flight already or repeats within
                ``entries``; ``holder`` is the in-flight entry (or None).
        """
        if len(entries) == 1:
            self.put_one(entries[0])
            return
        self._claim(entries)
        self._pending.append(list(entries))
        if not self.wakeup.is_set():
            self.wakeup.set()

    def put_one(self, entry: Entry) -> None:
        """:meth:`put` of a single entry (the collective submitted by the hundred per step)."""
        prior = self._inflight.setdefault(entry.request.name, entry)
        if prior is not entry:
            raise _duplicate(entry.request.name, prior)
        self._pending.append(entry)
        # Drain clears the event before taking entries, so an entry appended
        # while it is still set is taken by that drain: no set() needed.
        if not self.wakeup.is_set():
            self.wakeup.set()

    def claim(self, entry: Entry) -> None:
        """Mark ``entry``'s name in flight without queueing it (the caller runs
        it itself, see ``Runtime.run``)."""
        prior = self._inflight.setdefault(entry.request.name, entry)
        if prior is not entry:
            raise _duplicate(entry.request.name, prior)

    def _claim(self, entries: List[Entry]) -> None:
        """Mark every name of a group in flight, or none of them."""
        inflight = self._inflight
        claimed = []
        for entry in entries:
            name = entry.request.name
            prior = inflight.setdefault(name, entry)
            if prior is not entry:
                for done in claimed:
                    inflight.pop(done.request.name, None)
                raise _duplicate(name, None if any(prior is c for c in claimed) else prior)
            claimed.append(entry)

    def drain(self) -> List[Entry]:
        self.wakeup.clear()
        pending = self._pending
        entries: List[Entry] = []
        while True:
            try:
                item = pending.popleft()
            except IndexError:
                return entries
            if type(item) is list:
                entries.extend(item)
            else:
                entries.append(item)

    def has_pending(self) -> bool:
        """Entries submitted and not drained yet."""
        return bool(self._pending)

    def release(self, name: str) -> None:
        self._inflight.pop(name, None)

    def release_many(self, names: Iterable[str]) -> None:
        """:meth:`release` for several names."""
        pop = self._inflight.pop
        for name in names:
            pop(name, None)

    def inflight(self) -> int:
        return len(self._inflight)

    def waiting_since(self) -> dict:
        """Snapshot ``{name: submission time}`` of every collective not yet completed."""
        snapshot = self._inflight.copy()  # one atomic copy; other threads keep mutating
        return {name: entry.enqueued_at for name, entry in snapshot.items()}

    def joins(self) -> List[str]:
        """Names of the joins among the collectives not yet completed."""
        snapshot = self._inflight.copy()
        return [name for name, entry in snapshot.items() if entry.request.op == OpType.JOIN]


def _duplicate(name: str, holder: Optional[Entry]) -> DuplicateNameError:
    error = DuplicateNameError(
        f"a collective named {name!r} is already in flight; wait for it "
        f"(synchronize its handle) before submitting the name again")
    error.holder = holder
    return error
