"""The response cache: steady state skips the request gather entirely.

Every rank holds an identical cache because every rank applies the same
operations (put, touch, evict) in the same order: the order of the responses
it executes. A cached name is therefore known by its *slot* number on all
ranks, and negotiation of cached names reduces to summing a vector of ready
bits indexed by slot.

Each rank also remembers the signature of its *own* request for a slot: the
same name submitted with a different shape or dtype is a conflict, which
invalidates the slot on all ranks so the name is negotiated afresh.
"""

from __future__ import annotations

import collections
import enum
import heapq
from typing import Dict, List, Optional, Tuple

from .messages import Request, Response


class Lookup(enum.Enum):
    MISS = 0
    HIT = 1
    CONFLICT = 2


_MISS = (Lookup.MISS, -1)


class ResponseCache:
    """LRU map name -> slot -> (response, own request signature, own request).

    The own request is kept too: a front end that reuses its request object
    for a name (``collectives.allreduce_entry``) is matched by identity, with
    no signature built and compared per tensor.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._lru: "collections.OrderedDict[str, int]" = collections.OrderedDict()
        self._slots: List[Optional[Tuple[Response, tuple, Request]]] = []
        self._free: List[int] = []

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def num_slots(self) -> int:
        """Length of the ready-bit vector: highest slot ever used + 1."""
        return len(self._slots)

    def lookup(self, request: Request) -> Tuple[Lookup, int]:
        slot = self._lru.get(request.name)
        if slot is None:
            return Lookup.MISS, -1
        _, signature, own = self._slots[slot]
        if own is not request and signature != request.signature():
            return Lookup.CONFLICT, slot
        return Lookup.HIT, slot

    def lookup_many(self, requests: List[Request]) -> List[Tuple[Lookup, int]]:
        """:meth:`lookup` of each request (the per-tensor path of every cycle)."""
        get = self._lru.get
        cached = self._slots
        signature = Request.signature
        hit, conflict = Lookup.HIT, Lookup.CONFLICT
        out = []
        append = out.append
        for request in requests:
            slot = get(request.name)
            if slot is None:
                append(_MISS)
                continue
            mine = cached[slot]
            if mine[2] is not request and mine[1] != signature(request):
                append((conflict, slot))
            else:
                append((hit, slot))
        return out

    def own_slots(self, entries) -> Optional[List[int]]:
        """The slot of each entry, when every entry's request is, as an object,
        the own request its slot was cached with -- the steady state of a
        training loop, found without a signature. None otherwise (then
        :meth:`lookup_many` decides entry by entry).

        Groups need no care here: a group is queued and drained whole, so when
        every entry is a hit, every group among them is wholly cached.
        """
        get = self._lru.get
        cached = self._slots
        out = []
        append = out.append
        for entry in entries:
            request = entry.request
            slot = get(request.name)
            if slot is None or cached[slot][2] is not request:
                return None
            append(slot)
        return out

    def response(self, slot: int) -> Response:
        return self._slots[slot][0]

    def touch(self, slot: int) -> None:
        self._lru.move_to_end(self._slots[slot][0].name)

    def take(self, slots: List[int]) -> List[Response]:
        """The responses of ``slots``, each touched in turn (as most recently used)."""
        cached = self._slots
        responses = [cached[slot][0] for slot in slots]
        move_to_end = self._lru.move_to_end
        for response in responses:
            move_to_end(response.name)
        return responses

    def put(self, response: Response, own: Request) -> List[int]:
        """Cache ``response``; return the slots evicted to make room."""
        if self.capacity <= 0:
            return []
        evicted = []
        old = self._lru.get(response.name)
        if old is not None:
            self.evict(old)
            evicted.append(old)
        while len(self._lru) >= self.capacity:
            oldest = next(iter(self._lru.values()))
            self.evict(oldest)
            evicted.append(oldest)
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            slot = len(self._slots)
            self._slots.append(None)
        self._slots[slot] = (response, own.signature(), own)
        self._lru[response.name] = slot
        return evicted

    def evict(self, slot: int) -> None:
        entry = self._slots[slot]
        if entry is None:
            return
        del self._lru[entry[0].name]
        self._slots[slot] = None
        heapq.heappush(self._free, slot)

    def snapshot(self) -> Dict[str, int]:
        return dict(self._lru)
