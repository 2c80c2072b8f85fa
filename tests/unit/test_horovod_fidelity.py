"""Single-process checks of what a Horovod script can observe before any collective runs."""

import pytest

from hvdlike.core import bootstrap, collectives, timeline
from hvdlike.core import config
from hvdlike.core.coordinator import Coordinator, build_response
from hvdlike.core.errors import UnsupportedOpError
from hvdlike.core.messages import OpType, ReduceOp, Request
from hvdlike.launcher import env as rank_env
from hvdlike.launcher.hosts import HostSlots, assign_ranks


def req(rank, name, op, shape, **kw):
    return Request(name=name, op=op, dtype="float32", shape=shape, rank=rank, **kw)


def test_timeline_dynamic_means_no_file_until_start_timeline():
    assert timeline.configured_path("DYNAMIC") == ""
    assert timeline.configured_path("/tmp/t.json") == "/tmp/t.json"
    for name in ("HOROVOD_TIMELINE", "HVDLIKE_TIMELINE"):
        assert config.load({name: "DYNAMIC"}).timeline == ""


def test_every_rank_gets_horovodrun_variables_matching_its_placement():
    placements = assign_ranks([HostSlots("a", 2), HostSlots("b", 1)], 3)
    for placement in placements:
        env = rank_env.rank_environment({}, placement, "10.0.0.1", 1234, "s3cret")
        topo, _ = bootstrap.from_hvdlike_run(env)
        assert env["HOROVOD_RANK"] == str(topo.rank)
        assert env["HOROVOD_SIZE"] == "3"
        assert env["HOROVOD_LOCAL_RANK"] == str(topo.local_rank)
        assert env["HOROVOD_LOCAL_SIZE"] == str(topo.local_size)
        assert env["HOROVOD_CROSS_RANK"] == str(topo.cross_rank)
        assert env["HOROVOD_CROSS_SIZE"] == str(topo.cross_size)
        assert env["HOROVOD_HOSTNAME"] == placement.host
    # b's only rank: local 0 of 1, second host
    assert placements[2].host == "b"


def test_a_nested_launcher_does_not_leak_the_outer_ranks_horovod_variables():
    outer = {"HOROVOD_RANK": "5", "HOROVOD_SIZE": "8", "HOROVOD_HOSTNAME": "x", "PATH": "/bin"}
    for remote in (False, True):
        base = rank_env.base_environment(outer, remote=remote)
        assert base == {"PATH": "/bin"}


def test_reducescatter_adasum_is_a_runtime_error_as_in_horovod():
    with pytest.raises(RuntimeError, match="Adasum") as info:
        collectives.check_op(ReduceOp.ADASUM, "reducescatter", (ReduceOp.SUM, ReduceOp.AVERAGE))
    assert isinstance(info.value, (UnsupportedOpError, ValueError))


@pytest.mark.parametrize("op", [OpType.ALLGATHER, OpType.BROADCAST, OpType.ALLTOALL,
                                OpType.REDUCESCATTER])
def test_collectives_without_a_neutral_value_fail_while_a_rank_has_joined(op):
    extra = {"splits": (2, 2)} if op == OpType.ALLTOALL else {}
    resp = build_response([req(0, "t", op, shape=(4,), **extra)], 2, joined=[1])
    assert resp.error and "join" in resp.error and "'t'" in resp.error
    assert not build_response([req(0, "t", op, shape=(4,), **extra),
                               req(1, "t", op, shape=(4,), **extra)], 2).error


def test_allreduce_still_runs_while_a_rank_has_joined():
    resp = build_response([req(0, "t", OpType.ALLREDUCE, shape=(4,))], 2, joined=[1])
    assert not resp.error and resp.joined == (1,)


def test_a_refused_collective_fails_at_once_without_waiting_for_other_ranks():
    # Ranks whose auto-named allgathers got different numbers must not wait on each other.
    c = Coordinator(3)
    c.add([req(1, "join", OpType.JOIN, shape=())])
    c.add([req(0, "allgather.noname.1", OpType.ALLGATHER, shape=(2,))])
    c.add([req(2, "allgather.noname.2", OpType.ALLGATHER, shape=(2,))])
    out = c.ready()
    assert sorted(r.name for r in out) == ["allgather.noname.1", "allgather.noname.2"]
    assert all("join" in r.error for r in out)
    assert len(c) == 1  # only the join is left, waiting for ranks 0 and 2


def test_an_average_is_a_correctly_rounded_division():
    # With 3 ranks and one joined, an Average is (2 * t) / 3: multiplying by the
    # float32 nearest to 1/3 is one unit in the last place off for 142 and 130.
    import torch
    from hvdlike.core.wire import scale
    summed = torch.tensor([150.0, 142.0, -188.0, 130.0, 32.0])
    averaged = summed.clone()
    scale(averaged, 1.0, 3)
    assert torch.equal(averaged, summed / 3)
    half = summed.half()
    scale(half, 1.0, 3)
    assert torch.equal(half, (summed / 3).half())
    ints = torch.tensor([7, -7, 6], dtype=torch.int32)  # truncate toward zero
    scale(ints, 1.0, 3)
    assert ints.tolist() == [2, -2, 2]
    post = torch.tensor([3.0])
    scale(post, 0.5, 3)  # a postscale factor multiplies by factor / size, as Horovod does
    assert post.item() == 3.0 * (0.5 / 3)


def test_an_average_over_a_power_of_two_matches_the_division_bit_for_bit():
    # Power-of-two sizes multiply by the exact reciprocal instead of dividing:
    # the same correctly rounded value for every dtype, subnormals, signed
    # zeros, infinities and NaNs included; other sizes still divide.
    import torch
    from hvdlike.core.wire import scale
    gen = torch.Generator().manual_seed(7)
    base = torch.cat([torch.randn(4096, generator=gen, dtype=torch.float64) * 1e4,
                      torch.tensor([0.0, -0.0, 1.0, 3.0, float("inf"), float("-inf"),
                                    float("nan"), 5e-324, 2.2250738585072014e-308,
                                    1.4e-45, 1.2e-38, 6e-8, 6.1e-5, 65504.0])])
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        values = base.to(dtype)
        for size in (2, 4, 8, 64, 1 << 14, 3, 6):
            got = values.clone()
            scale(got, 1.0, size)
            want = values / size
            same = (got == want) | (got.isnan() & want.isnan())
            assert bool(same.all()), (dtype, size)
            # Signed zeros and the sign of NaN-free results match too.
            assert torch.equal(torch.signbit(got[~got.isnan()]), torch.signbit(want[~want.isnan()]))


def test_a_given_name_is_negotiated_with_its_kind_first_once():
    from hvdlike.frontend.submit import name_for

    allreduce, allgather = name_for("metric", "allreduce"), name_for("metric", "allgather")
    assert (allreduce, allgather) == ("allreduce.metric", "allgather.metric")
    # a name already formed (a jax.jit trace's, used when the staged call runs) stays
    assert name_for(allreduce, "allreduce") == "allreduce.metric"
    assert name_for(allreduce, "allgather") == "allreduce.metric"
    # a plain str that looks formed is still a caller's name, as under Horovod
    assert name_for("allreduce.metric", "allreduce") == "allreduce.allreduce.metric"
    # a composite call leaves the kind to its parts
    assert name_for("tree", "broadcast_pytree", kind=False) == "tree"
    with pytest.raises(TypeError, match="allgather: name must be a str, got int"):
        name_for(3, "allgather")
