"""Negotiation on shared memory for a process set whose members share one host.

The steady-state cycle is one allreduce of one word (see
``controller.Controller``); over Gloo's loopback TCP it costs a few hundred
microseconds of socket round trips, here one sync point on a segment (see
:mod:`.shm_segment`) and a few reads. Every operation is an all-gather of
byte strings: each member writes its bytes (and their total length) into
its slot of one of two alternating buffers, all sync, and each member reads
what it needs. Payloads longer than a slot take several steps. Implements
``controller.ControlPlane``; called by one thread at a time (the background
thread, or the thread in ``init()`` before it starts).
"""

from __future__ import annotations

import struct
from typing import Callable, List, Optional, Sequence

from . import shm_segment
from .errors import SHUT_DOWN, HvdlikeInternalError, malformed_message
from .memo import BoundedMemo

SLOT_BYTES = 64 * 1024
_LENGTH = struct.Struct("<q")
_LENGTH_AND_WORD = struct.Struct("<qq")
# The fast cycle's vote with data (see vote()): a length word (unused), the
# vote, the cache slot of the allreduce whose input follows (-1: none) and
# its bytes; the input starts on the slot's second cache line.
_VOTE = struct.Struct("<qqqq")
_VOTE_DATA_OFFSET = 64
# No honest negotiation message comes near it (a cycle's requests take a few
# hundred bytes per tensor); a length beyond it, or below 0, is refused.
MAX_MESSAGE_BYTES = 1 << 30


