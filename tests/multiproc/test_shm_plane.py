"""The shared-memory CPU data plane on real ranks of one host, against local oracles.

Small chunks (4 KiB) make every collective span many chunks, so odd sizes
cross chunk and portion boundaries; the oracle is a single-process
computation over every rank's input, and fusion on/off must agree exactly.
"""

import os
import signal
import time

import pytest
import torch

from tests.multiproc.harness import run_ranks
from tests.shm_names import created_by

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
          "uint8", "bool"]
OPS = ["Sum", "Average", "Min", "Max", "Product"]
SIZES = [0, 1, 7, 1027, 5000]  # elements; 5000 x 8 bytes spans 7-10 chunks
# 5000 elements of 8 bytes read the others' tensors directly (where the host allows it).
ACROSS_MIN_BYTES = 32 * 1024
# ... a block of 8 KiB at a time: a portion spans several blocks, the last one short.
ACROSS_BLOCK_BYTES = 8 * 1024
TAIL_DTYPES = ["float16", "float32", "int64"]
TAIL_EXTRAS = [1, 5, 17]


def _value(rank, dtype, n, salt=0):
    gen = torch.Generator().manual_seed(1000 * rank + 17 * n + salt)
    if dtype == "bool":
        return torch.rand(n, generator=gen) > 0.5
    base = torch.randint(1, 4, (n,), generator=gen, dtype=torch.int64)
    return base.to(getattr(torch, dtype))


def _oracle(values, op, dtype):
    if dtype == "bool":
        stack = torch.stack(values)
        if op in ("Sum", "Average", "Max"):
            return stack.any(0)
        return stack.all(0)
    stack = torch.stack([v.to(torch.float64) for v in values])
    out = {"Sum": lambda: stack.sum(0), "Average": lambda: stack.sum(0) / len(values),
           "Min": lambda: stack.min(0).values, "Max": lambda: stack.max(0).values,
           "Product": lambda: stack.prod(0)}[op]()
    if dtype.startswith("int") or dtype == "uint8":
        out = torch.trunc(out)
    return out


def _plane_kind(hvd):
    from hvdlike.core import api

    state = api.runtime().process_sets[0]
    plane = state.groups.cpu_plane
    data = type(plane).__name__ if plane is not None else "gloo"
    return f"{data}+{type(state.controller.control).__name__}"


