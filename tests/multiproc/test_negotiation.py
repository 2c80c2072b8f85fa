"""Negotiation: ordering, the response cache, fusion, and mismatch errors across real ranks."""

import pytest
import torch

from tests.multiproc.harness import run_ranks


def _random_order(count, seed_base):
    import random

    import hvdlike.torch as hvd

    hvd.init()
    r = hvd.rank()
    names = [f"t{i}" for i in range(count)]
    order = list(range(count))
    random.Random(seed_base + r).shuffle(order)  # a different order on every rank
    handles = {}
    for i in order:
        handles[i] = hvd.allreduce_async(torch.full((i % 7 + 1,), float(i + r)), name=names[i],
                                         op=hvd.Sum)
    # complete them out of submission order, too
    results = {i: hvd.synchronize(handles[i]) for i in reversed(order)}
    hvd.shutdown()
    return {i: t.tolist() for i, t in results.items()}


@pytest.mark.parametrize("np", [2, 4])
def test_300_tensors_in_different_random_orders(np):
    res = run_ranks(_random_order, np=np, args=(300, 7))
    for i in range(300):
        want = [float(sum(i + r for r in range(np)))] * (i % 7 + 1)
        for out in res:
            assert out[i] == want


def _steps(steps, tensors):
    import hvdlike.torch as hvd
    from hvdlike.core import api

    hvd.init()
    r = hvd.rank()
    gen = torch.Generator().manual_seed(1234 + r)
    history = []
    controller = api.runtime().process_sets[0].controller
    for step in range(steps):
        handles = [hvd.allreduce_async(torch.randn(17 + k, generator=gen), name=f"grad{k}")
                   for k in range(tensors)]
        history.append([hvd.synchronize(h) for h in handles])
        if step == 0:
            first_step_slow = controller.slow_cycles
    stats = {"slow_cycles": controller.slow_cycles, "cycles": controller.cycles,
             "cached": len(controller.cache), "first_step_slow": first_step_slow}
    hvd.shutdown()
    return history, stats


def test_fusion_on_and_off_identical_and_cache_steady_state():
    fused = run_ranks(_steps, np=2, args=(6, 40))
    unfused = run_ranks(_steps, np=2, args=(6, 40), env={"HVDLIKE_FUSION_THRESHOLD": "0"})
    nocache = run_ranks(_steps, np=2, args=(6, 40), env={"HVDLIKE_CACHE_CAPACITY": "0",
                                                         "HVDLIKE_CYCLE_TIME": "0"})
    for a, b, c in zip(fused, unfused, nocache):
        for step_a, step_b, step_c in zip(a[0], b[0], c[0]):
            for x, y, z in zip(step_a, step_b, step_c):
                assert torch.equal(x, y) and torch.equal(x, z)
    # ranks agree bit for bit
    for step_0, step_1 in zip(fused[0][0], fused[1][0]):
        for x, y in zip(step_0, step_1):
            assert torch.equal(x, y)
    stats = fused[0][1]
    assert stats["cached"] == 40
    # The request gather runs only while names are new: the first step needs
    # some slow cycles (how many depends on how the ranks' submissions
    # interleave), the five cached steps after it none.
    assert 1 <= stats["first_step_slow"] == stats["slow_cycles"], stats
    assert nocache[0][1]["slow_cycles"] >= 6, nocache[0][1]


def _tiny_cache():
    import hvdlike.torch as hvd

    hvd.init()
    out = []
    for step in range(4):
        hs = [hvd.allreduce_async(torch.ones(3) * (k + step), name=f"c{k}", op=hvd.Sum)
              for k in range(10)]
        out.append([hvd.synchronize(h).tolist() for h in hs])
    # a cached name submitted with a new shape renegotiates instead of hanging
    out.append(hvd.allreduce(torch.ones(5), name="c0", op=hvd.Sum).tolist())
    hvd.shutdown()
    return out


def test_cache_eviction_and_shape_change():
    res = run_ranks(_tiny_cache, np=2, env={"HVDLIKE_CACHE_CAPACITY": "3"})
    for out in res:
        for step in range(4):
            assert out[step] == [[2.0 * (k + step)] * 3 for k in range(10)]
        assert out[4] == [2.0] * 5


def _mismatch(kind):
    import hvdlike.torch as hvd
    from hvdlike.core.errors import MismatchError

    hvd.init()
    r = hvd.rank()
    try:
        if kind == "shape":
            hvd.allreduce(torch.ones(3 + r), name="x")
        elif kind == "dtype":
            hvd.allreduce(torch.ones(3, dtype=torch.float32 if r else torch.float64), name="x")
        elif kind == "op":
            hvd.allreduce(torch.ones(3), name="x", op=hvd.Sum if r else hvd.Max)
        elif kind == "root":
            hvd.broadcast(torch.ones(3), root_rank=r, name="x")
        message = None
    except MismatchError as exc:
        message = str(exc)
    # the runtime stays usable, and the cache did not keep the bad name
    after = hvd.allreduce(torch.ones(2), name="after", op=hvd.Sum).tolist()
    again = hvd.allreduce(torch.ones(3), name="x", op=hvd.Sum).tolist()
    hvd.shutdown()
    return message, after, again