class ShmControlPlane:
    """:class:`controller.ControlPlane` over a shared-memory segment.

    Args:
        settings_: the runtime's ``shm_plane.Settings``.
        store: the set's store (prefixed), for the segment name.
        rank, size: this member's rank in the set and the set's size.
        ranks: the set's global ranks (for error messages).
        abandon: returns the job's failure once there is one.
        slot_bytes: bytes of each member's message slot.
        gone: names members that are gone while the segment is set up (see
            :mod:`.store_wait`).
    """

    def __init__(self, settings_, store, rank: int, size: int, ranks: Sequence[int],
                 abandon: Callable[[], Optional[BaseException]] = lambda: None,
                 slot_bytes: int = SLOT_BYTES, gone=lambda ranks: ""):
        self.rank = rank
        self.size = size
        self.ranks = list(ranks)
        self.abandon = abandon
        self.timeout = settings_.timeout_seconds
        self.slot = slot_bytes
        self.header = shm_segment.header_bytes(size)
        total = self.header + 2 * size * slot_bytes
        self.segment = shm_segment.attach(store, "control", settings_.tag, rank, size,
                                          self.header, total, self.ranks,
                                          settings_.start_timeout_seconds, abandon, gone)
        self._step = 0
        self._views = BoundedMemo()  # shape -> vote data views, see _vote_views

    def _exchange(self, payload: bytes, wanted: Callable[[int], bool]) -> List[bytes]:
        """Every member's ``payload`` (``b""`` for members not ``wanted`` here)."""
        n, me, mm, cap = self.size, self.rank, self._mapping(), self.slot - _LENGTH.size
        pieces: List[List[bytes]] = [[] for _ in range(n)]
        totals: List[int] = []
        pos = 0
        while True:
            self._step += 1
            first = self.header + (self._step & 1) * n * self.slot
            mine = first + me * self.slot
            _LENGTH.pack_into(mm, mine, len(payload))
            piece = payload[pos:pos + cap]
            if piece:
                mm[mine + _LENGTH.size:mine + _LENGTH.size + len(piece)] = piece
            self.segment.sync("negotiation", self.ranks, self.timeout, self.abandon)
            if not totals:
                totals = [_LENGTH.unpack_from(mm, first + m * self.slot)[0] for m in range(n)]
                for m, total in enumerate(totals):
                    if not 0 <= total <= MAX_MESSAGE_BYTES:
                        raise self._malformed(m, f"a message length of {total} bytes")
            for m in range(n):
                if m == me or not wanted(m):
                    continue
                end = min(pos + cap, totals[m])
                if end > pos:
                    at = first + m * self.slot + _LENGTH.size
                    pieces[m].append(mm[at:at + end - pos])
            pos += cap
            if pos >= max(totals):
                break
        return [payload if m == me else b"".join(pieces[m]) for m in range(n)]

    def allreduce_sum(self, values: Sequence[int]) -> List[int]:
        if self.size == 1:
            return list(values)
        parts = self._exchange(struct.pack(f"<{len(values)}q", *values), lambda m: True)
        total = [0] * len(values)
        for m, part in enumerate(parts):
            if len(part) != 8 * len(values):
                raise self._malformed(m, f"{len(part)} bytes for a sum of {len(values)} "
                                         f"words ({8 * len(values)} bytes)")
            for i, v in enumerate(struct.unpack(f"<{len(part) // 8}q", part)):
                total[i] += v
        return total

    @property
    def vote_capacity(self) -> int:
        """Most bytes of allreduce input one :meth:`vote` carries."""
        return self.slot - _VOTE_DATA_OFFSET

    def vote(self, value: int, offer=None):
        """The fast cycle's MIN vote; with ``offer``, also an allreduce's input.

        ``offer`` is ``(tag, dtype, count, write)``: ``write(view)`` fills this
        member's ``count`` elements of ``dtype`` in the segment with the input
        of the allreduce in cache slot ``tag``. Returns ``(agreed, parts)``:
        ``parts`` is every member's input view, in member order, when the vote
        agreed on at least one slot and every member offered the same slot and
        size -- then that allreduce can be reduced from ``parts`` right away,
        with no exchange of its own. Otherwise ``parts`` is None, on every
        member alike (they all read the same words). The views stay valid
        until this member's next call: a member can run at most one exchange
        ahead, into the other buffer.

        Every member of the set must use this method (not :meth:`allreduce_min`)
        for its fast-cycle votes, offering or not, so the words it reads are
        this step's.
        """
        if self.size == 1:
            return value, None
        n, mm, slot = self.size, self._mapping(), self.slot
        self._step += 1
        which = self._step & 1
        first = self.header + which * n * slot
        tag, nbytes, views = -1, 0, None
        if offer is not None:
            tag, dtype, count, write = offer
            views, nbytes = self._vote_views(which, dtype, count)
            write(views[self.rank])
        _VOTE.pack_into(mm, first + self.rank * slot, 0, value, tag, nbytes)
        self.segment.sync("negotiation", self.ranks, self.timeout, self.abandon)
        unpack = _VOTE.unpack_from
        words = [unpack(mm, first + m * slot) for m in range(n)]
        agreed = min(w[1] for w in words)
        if views is None or agreed < 1 or any(w[2] != tag or w[3] != nbytes for w in words):
            return agreed, None
        return agreed, views

    def _vote_views(self, which: int, dtype, count: int):
        key = (which, dtype, count)
        hit = self._views.get(key)
        if hit is None:
            import torch

            first = self.header + which * self.size * self.slot
            views = [torch.frombuffer(self._mapping(), dtype=dtype, count=count,
                                      offset=first + m * self.slot + _VOTE_DATA_OFFSET)
                     for m in range(self.size)]
            hit = self._views.add(key, (views, count * views[0].element_size()))
        return hit

    def allreduce_min(self, value: int) -> int:
        """MIN of one word per member: one step of :meth:`_exchange`'s layout,
        unrolled. (The controller's fast cycle votes through :meth:`vote`.)"""
        if self.size == 1:
            return value
        n, mm, slot = self.size, self._mapping(), self.slot
        self._step += 1
        first = self.header + (self._step & 1) * n * slot
        _LENGTH_AND_WORD.pack_into(mm, first + self.rank * slot, _LENGTH.size, value)
        self.segment.sync("negotiation", self.ranks, self.timeout, self.abandon)
        unpack = _LENGTH_AND_WORD.unpack_from
        return min(unpack(mm, first + m * slot)[1] for m in range(n))

    def gather(self, payload: bytes) -> Optional[List[bytes]]:
        if self.size == 1:
            return [payload]
        parts = self._exchange(payload, lambda m: self.rank == 0)
        return parts if self.rank == 0 else None

    def broadcast(self, payload: Optional[bytes]) -> bytes:
        if self.size == 1:
            return payload
        parts = self._exchange(payload if self.rank == 0 else b"", lambda m: m == 0)
        return parts[0]

    def _malformed(self, member: int, problem: str) -> HvdlikeInternalError:
        return malformed_message(self.ranks[member], problem, shared_memory=True)

    def _mapping(self):
        """The segment's memory; a clear error once the runtime closed this plane
        under a thread still negotiating on it (a peer shut the job down)."""
        segment = self.segment
        if segment is None:
            raise HvdlikeInternalError(SHUT_DOWN)
        return segment.mm

    def close(self) -> None:
        # Tensors over the mapping: gone before it is unmapped.
        self._views = BoundedMemo()
        segment, self.segment = self.segment, None
        self.abandon = lambda: None
        if segment is not None:
            segment.close()
