"""Names made for one call (barriers, unnamed object collectives, process-set
changes) stay out of the response cache: they could never hit it again.

Ranks are threads driving real Controllers over an in-memory control plane
(tests/unit/fake_ranks.py); the cache is read through each controller.
"""

import torch

from hvdlike.core import collectives
from hvdlike.core.controller import NUM_FLAGS, Controller
from hvdlike.core.coordinator import build_response
from hvdlike.core.handles import Handle
from hvdlike.core.messages import OpType, Request, malformed
from hvdlike.core.tensor_queue import Entry
from tests.unit.fake_ranks import Exchange, FakeControl, FastControl, run_in_threads

TRAINING = [f"allreduce.w.{i}" for i in range(10)]


class Counting(FastControl):
    """FastControl that records the length of every ready-bit vector it sums."""

    def __init__(self, exchange, rank):
        super().__init__(exchange, rank)
        self.lengths = []

    def allreduce_sum(self, values):
        self.lengths.append(len(values))
        return super().allreduce_sum(values)


def _allreduce(name, rank, once=False):
    request = Request(name=name, op=OpType.ALLREDUCE, dtype="float32", shape=(2,), rank=rank,
                      **({"once": True} if once else {}))
    return Entry(request, None, None, Handle(name))


def _barrier(i):
    entry = collectives.barrier_entry(f"barrier.noname.{i}")
    entry.handle = Handle(entry.request.name)
    return entry


def _step(rank):
    return [_allreduce(name, rank) for name in TRAINING]


def _object_collectives(first, count):
    """What the front ends submit for unnamed broadcast_object / allgather_object
    calls (collectives.*_entry with once=True)."""
    entries = []
    for i in range(first, first + count):
        entries.append(collectives.broadcast_entry(
            torch.zeros(1, dtype=torch.int64), 0, 2,
            f"broadcast.broadcast_object.noname.{i}.size", once=True))
        entries.append(collectives.allgather_entry(
            torch.zeros(3, dtype=torch.uint8), f"allgather.allgather_object.noname.{i}.data",
            once=True))
    for entry in entries:
        entry.handle = Handle(entry.request.name)
    return entries


def _run_until_done(ctl, entries):
    """Cycle until every entry of ``entries`` executed; the names that ran."""
    waiting = {e.request.name for e in entries}
    ran = []
    batch = list(entries)
    for _ in range(50):
        result = ctl.cycle(batch)
        batch = []
        for response, _ in result.work:
            assert not response.error, response.error
            ran.append(response.name)
            waiting.discard(response.name)
        if not waiting:
            return ran
    raise AssertionError(f"never ran: {sorted(waiting)[:5]}")


def test_two_thousand_barriers_and_object_collectives_leave_the_cache_to_training():
    ex = Exchange(2)
    ctls = [None, None]
    after = [None, None]

    def body(rank):
        control = Counting(ex, rank)
        ctl = ctls[rank] = Controller(control, 1024)
        for _ in range(3):
            _run_until_done(ctl, _step(rank))
        for first in range(0, 2000, 100):
            _run_until_done(ctl, [_barrier(i) for i in range(first, first + 100)])
        assert set(ctl.cache.snapshot()) == set(TRAINING)
        for first in range(0, 2000, 100):
            ran = _run_until_done(ctl, _object_collectives(first, 100))
            assert len(ran) == 200
        fast_before = ctl.fast_cycles
        control.lengths.clear()
        for _ in range(3):
            _run_until_done(ctl, _step(rank))
        after[rank] = (ctl.fast_cycles - fast_before, list(control.lengths))

    run_in_threads(2, body)
    snapshots = [ctl.cache.snapshot() for ctl in ctls]
    assert snapshots[0] == snapshots[1]
    assert set(snapshots[0]) == set(TRAINING)
    assert ctls[0].cache.num_slots == len(TRAINING)
    # A full cycle's vector is sized by the slots in use, not by the one-off names seen.
    fast, lengths = after[0]
    assert all(n == 2 * len(TRAINING) + NUM_FLAGS for n in lengths), lengths
    # The learned order survived the one-offs: the steps after them ran in fast cycles.
    assert fast >= 3 and not lengths


def test_a_barrier_between_steps_keeps_the_learned_order():
    ex = Exchange(2)
    counts = [None, None]

    def body(rank):
        control = Counting(ex, rank)
        ctl = Controller(control, 1024)
        for _ in range(3):
            _run_until_done(ctl, _step(rank))
        assert ctl.sequence.order is not None
        for epoch in range(4):
            _run_until_done(ctl, [_barrier(epoch)])
            control.lengths.clear()
            _run_until_done(ctl, _step(rank))
            assert control.lengths == [], f"epoch {epoch}: full cycles {control.lengths}"
        counts[rank] = len(ctl.cache)

    run_in_threads(2, body)
    assert counts == [len(TRAINING)] * 2


def test_a_name_used_once_by_the_user_is_still_cached():
    """Horovod's semantics for named tensors stay: a name given per step fills the
    cache (and the least recently used is evicted); capacity 0 caches nothing."""
    for capacity, expected in ((1024, 40), (16, 16), (0, 0)):
        ex = Exchange(2)
        ctls = [None, None]

        def body(rank):
            ctl = ctls[rank] = Controller(FakeControl(ex, rank), capacity)
            for step in range(40):
                _run_until_done(ctl, [_allreduce(f"allreduce.loss.{step}", rank)])

        run_in_threads(2, body)
        snapshots = [ctl.cache.snapshot() for ctl in ctls]
        assert snapshots[0] == snapshots[1]
        assert len(snapshots[0]) == expected
        if expected:
            assert "allreduce.loss.39" in snapshots[0]


def test_ranks_that_disagree_on_once_make_the_same_decision():
    for marks in ((True, False), (False, True), (True, True)):
        ex = Exchange(2)
        ctls = [None, None]

        def body(rank):
            ctl = ctls[rank] = Controller(FastControl(ex, rank), 1024)
            _run_until_done(ctl, [_allreduce("allreduce.x", rank, once=marks[rank])])

        run_in_threads(2, body)
        snapshots = [ctl.cache.snapshot() for ctl in ctls]
        assert snapshots[0] == snapshots[1]
        assert ("allreduce.x" in snapshots[0]) == (not all(marks))


def test_the_coordinator_marks_a_response_once_only_when_every_rank_did():
    def req(rank, once):
        return Request(name="barrier.noname.0", op=OpType.BARRIER, dtype="uint8", shape=(),
                       rank=rank, once=once)

    assert build_response([req(0, True), req(1, True)], 2).once
    assert not build_response([req(0, True), req(1, False)], 2).once
    assert collectives.barrier_entry("barrier.noname.3").request.once
    assert not collectives.broadcast_entry(torch.zeros(1), 0, 2, "broadcast.x").request.once
    assert not collectives.allgather_entry(torch.zeros(1), "allgather.x").request.once
    bad = Request(name="x", op=OpType.BARRIER, dtype="uint8", shape=(), rank=0)
    bad.__dict__["once"] = "yes"
    assert "once" in malformed(bad, 0, 2)