@pytest.mark.parametrize("kind,words", [
    ("shape", ["shape", "rank 0", "rank 1", "float32 3", "float32 4"]),
    ("dtype", ["dtype", "float64", "float32"]),
    ("op", ["reduction op", "sum", "max"]),
    ("root", ["root rank", "root=0", "root=1"]),
])
def test_mismatch_raises_on_every_rank(kind, words):
    res = run_ranks(_mismatch, np=2, args=(kind,), timeout=60)
    for message, after, again in res:
        assert message is not None, f"{kind}: no error raised"
        # the collective's name as negotiated: its kind, then the caller's name
        assert ("'broadcast.x'" if kind == "root" else "'allreduce.x'") in message, message
        for word in words:
            assert word in message, (word, message)
        assert after == [2.0, 2.0]
        assert again == [2.0, 2.0, 2.0]


def _cached_then_mismatch():
    import hvdlike.torch as hvd
    from hvdlike.core.errors import MismatchError

    hvd.init()
    r = hvd.rank()
    for _ in range(3):
        hvd.allreduce(torch.ones(4), name="g", op=hvd.Sum)
    try:
        hvd.allreduce(torch.ones(4 + r), name="g", op=hvd.Sum)  # only rank 1 changes
        message = None
    except MismatchError as exc:
        message = str(exc)
    hvd.shutdown()
    return message


def _one_name_two_kinds():
    import hvdlike.torch as hvd

    hvd.init()
    r = hvd.rank()
    out = []
    for _ in range(3):  # the second and third rounds meet the response cache
        # Submitted in opposite orders on the two ranks, all in flight together.
        calls = [lambda: hvd.allreduce_async(torch.full((2,), float(r + 1)), name="m",
                                             op=hvd.Sum),
                 lambda: hvd.allgather_async(torch.full((1,), float(r)), name="m"),
                 lambda: hvd.broadcast_async(torch.full((1,), float(r + 5)), 1, name="m")]
        handles = [call() for call in (calls if r == 0 else calls[::-1])]
        results = [hvd.synchronize(h).tolist() for h in handles]
        out.append(results if r == 0 else results[::-1])
    hvd.shutdown()
    return out


def test_one_name_serves_collectives_of_different_kinds_in_flight_together():
    # Horovod names a collective by its kind and the caller's name
    # (allreduce.m, allgather.m): one name may serve each kind at once.
    for out in run_ranks(_one_name_two_kinds, np=2, timeout=60):
        assert out == [[[3.0, 3.0], [0.0, 1.0], [6.0]]] * 3, out


def test_mismatch_after_caching():
    for message in run_ranks(_cached_then_mismatch, np=2):
        assert message and "shape" in message


def _misuse():
    import hvdlike.torch as hvd
    from hvdlike.core.errors import DuplicateNameError, NotInitializedError

    errors = {}
    try:
        hvd.allreduce(torch.ones(1))
    except NotInitializedError as exc:
        errors["before_init"] = str(exc)
    hvd.init()
    r = hvd.rank()
    for key, call in {
        "not_tensor": lambda: hvd.allreduce([1, 2, 3]),
        "bad_root": lambda: hvd.broadcast(torch.ones(1), root_rank=5),
        "bad_splits": lambda: hvd.alltoall(torch.ones(4), splits=[1, 2]),
        "bad_op": lambda: hvd.reducescatter(torch.ones(4), op=hvd.Max),
        "bad_dtype": lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64)),
    }.items():
        try:
            call()
        except (TypeError, ValueError) as exc:
            errors[key] = str(exc)
    # Each rank's own name stays in flight until the other rank submits it too,
    # which it does only after the barrier: the second submission meets it in flight.
    ones = torch.ones(1), torch.ones(1), torch.ones(1)
    first = hvd.allreduce_async(ones[0], name=f"dup.{r}")
    try:
        hvd.allreduce_async(ones[1], name=f"dup.{r}")
    except DuplicateNameError as exc:
        errors["duplicate"] = str(exc)
    hvd.barrier()
    other = hvd.allreduce_async(ones[2], name=f"dup.{1 - r}")
    hvd.synchronize(first)
    hvd.synchronize(other)
    hvd.shutdown()
    try:
        hvd.allreduce(torch.ones(1))
    except NotInitializedError as exc:
        errors["after_shutdown"] = str(exc)
    hvd.init()  # re-init after shutdown works
    errors["reinit_sum"] = hvd.allreduce(torch.ones(1) * (r + 1), op=hvd.Sum).item()
    hvd.shutdown()
    return errors


def test_misuse_gives_clear_errors():
    for errors in run_ranks(_misuse, np=2):
        assert "init()" in errors["before_init"]
        assert "torch.Tensor" in errors["not_tensor"] and "list" in errors["not_tensor"]
        assert "root_rank 5" in errors["bad_root"]
        assert "splits" in errors["bad_splits"]
        assert "Max" in errors["bad_op"]
        assert "complex64" in errors["bad_dtype"]
        assert "'allreduce.dup." in errors["duplicate"] and "in flight" in errors["duplicate"]
        assert "init()" in errors["after_shutdown"]
        assert errors["reinit_sum"] == 3.0


def _bad_config():
    import hvdlike
    from hvdlike.core.errors import ConfigError

    try:
        hvdlike.init()
    except ConfigError as exc:
        return str(exc)
    return None


def test_bad_knob_fails_at_init_naming_variable():
    res = run_ranks(_bad_config, np=2, env={"HOROVOD_FUSION_THRESHOLD": "lots"})
    for message in res:
        assert "HOROVOD_FUSION_THRESHOLD" in message and "'lots'" in message
        assert "byte count" in message
