"""The learned execution order of cached collectives: negotiation in one word.

Training submits the same tensors in the same order every step (gradients
arrive in backward order). Once the cached slots have executed in one order
twice in a row, every rank knows that order; negotiating a cycle then only
needs "how far along the order is every rank ready?", which is the minimum
over ranks of one integer -- a 1-element allreduce instead of a bit vector
with one entry per cache slot.

The state is derived only from the sequence of executed cached slots, which
is identical on every rank (responses execute in the same order everywhere),
so every rank holds the same :class:`LearnedSequence` without exchanging it.
Anything irregular (a tensor outside the order, new names, evictions) makes
a rank vote for the full bit-vector negotiation, and the order is learned
again from what executes.
"""

from __future__ import annotations

from typing import Collection, List, Optional, Set


class LearnedSequence:
    """The order cached slots executed in during the last complete round.

    Attributes:
        order: the round's slots in execution order, or None while learning.
        pos: index in ``order`` of the next slot expected to execute.
    """

    def __init__(self):
        self.order: Optional[List[int]] = None
        self.pos = 0
        self._round: List[int] = []
        self._seen: Set[int] = set()

    def reset(self) -> None:
        """Forget the order (slots were evicted or renamed): learn it again."""
        self.order = None
        self.pos = 0
        self._round = []
        self._seen = set()

    def ready_prefix(self, ready: Collection[int]) -> int:
        """How many slots from ``pos`` on, in order, are in ``ready`` (0 if no order)."""
        order = self.order
        if order is None:
            return 0
        k = self.pos
        end = len(order)
        while k < end and order[k] in ready:
            k += 1
        return k - self.pos

    def take(self, count: int) -> List[int]:
        """The next ``count`` slots of the order (every rank agreed they are ready)."""
        if count <= 0:
            return []
        return self.order[self.pos:self.pos + count]

    def executed_many(self, slots: List[int]) -> None:
        """:meth:`executed` for each of ``slots`` in turn, in one call.

        The same state transitions, with the state in locals: this runs for
        every cached tensor of every cycle.
        """
        order, pos = self.order, self.pos
        seen, current = self._seen, self._round
        for slot in slots:
            if order is not None:
                if order[pos] == slot:
                    pos += 1
                    if pos == len(order):
                        pos = 0
                else:
                    order = None
            if slot not in seen:
                current.append(slot)
                seen.add(slot)
                continue
            finished = current
            current = [slot]
            seen = {slot}
            if order is None and finished[0] == slot:
                order = finished
                pos = 1 % len(finished)
        self.order, self.pos = order, pos
        self._seen, self._round = seen, current

    def executed(self, slot: int) -> None:
        """Record that cached ``slot`` executed; every rank calls this in the same order."""
        order = self.order
        if order is not None:
            if order[self.pos] == slot:
                self.pos = (self.pos + 1) % len(order)
            else:
                self.order = None
        if slot not in self._seen:
            self._round.append(slot)
            self._seen.add(slot)
            return
        # A slot came round again: the slots since its last run form a round.
        finished = self._round
        self._round = [slot]
        self._seen = {slot}
        if self.order is None and finished[0] == slot:
            self.order = finished
            self.pos = 1 % len(finished)
