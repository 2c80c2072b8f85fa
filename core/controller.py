"""One negotiation cycle of one process set.

Per cycle, every member rank:

1. sorts newly submitted entries into cache hits (known by slot) and misses;
2. joins one small sum-allreduce of ``[ready bits | invalid bits | flags]``
   indexed by cache slot -- this is all the control traffic in steady state;
3. evicts slots any rank invalidated (its request for that name changed);
4. takes every slot all ranks marked ready, in slot order;
5. only if some rank has uncached work: gathers the uncached requests to
   rank 0, whose :class:`Coordinator` validates and orders them, and
   receives the new responses by broadcast, caching them in that order
   (all but those of names made for one call, ``Response.once``).

The result is the same ordered list of responses on every rank, each paired
with the local entry it completes (None on a rank that joined and only
stands in with neutral values).
"""

from __future__ import annotations

import pickle
import time
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from .coordinator import Coordinator
from .errors import HvdlikeInternalError, malformed_message
from .messages import OpType, Request, Response, malformed
from .response_cache import Lookup, ResponseCache
from .sequence import LearnedSequence
from .tensor_queue import Entry

FLAG_UNCACHED = 0
FLAG_SHUTDOWN = 1
FLAG_JOINED = 2
NUM_FLAGS = 3


class ControlPlane(Protocol):
    """The three control collectives negotiation needs (see transport.py)."""

    rank: int
    size: int

    def allreduce_sum(self, values: Sequence[int]) -> List[int]: ...

    # Optional: ``allreduce_min(value) -> int`` enables the one-word fast path.

    def gather(self, payload: bytes) -> Optional[List[bytes]]: ...

    def broadcast(self, payload: Optional[bytes]) -> bytes: ...


class CycleResult:
    """What one cycle agreed on.

    ``work`` is in execution order: first the responses agreed through the
    response cache, then from index ``coordinated`` (None: none this cycle) those
    the coordinator returned. ``fast``: the cache part was agreed by the one-word
    learned-order vote. (``fast``/``coordinated`` describe how, for the timeline.)
    """

    __slots__ = ("work", "shutdown", "fast", "coordinated", "voted")

    def __init__(self):
        self.work: List[Tuple[Response, Optional[Entry]]] = []
        self.shutdown = False
        self.fast = False
        # Every member's input of ``work[0]`` (an allreduce), exchanged with the
        # vote: the executor reduces it from these, with no exchange of its own.
        self.voted = None
        self.coordinated: Optional[int] = None