def _every_collective(chunk_bytes):
    import hvdlike.torch as hvd
    from hvdlike.core import shm_plane

    shm_plane.CHUNK_BYTES = chunk_bytes
    shm_plane.ACROSS_MIN_BYTES = ACROSS_MIN_BYTES
    shm_plane.ACROSS_BLOCK_BYTES = ACROSS_BLOCK_BYTES
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {"plane": _plane_kind(hvd)}
    for dtype in DTYPES:
        for size in SIZES:
            for op in OPS:
                t = _value(r, dtype, size)
                out[("ar", dtype, size, op)] = hvd.allreduce(
                    t, op=getattr(hvd, op), name=f"ar.{dtype}.{size}.{op}")
            if dtype in ("float32", "int32"):
                t = _value(r, dtype, size)
                out[("scaled", dtype, size)] = hvd.allreduce(
                    t, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0,
                    name=f"sc.{dtype}.{size}")
            rows = size % 5 + r  # uneven first dimensions
            out[("ag", dtype, size)] = hvd.allgather(
                _value(r, dtype, rows * 3, 1).reshape(rows, 3), name=f"ag.{dtype}.{size}")
            for root in range(n):
                out[("bc", dtype, size, root)] = hvd.broadcast(
                    _value(r, dtype, size, 2), root_rank=root, name=f"bc.{dtype}.{size}.{root}")
            splits = [(size + r + d) % 4 for d in range(n)]  # uneven, with zeros
            got, counts = hvd.alltoall(_value(r, dtype, sum(splits) * 2, 3).reshape(-1, 2),
                                       splits=splits, name=f"a2a.{dtype}.{size}")
            out[("a2a", dtype, size)] = (got, counts.tolist())
    # Several pipelined chunks, the last a few elements (some members own none of it).
    from hvdlike.core import api

    plane = api.runtime().process_sets[0].groups.cpu_plane
    for dtype in TAIL_DTYPES:
        per_chunk = n * plane._share_bytes // getattr(torch, dtype).itemsize
        for extra in TAIL_EXTRAS:
            out[("tail", dtype, extra)] = hvd.allreduce(
                _value(r, dtype, 3 * per_chunk + extra), op=hvd.Sum, name=f"tail.{dtype}.{extra}")
    # The reduce variant of the hierarchical plane, to the last member: only it reads
    # results (chunked, then across).
    out["across"] = plane.reads_across
    for key, count in (("root", 3 * n * plane._share_bytes // 4 + 5), ("root_across", 10001)):
        t = _value(r, "float32", count, 5)
        plane._allreduce(t, shm_plane._reducer(None), root=n - 1)
        out[key] = t
    big = _value(r, "float32", 3 * n + 2000)
    out["rs"] = hvd.reducescatter(big.reshape(-1, 1), op=hvd.Sum, name="rs")
    hvd.barrier()
    hvd.shutdown()
    return out


def _check_allreduces(results, n, dtype, size, tol):
    """Every op's allreduce of ``size`` ``dtype`` elements: the oracle's value, alike on all ranks."""
    for op in OPS:
        want = _oracle([_value(r, dtype, size) for r in range(n)], op, dtype)
        for r, res in enumerate(results):
            got = res[("ar", dtype, size, op)]
            assert got.dtype == getattr(torch, dtype) and got.shape == (size,)
            assert torch.allclose(got.to(torch.float64), want.to(torch.float64),
                                  rtol=tol, atol=tol), (dtype, size, op, r, got, want)
            assert torch.equal(got, results[0][("ar", dtype, size, op)])


def _check_every_collective(results, n):
    assert all(res["plane"] == "ShmDataGroup+ShmControlPlane" for res in results), [r["plane"] for r in results]
    for dtype in DTYPES:
        tol = {"float16": 5e-2, "bfloat16": 5e-2, "float32": 1e-6}.get(dtype, 1e-12)
        for size in SIZES:
            _check_allreduces(results, n, dtype, size, tol)
            if dtype in ("float32", "int32"):
                inputs = [_value(r, dtype, size).to(torch.float64) for r in range(n)]
                if dtype == "int32":
                    inputs = [torch.trunc(v * 0.5) for v in inputs]
                else:
                    inputs = [v * 0.5 for v in inputs]
                want = torch.stack(inputs).sum(0) * 3.0
                if dtype == "int32":
                    want = torch.trunc(want)
                for res in results:
                    assert torch.allclose(res[("scaled", dtype, size)].to(torch.float64), want)
            rows = [size % 5 + r for r in range(n)]
            want = torch.cat([_value(r, dtype, rows[r] * 3, 1).reshape(rows[r], 3)
                              for r in range(n)])
            for res in results:
                assert torch.equal(res[("ag", dtype, size)], want), (dtype, size)
            for root in range(n):
                want = _value(root, dtype, size, 2)
                for res in results:
                    assert torch.equal(res[("bc", dtype, size, root)], want), (dtype, size, root)
            splits = [[(size + r + d) % 4 for d in range(n)] for r in range(n)]
            sources = [_value(r, dtype, sum(splits[r]) * 2, 3).reshape(-1, 2) for r in range(n)]
            for me, res in enumerate(results):
                parts, counts = [], []
                for r in range(n):
                    start = sum(splits[r][:me])
                    parts.append(sources[r][start:start + splits[r][me]])
                    counts.append(splits[r][me])
                got, got_counts = res[("a2a", dtype, size)]
                assert got_counts == counts and torch.equal(got, torch.cat(parts)), (dtype, size)
    for dtype in TAIL_DTYPES:
        for extra in TAIL_EXTRAS:
            got = [res[("tail", dtype, extra)] for res in results]
            want = torch.stack([_value(r, dtype, got[0].numel()).to(torch.float64)
                                for r in range(n)]).sum(0)
            assert got[0].numel() > 3 * extra, (dtype, extra)
            for g in got:
                assert torch.equal(g, got[0]) and torch.equal(g.to(torch.float64), want), (dtype, extra)
    assert len({res["across"] for res in results}) == 1  # every member takes the same path
    for key in ("root", "root_across"):
        sent = [_value(r, "float32", results[0][key].numel(), 5) for r in range(n)]
        assert torch.equal(results[n - 1][key], torch.stack(sent).sum(0)), key
        if key == "root":  # chunked: a member that does not read results keeps its input
            for r in range(n - 1):
                assert torch.equal(results[r][key], sent[r])
    total = torch.stack([_value(r, "float32", 3 * n + 2000) for r in range(n)]).sum(0)
    base, extra = divmod(total.numel(), n)
    start = 0
    for r, res in enumerate(results):
        count = base + (1 if r < extra else 0)
        assert torch.equal(res["rs"].reshape(-1), total[start:start + count]), r
        start += count


@pytest.mark.parametrize("np", [2, 3])
def test_every_collective_and_dtype_matches_the_oracle(np):
    results = run_ranks(_every_collective, np=np, args=(4096,), timeout=240)
    _check_every_collective(results, np)


def _fused_training(chunk_bytes, deny_reads_on=None):
    import hvdlike.torch as hvd
    from hvdlike.core import api, bootstrap, shm_plane, shm_segment

    shm_plane.CHUNK_BYTES = chunk_bytes
    # The fused 19.8 KB buffer is read across; the 20 KB tensor is never fused.
    shm_plane.ACROSS_MIN_BYTES = 16 * 1024
    shm_plane.ALONE_BYTES = 20000
    if int(os.environ[bootstrap.ENV_RANK]) == deny_reads_on:  # as a host that forbids the reads would
        def denied(*args):
            raise PermissionError(1, "Operation not permitted")

        shm_segment.read_peer = denied
    hvd.init()
    torch.manual_seed(hvd.rank())
    grads = [torch.randn(n) for n in SIZES_FUSED]
    out = {"plane": _plane_kind(hvd)}
    state = api.runtime().process_sets[0]
    plane = state.groups.cpu_plane
    out["across"] = getattr(plane, "reads_across", None)
    for step in range(3):
        # One grouped call: every tensor is negotiated in the same cycle.
        out[step] = hvd.grouped_allreduce([g * (step + 1) for g in grads], name="g")
    out["staged"] = max((b.numel() for free in state.executor.pool._free.values()
                         for b in free), default=0)
    hvd.shutdown()
    return out


SIZES_FUSED = (1, 33, 1000, 5000, 3900, 17)  # elements


def test_fusion_on_and_off_give_identical_results():
    fused = run_ranks(_fused_training, np=2, args=(4096,), timeout=120)
    # Unfused, and with rank 1 unable to read rank 0's memory: every allreduce is chunked.
    unfused = run_ranks(_fused_training, np=2, args=(4096, 1), timeout=120,
                        env={"HVDLIKE_FUSION_THRESHOLD": "0"})
    gloo = run_ranks(_fused_training, np=2, args=(4096,), timeout=120,
                     env={"HVDLIKE_SHM": "0"})
    assert fused[0]["plane"] == "ShmDataGroup+ShmControlPlane"
    assert gloo[0]["plane"] == "gloo+GlooControlPlane"
    assert [res["across"] for res in unfused] == [False, False]
    assert fused[0]["across"] == fused[1]["across"]
    # the 5000-element tensor was never staged; the others were, fused
    assert [res["staged"] for res in fused] == [1 + 33 + 1000 + 3900 + 17] * 2
    for step in range(3):
        per_rank = []
        for r in range(2):
            torch.manual_seed(r)
            per_rank.append([torch.randn(n) * (step + 1) for n in SIZES_FUSED])
        want = [(a + b) / 2 for a, b in zip(*per_rank)]
        for runs in (fused, unfused):
            for res in runs:
                for got, expect, other in zip(res[step], want, fused[0][step]):
                    assert torch.equal(got, other)
                    assert torch.allclose(got, expect, atol=1e-6)
        for got, other in zip(gloo[0][step], fused[0][step]):
            assert torch.allclose(got, other, atol=1e-6)


def _process_sets():
    import hvdlike.torch as hvd

    evens = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[evens])
    r = hvd.rank()
    out = {}
    if r in (0, 2):
        from hvdlike.core import api

        plane = api.runtime().process_sets[evens.process_set_id].groups.cpu_plane
        out["plane"] = type(plane).__name__
        out["sum"] = hvd.allreduce(torch.full((1001,), float(r + 1)), op=hvd.Sum, name="ev",
                                   process_set=evens)
        out["bc"] = hvd.broadcast(torch.full((5,), float(r)), root_rank=2, name="evb",
                                  process_set=evens)
    out["all"] = hvd.allreduce(torch.full((3,), float(r)), op=hvd.Sum, name="all")
    hvd.shutdown()
    return out


def test_process_set_subset_uses_its_own_segment():
    results = run_ranks(_process_sets, np=3, timeout=120)
    for r in (0, 2):
        assert results[r]["plane"] == "ShmDataGroup"
        assert torch.equal(results[r]["sum"], torch.full((1001,), 4.0))
        assert torch.equal(results[r]["bc"], torch.full((5,), 2.0))
    for res in results:
        assert torch.equal(res["all"], torch.full((3,), 3.0))


def _reinit_and_count_maps():
    import hvdlike.torch as hvd

    for i in range(3):
        hvd.init()
        assert hvd.allreduce(torch.ones(3), op=hvd.Sum, name=f"x{i}").tolist() == [2.0] * 3
        hvd.shutdown()
    import gc

    gc.collect()
    with open(f"/proc/{os.getpid()}/maps") as f:
        return sum(1 for line in f if "/dev/shm/hvdlike-" in line), os.getpid()


def test_clean_shutdown_and_reinit_leave_nothing():
    results = run_ranks(_reinit_and_count_maps, np=2, timeout=120)
    assert [maps for maps, _ in results] == [0, 0]  # every segment of the 3 runtimes is unmapped
    assert created_by(pid for _, pid in results) == set()


def _killed_inside_shm_collective():
    import hvdlike.torch as hvd
    from hvdlike.core import shm_plane
    from hvdlike.core.errors import HorovodInternalError

    hvd.init()
    print("PID", os.getpid(), flush=True)
    hvd.allreduce(torch.ones(10), name="warm")
    if hvd.rank() == 1:
        def die(self, what):
            os.kill(os.getpid(), signal.SIGKILL)  # negotiated, inside the data collective

        shm_plane.ShmDataGroup._sync = die
    started = time.monotonic()
    try:
        hvd.allreduce(torch.ones(10), name="fatal")
        return "no error"
    except HorovodInternalError as exc:
        print("ELAPSED", time.monotonic() - started)
        print("MESSAGE", str(exc).replace("\n", " "))
        return "raised"


def test_rank_killed_inside_a_shm_collective_is_named_and_nothing_is_left():
    codes, outputs = run_ranks(_killed_inside_shm_collective, np=2, expect_failure=True,
                               timeout=60, env={"HVDLIKE_GLOO_TIMEOUT_SECONDS": "20"})
    assert codes[1] == -signal.SIGKILL, outputs
    assert codes[0] == 0, outputs[0]
    out = outputs[0]
    assert float(out.split("ELAPSED")[1].split()[0]) < 20, out
    message = out.split("MESSAGE")[1].split("\n")[0]
    assert "rank 1" in message, message
    pids = [int(o.split("PID")[1].split()[0]) for o in outputs.values() if "PID" in o]
    assert pids and created_by(pids) == set()


def _bare_plane(behaviour):
    """Two processes on one segment, without a runtime: rank 1 misbehaves."""
    from hvdlike.core import bootstrap, shm_plane
    from hvdlike.core.errors import HvdlikeInternalError
    from hvdlike.core.job_store import JobStore

    topo, rdzv = bootstrap.detect()
    jobs = JobStore(topo, rdzv, 30)
    store = jobs.connect()
    settings = shm_plane.Settings(tag="test", host="h", timeout_seconds=2.0,
                                  start_timeout_seconds=30)
    plane = shm_plane.ShmDataGroup(settings, store, topo.rank, 2, [0, 1], gloo=lambda: None)
    if topo.rank == 1:
        if behaviour == "exit":
            os._exit(3)
        time.sleep(6)  # alive but never arrives
        return "slept"
    started = time.monotonic()
    try:
        plane.allreduce([torch.ones(4)]).wait()
        print("RESULT no error")
    except HvdlikeInternalError as exc:
        print(f"RESULT {time.monotonic() - started:.3f} {exc}")
    finally:
        plane.shutdown()


@pytest.mark.parametrize("behaviour", ["exit", "late"])
def test_missing_member_fails_the_wait_naming_it(behaviour):
    codes, outputs = run_ranks(_bare_plane, np=2, args=(behaviour,), expect_failure=True,
                               timeout=60)
    assert codes[0] == 0, outputs[0]
    line = outputs[0].split("RESULT ")[1].split("\n")[0]
    if behaviour == "exit":
        assert "rank 1 (pid" in line and "exited during a shared-memory allreduce" in line, line
        assert float(line.split()[0]) < 2.0, line  # found by the liveness check, not the timeout
    else:
        assert "rank 1 did not reach a shared-memory allreduce within 2s" in line, line


def _stacked_on_one_cpu(attempts, ops):
    import hvdlike.torch as hvd
    from hvdlike.core import api, shm_segment

    # Whatever else the test host runs meanwhile, it counts as having an idle
    # CPU (that check has its unit tests): this is about the move itself.
    shm_segment.runnable_tasks = lambda path="/proc/loadavg": 1
    hvd.init()
    state = api.runtime().process_sets[0]
    segments = [state.groups.cpu_plane.segment, state.controller.control.segment]
    mask = os.sched_getaffinity(0)
    low = min(mask)
    x = torch.full((1024,), float(hvd.rank() + 1))
    sums = []
    for attempt in range(attempts):
        # This thread (the one running synchronous collectives) onto the lowest
        # CPU on both ranks, a few collectives there, then the mask back as it
        # was: the kernel leaves the two where they are, sharing one core.
        os.sched_setaffinity(0, {low})
        for i in range(5):
            sums.append(hvd.allreduce(x, op=hvd.Sum, name=f"pinned.{attempt}.{i}")[0].item())
        os.sched_setaffinity(0, mask)
        for i in range(ops):
            sums.append(hvd.allreduce(x, op=hvd.Sum, name=f"free.{attempt}.{i}")[0].item())
        moved = hvd.allreduce(torch.tensor([float(sum(s.moves for s in segments))]),
                              op=hvd.Sum, name=f"moved.{attempt}").item()
        if moved:
            break
    out = {"moves": sum(s.moves for s in segments),
           "sums": sums, "mask_after": sorted(os.sched_getaffinity(0)), "mask": sorted(mask),
           "spin": [s.spin for s in segments]}
    hvd.shutdown()
    return out


def test_ranks_woken_onto_one_core_move_apart():
    """Both ranks' collective threads left on one CPU: a waiter that finds the
    late member on its own CPU moves itself; results stay exact, masks intact."""
    from hvdlike.core import shm_segment

    cpus = os.sched_getaffinity(0)
    quota = shm_segment.cpu_quota()
    if len(cpus) < 2 or (quota is not None and quota < 2):
        pytest.skip(f"needs two usable CPUs (mask {sorted(cpus)}, cgroup quota {quota})")
    if shm_segment._GETCPU is None:
        pytest.skip("sched_getcpu is not available on this platform")
    results = run_ranks(_stacked_on_one_cpu, np=2, args=(5, 50), timeout=120)
    for r in results:
        assert r["spin"][0] > 0 and r["spin"][1] > 0, r["spin"]  # every member has a core
        assert r["mask_after"] == r["mask"]
        assert set(r["sums"]) == {3.0}
    assert sum(r["moves"] for r in results) >= 1, results
