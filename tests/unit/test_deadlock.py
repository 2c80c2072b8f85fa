"""The deadlock rule on plain data: who can never proceed, and what the error says."""

from hvdlike.core import deadlock
from hvdlike.core.deadlock import StuckClock, find_deadlock


def world(size):
    return lambda set_id: list(range(size))


def test_diverged_ranks_wait_on_each_other():
    # rank 0 went on to a barrier; ranks 1 and 2 still wait on an allreduce
    stuck = {0: [(0, "barrier.0", False)], 1: [(0, "grad", False)], 2: [(0, "grad", False)]}
    assert find_deadlock(stuck, world(3)) == {0, 1, 2}
    text = deadlock.describe({0, 1, 2}, stuck, world(3), lambda r: "h", 31.0, 30)
    assert text.startswith("deadlock: rank(s) 0, 1, 2 have all waited 31s on collectives "
                           "that none of them can complete: their programs diverged "
                           "(HVDLIKE_DEADLOCK_TIME_SECONDS=30; 0 turns this check off)\n")
    assert "rank 0 (h) waits for 'barrier.0', not submitted by rank(s) 1, 2" in text
    assert "rank 1 (h) waits for 'grad', not submitted by rank(s) 0" in text


def test_a_rank_that_is_not_stuck_may_still_submit():
    stuck = {0: [(0, "grad", False)], 1: [(0, "grad", False)]}
    assert find_deadlock(stuck, world(3)) == set()  # rank 2 still computes its gradient
    # ... but it cannot end a wait that needs both 0 and 1 to submit what they never will
    stuck = {0: [(0, "barrier.0", False)], 1: [(0, "grad", False)]}
    assert find_deadlock(stuck, world(3)) == {0, 1}
    # a name every member has submitted is running on the data plane: not a deadlock
    assert find_deadlock({0: [(0, "big", False)], 1: [(0, "big", False)]}, world(2)) == set()


def test_a_joined_rank_stands_in_for_allreduces_but_not_for_joins():
    stuck = {0: [(0, "join", True)], 1: [(0, "grad", False)], 2: [(0, "grad", False)]}
    assert find_deadlock(stuck, world(3)) == set()  # grad completes without rank 0
    stuck[2] = [(0, "other", False)]
    assert find_deadlock(stuck, world(3)) == {0, 1, 2}


def test_only_the_ranks_waiting_on_each_other_are_deadlocked():
    # set 1 = ranks {0, 1} diverged; rank 2 waits on a set-2 name rank 3 may still send
    members = {0: [0, 1, 2, 3], 1: [0, 1], 2: [2, 3]}.__getitem__
    stuck = {0: [(1, "a", False)], 1: [(1, "b", False)], 2: [(2, "c", False)]}
    assert find_deadlock(stuck, members) == {0, 1}
    # a global name needs 0 and 1 as well: rank 2 can never proceed either
    stuck[2] = [(0, "c", False)]
    assert find_deadlock(stuck, members) == {0, 1, 2}


def test_the_stuck_clock_restarts_on_any_change():
    clock = StuckClock()
    assert clock.update(None, {(0, "a"): 1.0}, 2.0) is None  # not blocked
    assert clock.update(5.0, {(0, "a"): 1.0}, 6.0) == 5.0
    assert clock.update(5.0, {(0, "a"): 1.0}, 9.0) == 5.0
    assert clock.update(5.0, {(0, "a"): 1.0, (0, "b"): 9.5}, 10.0) == 10.0  # new submission
    assert clock.update(5.0, {(0, "b"): 9.5}, 12.0) == 12.0  # "a" completed
    assert clock.update(5.0, {(0, "b"): 13.0}, 14.0) == 13.0  # resubmitted under one name


def test_ranks_stuck_on_optimizer_buckets_are_told_their_optimizers_differ():
    # rank 1 froze a parameter: its bucket holds one member fewer, under another name
    stuck = {0: [(0, "DistributedOptimizer.bucket.0.0.weight-2.bias", False)],
             1: [(0, "DistributedOptimizer.bucket.0.0.weight-1.bias", False)]}
    assert find_deadlock(stuck, world(2)) == {0, 1}
    text = deadlock.describe({0, 1}, stuck, world(2), lambda r: "h", 31.0, 30)
    assert text.endswith("(the names are DistributedOptimizer's gradient reductions: the "
                         "ranks' optimizers differ -- a different number or order of "
                         "parameters, a parameter frozen (requires_grad=False) or added on "
                         "some ranks only, an optimizer or a backward pass that only some "
                         "ranks have)")
    plain = deadlock.describe({0, 1}, {0: [(0, "a", False)], 1: [(0, "b", False)]}, world(2),
                              lambda r: "h", 31.0, 30)
    assert "DistributedOptimizer" not in plain
