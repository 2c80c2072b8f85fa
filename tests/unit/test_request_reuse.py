"""Allreduce requests reused per name, and the response cache matching them by identity."""

import pytest
import torch

from hvdlike.core import collectives as core
from hvdlike.core.messages import OpType, ReduceOp, Request, Response
from hvdlike.core.response_cache import Lookup, ResponseCache


@pytest.fixture(autouse=True)
def _fresh_memo():
    core._ALLREDUCE_REQUESTS.clear()
    yield
    core._ALLREDUCE_REQUESTS.clear()


def _request(tensor, name="g", **kw):
    return core.allreduce_entry(tensor, name, **kw).request


def test_same_name_shape_and_options_give_the_same_request():
    a = _request(torch.ones(3, 2), op=ReduceOp.SUM)
    b = _request(torch.zeros(3, 2), op=ReduceOp.SUM)  # another tensor, same terms
    assert a is b
    assert (a.name, a.dtype, a.shape, a.device, a.reduce_op) == \
        ("g", "float32", (3, 2), "cpu", ReduceOp.SUM)


@pytest.mark.parametrize("change", [
    dict(tensor=torch.ones(3, 3)),
    dict(tensor=torch.ones(6)),
    dict(tensor=torch.ones(3, 2, dtype=torch.float64)),
    dict(op=ReduceOp.MAX),
    dict(prescale_factor=0.5),
    dict(postscale_factor=2.0),
    dict(group="grp", group_size=2),
    dict(name="other"),
])
def test_any_change_gives_a_new_request_that_says_so(change):
    base = dict(tensor=torch.ones(3, 2), name="g", op=ReduceOp.SUM, prescale_factor=1.0,
                postscale_factor=1.0)
    first = _request(**base)
    kw = {**base, **change}
    second = _request(**kw)
    assert second is not first
    assert second.shape == tuple(kw["tensor"].shape)
    assert second.dtype == str(kw["tensor"].dtype).replace("torch.", "")
    assert (second.reduce_op, second.prescale, second.postscale, second.group, second.name) == (
        kw["op"], kw["prescale_factor"], kw["postscale_factor"], kw.get("group", ""), kw["name"])
    # and back again: the memo follows the last submission, never a stale one
    assert _request(**base).shape == (3, 2)


def test_bad_input_under_a_known_name_is_still_refused():
    _request(torch.ones(4), op=ReduceOp.SUM)
    with pytest.raises(TypeError, match="sparse"):
        core.allreduce_entry(torch.ones(4).to_sparse(), "g", ReduceOp.SUM)
    with pytest.raises(TypeError, match="torch.Tensor"):
        core.allreduce_entry([1.0, 2.0, 3.0, 4.0], "g", ReduceOp.SUM)
    with pytest.raises(TypeError, match="complex64"):
        core.allreduce_entry(torch.ones(4, dtype=torch.complex64), "g", ReduceOp.SUM)
    with pytest.raises(ValueError, match="unknown reduction op"):
        core.allreduce_entry(torch.ones(4), "g", 17)
    core.allreduce_entry(torch.ones(4), "a", ReduceOp.ADASUM)
    with pytest.raises(TypeError, match="Adasum"):
        core.allreduce_entry(torch.ones(4, dtype=torch.int32), "a", ReduceOp.ADASUM)


def test_in_place_and_out_of_place_share_the_request_not_the_output():
    t = torch.ones(4)
    inplace = core.allreduce_entry(t, "g", ReduceOp.SUM, inplace=True)
    copy = core.allreduce_entry(t, "g", ReduceOp.SUM, inplace=False)
    assert inplace.request is copy.request
    assert inplace.output is t and copy.output is not t
    strided = torch.ones(4, 2).t()  # not contiguous: a private output, copied back
    entry = core.allreduce_entry(strided, "s", ReduceOp.SUM, inplace=True)
    assert entry.output is not strided and entry.finish is not None


def test_the_memo_is_bounded(monkeypatch):
    monkeypatch.setattr(core, "_ALLREDUCE_REQUESTS_MAX", 8)
    for i in range(50):
        _request(torch.ones(2), name=f"auto.{i}")
    assert len(core._ALLREDUCE_REQUESTS) <= 8


def _response(name, shape=(2,)):
    return Response(name=name, op=OpType.ALLREDUCE, dtype="float32", shape=shape)


def test_cache_matches_its_own_request_by_identity_and_others_by_signature():
    cache = ResponseCache(4)
    own = Request(name="x", op=OpType.ALLREDUCE, dtype="float32", shape=(2,))
    slot = None
    cache.put(_response("x"), own)
    slot = cache.snapshot()["x"]
    assert cache.lookup(own) == (Lookup.HIT, slot)
    equal = Request(name="x", op=OpType.ALLREDUCE, dtype="float32", shape=(2,))
    other = Request(name="x", op=OpType.ALLREDUCE, dtype="float32", shape=(3,))
    assert cache.lookup(equal) == (Lookup.HIT, slot)
    assert cache.lookup(other) == (Lookup.CONFLICT, slot)
    assert cache.lookup_many([own, equal, other]) == [
        (Lookup.HIT, slot), (Lookup.HIT, slot), (Lookup.CONFLICT, slot)]
    assert cache.lookup_many([Request(name="y", op=OpType.ALLREDUCE, dtype="float32",
                                      shape=(2,))]) == [(Lookup.MISS, -1)]


