from hvdlike.core.coordinator import Coordinator, build_response
from hvdlike.core.messages import OpType, ReduceOp, Request
from hvdlike.core.response_cache import Lookup, ResponseCache


def _req(name, rank, shape=(4,), op=OpType.ALLREDUCE, **kw):
    return Request(name=name, op=op, dtype=kw.pop("dtype", "float32"), shape=shape, rank=rank, **kw)


def test_ready_only_when_every_rank_submitted_in_completion_order():
    c = Coordinator(3)
    c.add([_req("a", 0), _req("b", 0)])
    c.add([_req("b", 1), _req("a", 1)])
    assert c.ready() == []
    c.add([_req("b", 2)])
    assert [r.name for r in c.ready()] == ["b"]
    c.add([_req("a", 2)])
    assert [r.name for r in c.ready()] == ["a"]
    assert len(c) == 0


def test_pending_reports_missing_ranks():
    c = Coordinator(3)
    c.add([_req("a", 0), _req("a", 2)], now=10.0)
    assert c.pending(now=12.5) == [("a", 2.5, [1])]


def test_allgather_records_first_dims_and_allows_them_to_differ():
    rs = [_req("g", r, shape=(r + 1, 3), op=OpType.ALLGATHER) for r in range(3)]
    resp = build_response(rs, 3)
    assert not resp.error and resp.first_dims == (1, 2, 3)
    bad = rs[:2] + [_req("g", 2, shape=(2, 4), op=OpType.ALLGATHER)]
    assert "beyond the first dimension" in build_response(bad, 3).error


def test_alltoall_splits_are_checked_per_rank():
    rs = [_req("x", r, shape=(3,), op=OpType.ALLTOALL, splits=(1, 2)) for r in range(2)]
    assert build_response(rs, 2).splits == ((1, 2), (1, 2))
    rs[1] = _req("x", 1, shape=(3,), op=OpType.ALLTOALL, splits=(3,))
    assert "splits" in build_response(rs, 2).error


def test_mismatch_message_lists_every_rank():
    rs = [_req("w", 0), _req("w", 1, reduce_op=ReduceOp.MAX)]
    error = build_response(rs, 2).error
    assert "reduction op" in error and "rank 0: allreduce float32 4 cpu sum" in error
    assert "rank 1: allreduce float32 4 cpu max" in error


def test_group_is_released_as_one_unit():
    c = Coordinator(2)
    a = [_req(f"g.{i}", r, group="g", group_size=2) for r in range(2) for i in range(2)]
    c.add([x for x in a if x.name == "g.0"])
    assert c.ready() == []
    c.add([x for x in a if x.name == "g.1"])
    assert [r.name for r in c.ready()] == ["g.0", "g.1"]


def _g(name, rank, size=2, shape=(4,)):
    return _req(name, rank, shape=shape, group="g", group_size=size)


def test_a_group_whose_later_member_mismatches_fails_whole():
    # g.0 agrees and is parked for the rest; g.1 disagrees. g.0 used to wait forever
    # (no error, no stall report: it had left the table).
    c = Coordinator(2)
    c.add([_g("g.0", 0), _g("g.0", 1)])
    assert c.ready() == []
    c.add([_g("g.1", 0, shape=(3,)), _g("g.1", 1, shape=(4,))])
    out = {r.name: r.error for r in c.ready()}
    assert set(out) == {"g.0", "g.1"} and all(out.values())
    assert "ranks disagree on the shape of collective 'g.1'" in out["g.1"]
    assert out["g.0"].startswith("collective 'g.0' is a member of group 'g', which failed:")
    assert len(c) == 0 and c.pending() == []
    # The name is free again: the same group submitted afresh runs.
    c.add([_g("g.0", r) for r in range(2)] + [_g("g.1", r) for r in range(2)])
    assert [(r.name, r.error) for r in c.ready()] == [("g.0", ""), ("g.1", "")]


