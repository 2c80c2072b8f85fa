"""Join bookkeeping in the negotiation cycle (threads, in-memory control plane)."""

from hvdlike.core.controller import Controller
from hvdlike.core.handles import Handle
from hvdlike.core.messages import OpType, Request
from hvdlike.core.tensor_queue import Entry

from tests.unit.fake_ranks import Exchange, FakeControl, run_in_threads


def _allreduce(name, rank):
    req = Request(name=name, op=OpType.ALLREDUCE, dtype="float32", shape=(4,), rank=rank)
    return Entry(req, None, None, Handle(name))


def _join(rank):
    req = Request(name="join", op=OpType.JOIN, dtype="uint8", shape=(), rank=rank)
    return Entry(req, None, None, Handle("join"))


def _script(size, plan):
    """Run ``plan[rank][cycle]`` (lists of entry makers); return per-rank, per-cycle work."""
    ex = Exchange(size)
    logs = [None] * size

    def body(rank):
        ctl = Controller(FakeControl(ex, rank), 16)
        log = []
        for makers in plan[rank]:
            result = ctl.cycle([make(rank) for make in makers])
            log.append([(resp.name, entry is not None, resp.root) for resp, entry in result.work])
        logs[rank] = log

    run_in_threads(size, body, timeout=20)
    assert all(log is not None for log in logs)
    return logs


def test_joined_rank_with_a_pending_cached_tensor_is_not_counted_twice():
    x = lambda r: _allreduce("x", r)  # noqa: E731
    plan = [
        # rank 0: negotiate x, idle two cycles, submit x again, then join
        [[x], [], [], [x], [_join]],
        # rank 1: negotiate x, submit x (cached) and join at once, then idle
        [[x], [x, _join], [], [], []],
    ]
    logs = _script(2, plan)
    for rank in range(2):
        assert logs[rank][0] == [("x", True, -1)]
        # Before rank 0 submits x again, nobody may run it: rank 1's bit and
        # its joined flag are the same rank.
        assert logs[rank][1] == [] and logs[rank][2] == []
        # Rank 1 stands in with its real tensor, not zeros.
        assert logs[rank][3] == [("x", True, -1)]
        assert logs[rank][4] == [("join", True, 0)]


def test_joined_rank_stands_in_for_cached_tensors_it_never_submitted():
    x = lambda r: _allreduce("x", r)  # noqa: E731
    plan = [
        [[x], [], [x], [_join]],
        [[x], [_join], [], []],
    ]
    logs = _script(2, plan)
    assert logs[0][2] == [("x", True, -1)]
    assert logs[1][2] == [("x", False, -1)]  # zeros stand-in on the joined rank
    assert logs[0][3] == logs[1][3] == [("join", True, 0)]


def test_three_ranks_last_to_join_is_reported():
    x = lambda r: _allreduce("x", r)  # noqa: E731
    plan = [
        [[x], [x], [_join], []],
        [[x], [_join], [], []],
        [[x], [x], [], [_join]],
    ]
    logs = _script(3, plan)
    for rank in range(3):
        names = [w for cycle in logs[rank] for w in cycle]
        assert ("x", rank != 1, -1) in names
        assert names[-1] == ("join", True, 2)