def _reusing_run(size, batches, cycles, capacity=16):
    """Like a training loop: each rank reuses one request object per name."""
    from hvdlike.core.controller import Controller
    from hvdlike.core.handles import Handle
    from hvdlike.core.tensor_queue import Entry
    from tests.unit.fake_ranks import Exchange, FakeControl, run_in_threads

    ex = Exchange(size)
    seen = [None] * size
    placed_fast = [0] * size

    def body(rank):
        ctl = Controller(FakeControl(ex, rank), capacity)
        own = {}
        original = ctl.cache.own_slots

        def counting(entries):
            slots = original(entries)
            if slots:
                placed_fast[rank] += len(slots)
            return slots

        ctl.cache.own_slots = counting
        order = []
        for c in range(cycles):
            entries = []
            for name, n in batches(rank, c):
                req = own.get((name, n))
                if req is None:
                    req = own[(name, n)] = Request(name=name, op=OpType.ALLREDUCE,
                                                   dtype="float32", shape=(n,))
                entries.append(Entry(req, None, None, Handle(name)))
            result = ctl.cycle(entries)
            order.extend((resp.name, resp.shape) for resp, _ in result.work)
        seen[rank] = order

    run_in_threads(size, body, timeout=20)
    return seen, placed_fast


def test_reused_requests_are_placed_by_identity_and_run_like_fresh_ones():
    names = [f"t{i}" for i in range(12)]

    def batches(rank, cycle):
        if cycle == 3:  # t5 changes shape on rank 0 only: a conflict, reported on both
            return [(n, 5 if (n == "t5" and rank == 0) else 4) for n in names]
        # ranks submit in different orders; the agreed order is the same everywhere
        return [(n, 4) for n in (names if rank == 0 else names[::-1])]

    seen, placed_fast = _reusing_run(2, batches, cycles=6)
    assert seen[0] == seen[1]
    done = [name for name, _ in seen[0]]
    assert sorted(done[:12]) == sorted(names)
    # steady cycles placed every entry through the identity path
    assert placed_fast[0] >= 12 * 3 and placed_fast[1] >= 12 * 3
    # each name ran once per cycle; t5's conflicting cycle still completed every name
    assert all(done.count(n) >= 5 for n in names)


def test_own_slots_refuses_anything_but_identity_hits():
    from hvdlike.core.handles import Handle
    from hvdlike.core.tensor_queue import Entry

    cache = ResponseCache(8)
    a = Request(name="a", op=OpType.ALLREDUCE, dtype="float32", shape=(2,))
    g = Request(name="g", op=OpType.ALLREDUCE, dtype="float32", shape=(2,), group="grp",
                group_size=1)
    cache.put(_response("a"), a)
    cache.put(Response(name="g", op=OpType.ALLREDUCE, dtype="float32", shape=(2,),
                       group="grp"), g)

    def entries(*reqs):
        return [Entry(r, None, None, Handle(r.name)) for r in reqs]

    slot_a = cache.snapshot()["a"]
    assert cache.own_slots(entries(a)) == [slot_a]
    assert cache.own_slots(entries()) == []
    equal = Request(name="a", op=OpType.ALLREDUCE, dtype="float32", shape=(2,))
    assert cache.own_slots(entries(a, equal)) is None  # equal, but not the same object
    slot_g = cache.snapshot()["g"]
    assert cache.own_slots(entries(g, a)) == [slot_g, slot_a]  # a group, wholly cached
    assert cache.own_slots(entries(Request(name="new", op=OpType.ALLREDUCE, dtype="float32",
                                           shape=(2,)))) is None


def test_reused_group_requests_with_an_evicted_member_are_negotiated_whole():
    """The identity path never splits a group: after an eviction the group goes the careful way."""
    from hvdlike.core.controller import Controller
    from hvdlike.core.handles import Handle
    from hvdlike.core.tensor_queue import Entry
    from tests.unit.fake_ranks import Exchange, FastControl, run_in_threads

    group = [(f"g.{i}", "g", 3) for i in range(3)]
    schedule = [group, [("x", "", 0)], [("y", "", 0)], group, [], group, group]
    ex = Exchange(2)
    out = [None, None]

    def body(rank):
        ctl = Controller(FastControl(ex, rank), 4)
        own = {}
        seen = []
        for specs in schedule:
            entries = []
            for name, grp, k in specs:
                req = own.get(name)
                if req is None:
                    req = own[name] = Request(name=name, op=OpType.ALLREDUCE, dtype="float32",
                                              shape=(2,), group=grp, group_size=k)
                entries.append(Entry(req, None, None, Handle(name)))
            result = ctl.cycle(entries)
            seen.append(sorted(r.name for r, _ in result.work))
        out[rank] = seen

    run_in_threads(2, body)
    names = ["g.0", "g.1", "g.2"]
    assert out[0] == out[1]
    # g.0 was evicted by y (capacity 4); the group still runs whole, every time.
    assert out[0][0] == out[0][3] == out[0][5] == out[0][6] == names


@pytest.mark.parametrize("factors", [{"prescale_factor": 0.0}, {"postscale_factor": 2.0}])
def test_scale_factors_on_a_bool_reduction_are_refused_not_ignored(factors):
    flags = torch.tensor([True, False])
    for build in (core.allreduce_entry, core.reducescatter_entry):
        with pytest.raises(ValueError) as caught:
            build(flags, name=f"flags.{build.__name__}", op=ReduceOp.SUM, **factors)
        (label, value), = factors.items()
        assert f"{label} {value:g} cannot scale a bool tensor" in str(caught.value)
        build(flags, name=f"plain.{build.__name__}", op=ReduceOp.SUM)  # no factor: fine
    # numbers still scale
    core.allreduce_entry(torch.ones(2), name="numbers", op=ReduceOp.SUM, **factors)