class Controller:
    """Negotiation state of one rank in one process set."""

    def __init__(self, control: ControlPlane, cache_capacity: int,
                 record_arrivals: Callable[[], bool] = lambda: False,
                 ranks: Optional[Sequence[int]] = None):
        self.control = control
        self.rank = control.rank
        self.size = control.size
        # The members' global ranks, to name a member in an error.
        self.ranks = list(ranks) if ranks is not None else list(range(self.size))
        self.cache = ResponseCache(cache_capacity)
        self.coordinator = (Coordinator(self.size, record_arrivals, self.ranks)
                            if self.rank == 0 else None)
        self._cached: Dict[int, Entry] = {}  # slot -> entry waiting for all ranks
        self._uncached: Dict[str, Entry] = {}  # name -> entry waiting for a response
        self._to_send: List[Request] = []
        self._joined = False
        self.sequence = LearnedSequence()
        self._allreduce_min = getattr(control, "allreduce_min", None)
        # A control plane that can carry data in the fast cycle's vote (shared
        # memory) always votes through it; ``speculate(response, entry,
        # capacity)`` (the executor's ``offer``, set by the process set) says
        # what the next allreduce in the learned order would send with it.
        self._vote = getattr(control, "vote", None)
        self._vote_capacity = getattr(control, "vote_capacity", 0)
        self.speculate: Optional[Callable[..., Optional[tuple]]] = None
        self.voted_allreduces = 0  # allreduces whose input travelled with the vote
        self.cycles = 0
        self.slow_cycles = 0
        self.fast_cycles = 0
        # Seconds the last cycle spent in control collectives (the rest of a
        # cycle is local bookkeeping per submitted tensor).
        self.last_control_seconds = 0.0

    @property
    def idle(self) -> bool:
        return not (self._cached or self._uncached or self._to_send)

    def pending_entries(self) -> List[Entry]:
        return list(self._cached.values()) + list(self._uncached.values())

    def _miss(self, entry: Entry) -> None:
        self._uncached[entry.request.name] = entry
        # The coordinator needs the sender's rank; only requests it sees carry it.
        self._to_send.append(entry.request.with_rank(self.rank))

    def _evict(self, slot: int) -> None:
        """Forget ``slot``; an entry of ours waiting on it is renegotiated."""
        self.cache.evict(slot)
        self._evicted(slot)

    def _evicted(self, slot: int) -> None:
        """The cache dropped ``slot``'s name: renegotiate an entry of ours waiting on it.

        Not ``_evict``: ``ResponseCache.put`` may already have handed the freed
        slot to the new response, which a second eviction would throw away.
        """
        self.sequence.reset()
        entry = self._cached.pop(slot, None)
        if entry is not None:
            self._miss(entry)

    def cycle(self, entries: Sequence[Entry], shutdown: bool = False) -> CycleResult:
        self.cycles += 1
        self.last_control_seconds = 0.0
        result = CycleResult()
        invalid = set()
        cached = self._cached
        slots = self.cache.own_slots(entries)
        if (slots is not None and len(set(slots)) == len(slots)
                and cached.keys().isdisjoint(slots)):
            # Every entry a hit (so no join, and no group only partly cached):
            # what the loop below would do for each, in three calls.
            cached.update(zip(slots, entries))
            entries = ()
        requests = [e.request for e in entries]
        lookups = self.cache.lookup_many(requests)
        partial_groups = self._partially_cached_groups(requests, lookups)
        join, hit = OpType.JOIN, Lookup.HIT
        for entry, req, (kind, slot) in zip(entries, requests, lookups):
            if req.op == join:
                self._joined = True
                self._miss(entry)
            elif kind is hit and slot not in cached and not (
                    req.group and req.group in partial_groups):
                cached[slot] = entry
            else:
                # A group partly cached is negotiated whole (see below).
                if kind is Lookup.CONFLICT:
                    invalid.add(slot)
                self._miss(entry)

        if self._allreduce_min is not None and self._fast_cycle(result, invalid, shutdown):
            return result
        return self._full_cycle(result, invalid, shutdown)

    def cycle_one(self, entry: Entry) -> Optional[CycleResult]:
        """:meth:`cycle` of ``[entry]`` when nothing else is pending here and
        ``entry`` is the cached tensor the learned order expects next: the case of
        a synchronous collective in a loop, which the runtime runs on the
        caller's thread (``Runtime.run``). The same cycle, votes and result as
        :meth:`cycle` gives, without the per-batch sorting; None (and nothing
        done) in any other case.
        """
        request = entry.request
        order = self.sequence.order
        if (order is None or self._vote is None or request.group or self._joined
                or request.op is OpType.JOIN or not self.idle):
            return None
        kind, slot = self.cache.lookup(request)
        if kind is not Lookup.HIT or order[self.sequence.pos] != slot:
            return None
        self.cycles += 1
        self.last_control_seconds = 0.0
        result = CycleResult()
        self._cached[slot] = entry
        if self._fast_cycle(result, (), False):
            return result
        return self._full_cycle(result, set(), False)

    def _full_cycle(self, result: CycleResult, invalid, shutdown: bool) -> CycleResult:
        """The bit-vector negotiation (and the coordinator's, for uncached work)."""
        n = self.cache.num_slots
        vec = [0] * (2 * n + NUM_FLAGS)
        # A joined rank is already counted by FLAG_JOINED; its ready bits weigh
        # size + 1 so the sum still tells how many *active* ranks are ready
        # (total % (size + 1)) without counting the joined rank twice.
        weight = self.size + 1 if self._joined else 1
        for slot in self._cached:
            vec[slot] = weight
        for slot in invalid:
            vec[n + slot] = 1
        vec[2 * n + FLAG_UNCACHED] = 1 if self._to_send else 0
        vec[2 * n + FLAG_SHUTDOWN] = 1 if shutdown else 0
        vec[2 * n + FLAG_JOINED] = 1 if self._joined else 0
        started = time.perf_counter()
        total = self.control.allreduce_sum(vec)
        self.last_control_seconds += time.perf_counter() - started
        flags = total[2 * n:]
        if flags[FLAG_SHUTDOWN]:
            result.shutdown = True
            return result

        invalidated = total[n:2 * n]
        if any(invalidated):
            groups = set()
            for slot, bad in enumerate(invalidated):
                if bad:
                    entry = self._cached.get(slot)
                    if entry is not None and entry.request.group:
                        groups.add(entry.request.group)
                    self._evict(slot)
            if groups:
                # A group is negotiated whole: its members still waiting on valid
                # slots here go to the coordinator with the invalidated one, as
                # they did on the rank whose request changed (a partly cached group).
                for slot in [s for s, e in self._cached.items() if e.request.group in groups]:
                    self._miss(self._cached.pop(slot))
        joined = flags[FLAG_JOINED]
        self._run_cached([slot for slot, votes in enumerate(total[:n])
                          if votes and (votes % (self.size + 1)) + joined >= self.size
                          and not invalidated[slot]], result)

        if flags[FLAG_UNCACHED]:
            self.slow_cycles += 1
            result.coordinated = len(result.work)
            result.work.extend(self._negotiate_uncached())
        return result

    def _malformed(self, member: int, problem: str) -> HvdlikeInternalError:
        return malformed_message(self.ranks[member], problem)

    def _requests_from(self, member: int, data: bytes) -> List[Request]:
        """Member ``member``'s requests of this cycle, each checked (coordinator only)."""
        try:
            requests = pickle.loads(data)
        except Exception as exc:  # noqa: BLE001 - whatever it was, it names the sender
            raise self._malformed(member, f"its requests do not decode "
                                          f"({type(exc).__name__}: {exc})") from None
        if not isinstance(requests, list):
            raise self._malformed(member, f"a {type(requests).__name__} where a list of "
                                          f"requests belongs")
        for request in requests:
            problem = malformed(request, member, self.size)
            if problem:
                raise self._malformed(member, problem)
        return requests

    def _responses_from(self, data: bytes) -> List[Response]:
        try:
            responses = pickle.loads(data)
        except Exception as exc:  # noqa: BLE001
            raise self._malformed(0, f"the responses do not decode "
                                     f"({type(exc).__name__}: {exc})") from None
        if not isinstance(responses, list) or not all(isinstance(r, Response)
                                                      for r in responses):
            raise self._malformed(0, "responses that are not a list of responses")
        return responses

    def _partially_cached_groups(self, requests: Sequence[Request], lookups) -> set:
        """Groups with some members cached and some not.

        The coordinator releases a group only once all its members were
        requested, so a group whose members were partly evicted must be
        negotiated whole, never split between cache and coordinator. Caches
        are identical on every rank, so every rank decides alike.
        """
        hits: Dict[str, List[bool]] = {}
        for request, (kind, _) in zip(requests, lookups):
            group = request.group
            if group:
                hits.setdefault(group, []).append(kind is Lookup.HIT)
        return {g for g, h in hits.items() if any(h) and not all(h)}

    def _run_cached(self, slots: List[int], result: CycleResult) -> None:
        """Execute cached ``slots`` in this order (every rank runs the same slots alike)."""
        if not slots:
            return
        responses = self.cache.take(slots)
        self.sequence.executed_many(slots)
        pop = self._cached.pop
        result.work.extend(zip(responses, [pop(slot, None) for slot in slots]))

    def _fast_cycle(self, result: CycleResult, invalid, shutdown: bool) -> bool:
        """Negotiate with one MIN-allreduced word when every rank follows the order.

        Each rank votes how many slots of the learned order, from the agreed
        position on, it has ready -- or -1 when it needs the full vector
        (uncached or invalidated work, shutdown, join, or ready tensors it
        cannot place in the order). Idle ranks vote 0. Returns False when the
        full negotiation must run this cycle (on every rank alike).
        """
        if self._to_send or invalid or shutdown or self._joined:
            vote = -1
        elif not self._cached:
            vote = 0
        else:
            vote = self.sequence.ready_prefix(self._cached) or -1
        started = time.perf_counter()
        parts = None
        if self._vote is None:
            agreed = self._allreduce_min(vote)
        else:
            offer = None
            if vote > 0 and self.speculate is not None:
                slot = self.sequence.order[self.sequence.pos]
                offer = self.speculate(self.cache.response(slot), self._cached[slot],
                                       self._vote_capacity)
                if offer is not None:
                    offer = (slot,) + offer
            agreed, parts = self._vote(vote, offer)
        self.last_control_seconds = time.perf_counter() - started
        if agreed < 0:
            return False
        self.fast_cycles += 1
        result.fast = True
        self._run_cached(self.sequence.take(agreed), result)
        if parts is not None:
            self.voted_allreduces += 1
            result.voted = parts
        return True

    def _negotiate_uncached(self) -> List[Tuple[Response, Optional[Entry]]]:
        payload = pickle.dumps(self._to_send, protocol=pickle.HIGHEST_PROTOCOL)
        self._to_send = []
        gathered = self.control.gather(payload)
        blob = None
        if self.coordinator is not None:
            for member, data in enumerate(gathered):
                self.coordinator.add(self._requests_from(member, data))
            blob = pickle.dumps(self.coordinator.ready(), protocol=pickle.HIGHEST_PROTOCOL)
        responses = self._responses_from(self.control.broadcast(blob))
        work = []
        for response in responses:
            entry = self._uncached.pop(response.name, None)
            if response.op == OpType.JOIN:
                self._joined = False
            elif (not response.error and not response.joined and not response.once
                  and entry is not None):
                # A name made for one call (Response.once) would only fill the
                # cache: never looked up again, it would push out names that are,
                # and the ready-bit vector of a full cycle grows with the slots.
                for slot in self.cache.put(response, entry.request):
                    self._evicted(slot)
                self.sequence.reset()
            work.append((response, entry))
        return work
