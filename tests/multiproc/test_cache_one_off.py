"""Names made for one call stay out of the response cache, on real ranks.

Barriers, unnamed ``broadcast_object`` / ``allgather_object`` calls and the
exchanges of process-set changes each use names no later call repeats; the
training's named tensors keep their cache slots however many of those run,
the results stay right and every member's cache is the same. A small cache
(``HVDLIKE_CACHE_CAPACITY``) makes a few hundred one-off names more than it holds.
"""

from tests.multiproc.harness import run_ranks

WEIGHTS = 8
CAPACITY = {"HVDLIKE_CACHE_CAPACITY": "64"}


def _many_one_offs():
    import torch

    import hvdlike.torch as hvd
    from hvdlike.core import api

    torch.set_num_threads(1)
    hvd.init()
    r = hvd.rank()
    ctl = api.runtime().process_sets[0].controller
    weights = [torch.full((3,), float(r + i)) for i in range(WEIGHTS)]

    def step():
        handles = [hvd.allreduce_async(w, name=f"w.{i}") for i, w in enumerate(weights)]
        return [hvd.synchronize(h).tolist() for h in handles]

    for _ in range(3):
        step()
    for _ in range(300):
        hvd.barrier()
    out = {
        "objects": [hvd.broadcast_object({"i": i, "from": r}, root_rank=i % 2)
                    for i in range(50)],
        "gathered": [hvd.allgather_object((i, r)) for i in range(50)],
    }
    fast = ctl.fast_cycles
    out["step"] = step()
    # The learned order of the step outlived the one-off names before it.
    out["fast_step"] = ctl.fast_cycles - fast
    # A name the caller gives is cached, as Horovod caches named tensors.
    out["named"] = hvd.broadcast_object(f"config of {r}", root_rank=0, name="config")
    out["cache"] = sorted(ctl.cache.snapshot().items())
    out["slots"] = ctl.cache.num_slots
    hvd.shutdown()
    return out


def test_barriers_and_object_collectives_leave_the_cache_to_the_training():
    results = run_ranks(_many_one_offs, np=2, timeout=120, env=CAPACITY)
    training = [f"allreduce.w.{i}" for i in range(WEIGHTS)]
    for r, out in enumerate(results):
        assert out["objects"] == [{"i": i, "from": i % 2} for i in range(50)]
        assert out["gathered"] == [[(i, 0), (i, 1)] for i in range(50)]
        assert out["step"] == [[i + 0.5] * 3 for i in range(WEIGHTS)]
        assert out["named"] == "config of 0"
        names = [name for name, _ in out["cache"]]
        assert sorted(names) == sorted(training + ["broadcast.config.size",
                                                   "broadcast.config.data"]), names
        assert out["slots"] == len(names)
        assert out["fast_step"] >= 1
    assert results[0]["cache"] == results[1]["cache"]


def _process_set_changes():
    import torch

    import hvdlike.torch as hvd
    from hvdlike.core import api

    torch.set_num_threads(1)
    hvd.init(process_sets="dynamic")
    r = hvd.rank()
    runtime = api.runtime()
    pair = hvd.add_process_set([0, 1])
    out = {"pair": [], "objects": []}
    for i in range(5):
        temporary = hvd.add_process_set([1, 2])
        if temporary.included():
            out["objects"].append(hvd.broadcast_object((i, r), root_rank=2,
                                                       process_set=temporary))
        hvd.remove_process_set(temporary)
        if pair.included():
            out["pair"].append(hvd.allreduce(torch.tensor([float(r + i)]), name="pair",
                                             op=hvd.Sum, process_set=pair).item())
            out["objects"].append(hvd.broadcast_object((i, r), root_rank=1, process_set=pair))
        out["sum"] = hvd.allreduce(torch.tensor([float(r)]), name="all", op=hvd.Sum).item()
        hvd.barrier()
    out["cache"] = sorted(runtime.process_sets[0].controller.cache.snapshot())
    if pair.included():
        out["pair_cache"] = sorted(
            runtime.process_sets[pair.process_set_id].controller.cache.snapshot())
    hvd.shutdown()
    return out


def test_process_set_changes_leave_no_names_in_the_caches():
    results = run_ranks(_process_set_changes, np=3, timeout=120, env=CAPACITY)
    for r, out in enumerate(results):
        assert out["sum"] == 3.0
        assert out["cache"] == ["allreduce.all"], out["cache"]
        if r in (0, 1):
            assert out["pair"] == [1.0 + 2 * i for i in range(5)]
            assert out["pair_cache"] == ["allreduce.pair"], out["pair_cache"]
        expected = []
        for i in range(5):
            if r in (1, 2):
                expected.append([i, 2])
            if r in (0, 1):
                expected.append([i, 1])
        assert [list(o) for o in out["objects"]] == expected
    assert results[0]["cache"] == results[1]["cache"] == results[2]["cache"]
    assert results[0]["pair_cache"] == results[1]["pair_cache"]
