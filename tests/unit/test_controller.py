"""The negotiation cycle on threads with an in-memory control plane (no processes)."""

import random

import pytest

from hvdlike.core.controller import Controller
from hvdlike.core.handles import Handle
from hvdlike.core.messages import OpType, Request
from hvdlike.core.tensor_queue import Entry
from tests.unit.fake_ranks import Exchange, FakeControl, run_in_threads


def _entry(name, rank, n=4):
    req = Request(name=name, op=OpType.ALLREDUCE, dtype="float32", shape=(n,), rank=rank)
    return Entry(req, None, None, Handle(name))


def _run(size, per_rank_batches, capacity=16, cycles=6):
    ex = Exchange(size)
    orders = [None] * size

    def body(rank):
        ctl = Controller(FakeControl(ex, rank), capacity)
        seen = []
        for c in range(cycles):
            batch = per_rank_batches(rank, c)
            result = ctl.cycle([_entry(n, rank) for n in batch])
            seen.extend(resp.name for resp, _ in result.work)
        orders[rank] = seen

    run_in_threads(size, body, timeout=20)
    return orders, ex


def test_every_rank_gets_the_same_order_despite_different_submission_orders():
    names = [f"n{i}" for i in range(30)]

    def batches(rank, cycle):
        if cycle == 0:
            own = names[:]
            random.Random(rank).shuffle(own)
            return own[: 10 + 5 * rank]
        if cycle == 1:
            own = names[:]
            random.Random(rank).shuffle(own)
            return own[10 + 5 * rank:]
        return []

    orders, _ = _run(3, batches)
    assert sorted(orders[0]) == sorted(names)
    assert orders[0] == orders[1] == orders[2]


def test_steady_state_uses_only_the_bit_vector():
    def batches(rank, cycle):
        return ["a", "b", "c"] if cycle % 2 == 0 else []

    orders, ex = _run(2, batches, cycles=8)
    assert orders[0] == orders[1] == ["a", "b", "c"] * 4
    assert ex.calls["sum"] == 8
    assert ex.calls["gather"] == 1  # only the first time the names are seen


def test_lru_eviction_renegotiates_waiting_entry():
    # capacity 2 with 3 names: entries waiting on an evicted slot must be
    # renegotiated, never lost and never matched against the wrong name.
    def batches(rank, cycle):
        if cycle in (0, 2, 4):
            return ["x", "y", "z"] if rank == 0 else ["z", "y", "x"]
        return []

    orders, _ = _run(2, batches, capacity=2, cycles=8)
    assert orders[0] == orders[1]
    assert sorted(orders[0]) == sorted(["x", "y", "z"] * 3)


def test_the_thread_runner_fails_when_a_rank_thread_raises():
    def body(rank):
        if rank == 1:
            raise ValueError("rank one broke")

    with pytest.raises(AssertionError, match="rank thread 1 raised ValueError"):
        run_in_threads(2, body)