def test_a_group_whose_first_member_mismatches_leaves_nothing_behind():
    c = Coordinator(2)
    c.add([_g("g.0", 0, shape=(3,)), _g("g.0", 1)])
    assert [r.name for r in c.ready()] == ["g.0"]
    c.add([_g("g.1", 0)])  # rank 1's g.1 comes in a later cycle
    out = c.ready()
    assert [r.name for r in out] == ["g.1"] and "which failed" in out[0].error
    c.add([_g("g.1", 1)])  # still owed by rank 1: fails at once, never waits
    out = c.ready()
    assert [r.name for r in out] == ["g.1"] and "which failed" in out[0].error
    assert len(c) == 0 and c._failed == {}


def test_groups_of_different_sizes_fail_every_member_of_every_rank():
    c = Coordinator(2)
    c.add([_g("g.0", 0, size=2), _g("g.1", 0, size=2)])
    c.add([_g(f"g.{i}", 1, size=3) for i in range(3)])
    out = {r.name: r.error for r in c.ready()}
    assert set(out) == {"g.0", "g.1", "g.2"} and all(out.values())
    assert "rank 0: allreduce float32 4 cpu sum (member of group 'g' of 2)" in out["g.0"]
    assert "rank 1: allreduce float32 4 cpu sum (member of group 'g' of 3)" in out["g.0"]
    assert len(c) == 0 and c.pending() == [] and c._failed == {}


def test_a_rank_sending_more_members_than_it_declared_does_not_break_the_coordinator():
    # Not something a front end does (names in flight are unique); still no KeyError.
    c = Coordinator(2)
    c.add([_g("g.0", 0, size=2), _g("g.0", 1, size=1)])  # rank 1 owes nothing more
    c.add([_g("g.1", 0), _g("g.2", 0)])  # rank 0 owes one, sends two
    out = c.ready()
    assert [r.name for r in out] == ["g.0", "g.1", "g.2"] and all(r.error for r in out)
    assert c._failed == {}


def test_join_lets_others_proceed_and_reports_last():
    c = Coordinator(3)
    c.add([_req("join", 1, op=OpType.JOIN, dtype="uint8", shape=())])
    c.add([_req("t", 0), _req("t", 2)])
    ready = c.ready()
    assert [r.name for r in ready] == ["t"] and ready[0].joined == (1,)
    c.add([_req("join", 0, op=OpType.JOIN, dtype="uint8", shape=())])
    c.add([_req("join", 2, op=OpType.JOIN, dtype="uint8", shape=())])
    done = c.ready()
    assert done[0].op == OpType.JOIN and done[0].root == 2
    assert c.joined == set()


def test_response_cache_hits_conflicts_and_lru():
    cache = ResponseCache(2)
    a, b, c = (_req(n, 0) for n in "abc")
    resp = {r.name: build_response([r], 1) for r in (a, b, c)}
    assert cache.lookup(a) == (Lookup.MISS, -1)
    assert cache.put(resp["a"], a) == []
    assert cache.put(resp["b"], b) == []
    assert cache.lookup(a) == (Lookup.HIT, 0)
    assert cache.lookup(_req("a", 0, shape=(5,)))[0] is Lookup.CONFLICT
    cache.touch(0)  # "a" is now most recent, so "b" goes first
    assert cache.put(resp["c"], c) == [1]
    assert cache.lookup(b)[0] is Lookup.MISS and cache.lookup(c) == (Lookup.HIT, 1)
    assert cache.num_slots == 2


def test_disabled_cache_stores_nothing():
    cache = ResponseCache(0)
    a = _req("a", 0)
    assert cache.put(build_response([a], 1), a) == []
    assert cache.lookup(a)[0] is Lookup.MISS


def test_fused_buffers_of_other_member_shapes_are_a_mismatch_even_of_one_length():
    from hvdlike.core.messages import new_request

    reqs = [new_request("b", OpType.ALLREDUCE, "float32", (76,), "cpu", layout=layout)
            .with_rank(r) for r, layout in enumerate(("4,4x8,8,8x4", "8,8x4,4,4x8"))]
    resp = build_response(reqs, 2)
    assert resp.error.startswith("ranks disagree on the member shapes (the ranks' models "
                                 "differ) of collective 'b'")
    assert "rank 1: allreduce float32 76 cpu sum holding 8,8x4,4,4x8" in resp.error
    same = [r.__class__(**{**r.__dict__, "layout": "4,4x8,8,8x4"}) for r in reqs]
    assert not build_response(same, 2).error
