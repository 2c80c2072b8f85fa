"""``Controller.cycle_one``: the cycle of one synchronous collective, next in the learned order.

Ranks are threads over an in-memory control plane. A rank using ``cycle_one``
must agree, cycle for cycle, with peers using the plain ``cycle``; and where
``cycle_one`` does not apply it must do nothing at all (no collective call),
so the caller can fall back to the queue.
"""

from hvdlike.core.controller import Controller
from hvdlike.core.handles import Handle
from hvdlike.core.messages import OpType, Request
from hvdlike.core.tensor_queue import Entry
from tests.unit.fake_ranks import Exchange, FastControl, run_in_threads


class VoteControl(FastControl):
    """Also the shared-memory plane's vote (without data: nothing is offered here)."""

    vote_capacity = 0

    def vote(self, value, offer=None):
        return min(self.ex.all(self.rank, value, "min")), None


def _entry(name, rank, group="", group_size=0):
    req = Request(name=name, op=OpType.ALLREDUCE, dtype="float32", shape=(4,), rank=rank,
                  group=group, group_size=group_size)
    return Entry(req, None, None, Handle(name))


def _calls(ex):
    return dict(ex.calls)


def test_a_rank_using_cycle_one_agrees_with_peers_using_cycle():
    ex = Exchange(2)
    out = [[], []]
    ran_one = [0, 0]

    def body(rank):
        ctl = Controller(VoteControl(ex, rank), 16)
        for step in range(12):
            entry = _entry("loss", rank)
            result = ctl.cycle_one(entry) if rank == 0 else None
            if result is None:
                result = ctl.cycle([entry])
            else:
                ran_one[rank] += 1
            while not result.work:  # a peer not ready yet: cycle on, as wait() does
                result = ctl.cycle([])
            out[rank].append([(r.name, e is entry) for r, e in result.work])

    run_in_threads(2, body)
    assert out[0] == out[1] == [[("loss", True)]] * 12
    # The name is negotiated once, then learned; from then on rank 0 runs it directly.
    assert ran_one[0] >= 12 - 3


def test_a_peer_with_new_names_turns_the_cycle_into_the_full_negotiation():
    ex = Exchange(2)
    out = [[], []]

    def body(rank):
        ctl = Controller(VoteControl(ex, rank), 16)
        for step in range(8):
            entries = [_entry("loss", rank)]
            if rank == 1 and step == 6:
                entries.insert(0, _entry("fresh", rank))  # uncached: this rank votes -1
            if rank == 0 and step >= 4:
                result = ctl.cycle_one(entries[0])
                assert result is not None, step
                if step == 6:
                    assert not result.fast  # the vote failed; the bit vector ran
            else:
                result = ctl.cycle(entries)
            seen = [r.name for r, _ in result.work]
            while "loss" not in seen:
                result = ctl.cycle([])
                seen += [r.name for r, _ in result.work]
            if rank == 0 and step == 6:
                # "fresh" is only rank 1's: negotiated, not complete, nothing of it runs.
                assert "fresh" not in seen
            out[rank].append(sorted(n for n in seen if n == "loss"))

    run_in_threads(2, body)
    assert out[0] == out[1] == [["loss"]] * 8


def test_cycle_one_does_nothing_where_it_does_not_apply():
    ex = Exchange(1)
    ctl = Controller(VoteControl(ex, 0), 16)
    # Nothing learned yet.
    before = _calls(ex)
    assert ctl.cycle_one(_entry("a", 0)) is None
    assert _calls(ex) == before and ctl.idle
    for _ in range(3):
        ctl.cycle([_entry("a", 0)])
        ctl.cycle([_entry("b", 0)])
    assert ctl.sequence.order is not None
    before = _calls(ex)
    # Not the one the order expects next ("a" comes before "b").
    assert ctl.cycle_one(_entry("b", 0)) is None
    # A member of a group, a different request under a cached name, a join.
    assert ctl.cycle_one(_entry("a", 0, group="g", group_size=2)) is None
    changed = Entry(Request(name="a", op=OpType.ALLREDUCE, dtype="float64", shape=(4,)),
                    None, None, Handle("a"))
    assert ctl.cycle_one(changed) is None
    join = Entry(Request(name="a", op=OpType.JOIN, dtype="uint8", shape=()), None, None,
                 Handle("a"))
    assert ctl.cycle_one(join) is None
    assert _calls(ex) == before and ctl.idle
    # Something already pending on this rank: the queue's cycle must take both.
    pending = _entry("x", 0)
    ctl._uncached["x"] = pending
    assert ctl.cycle_one(_entry("a", 0)) is None
    assert _calls(ex) == before
    del ctl._uncached["x"]
    # And where it applies, it runs.
    result = ctl.cycle_one(_entry("a", 0))
    assert result is not None and [r.name for r, _ in result.work] == ["a"]


def test_without_the_vote_a_control_plane_never_takes_cycle_one():
    ex = Exchange(1)
    ctl = Controller(FastControl(ex, 0), 16)
    for _ in range(3):
        ctl.cycle([_entry("a", 0)])
    assert ctl.sequence.order is not None
    assert ctl.cycle_one(_entry("a", 0)) is None
