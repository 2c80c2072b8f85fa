"""Response-cache pressure in the controller: evictions and grouped collectives (threads)."""

from hvdlike.core.controller import Controller
from hvdlike.core.handles import Handle
from hvdlike.core.messages import OpType, Request
from hvdlike.core.tensor_queue import Entry
from tests.unit.fake_ranks import Exchange, FastControl, run_in_threads


def _entry(name, rank, group="", group_size=0):
    req = Request(name=name, op=OpType.ALLREDUCE, dtype="float32", shape=(2,), rank=rank,
                  group=group, group_size=group_size)
    return Entry(req, None, None, Handle(name))


def _drive(size, schedule, capacity):
    """schedule: per-cycle list of (name, group, group_size) for every rank alike."""
    ex = Exchange(size)
    out = [None] * size
    ctls = [None] * size

    def body(rank):
        ctl = Controller(FastControl(ex, rank), capacity)
        seen = []
        for specs in schedule:
            result = ctl.cycle([_entry(n, rank, g, k) for n, g, k in specs])
            seen.append(sorted(r.name for r, _ in result.work))
        out[rank], ctls[rank] = seen, ctl

    run_in_threads(size, body)
    assert all(o is not None for o in out), "a rank failed"
    return out, ctls, ex


def _plain(*names):
    return [(n, "", 0) for n in names]


def test_capacity_eviction_keeps_the_names_just_negotiated():
    schedule = [_plain("a", "b", "c", "d"), _plain("e", "f"), _plain("e", "f")]
    out, ctls, ex = _drive(2, schedule, capacity=4)
    assert out[0] == out[1] == [["a", "b", "c", "d"], ["e", "f"], ["e", "f"]]
    # e and f evicted a and b, not each other: the third cycle runs from the cache.
    assert ex.calls["gather"] == 2
    assert set(ctls[0].cache.snapshot()) == {"c", "d", "e", "f"}


def test_group_with_an_evicted_member_is_negotiated_whole_and_completes():
    group = [(f"g.{i}", "g", 3) for i in range(3)]
    schedule = [group, _plain("x"), _plain("y"), group, [], group]
    out, _, _ = _drive(2, schedule, capacity=4)
    assert out[0] == out[1]
    names = ["g.0", "g.1", "g.2"]
    # g.0 was evicted (least recently used) by y; the group still runs whole.
    assert out[0][3] == names and out[0][5] == names
