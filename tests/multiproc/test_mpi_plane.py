"""MPI as control plane and CPU data plane: ranks started by a real mpirun."""

import shutil

import pytest

pytest.importorskip("mpi4py", reason="needs mpi4py (pip install 'hvdlike[mpi]')")
if shutil.which("mpirun") is None:
    pytest.skip("needs mpirun (pip install mpich)", allow_module_level=True)

from .harness import run_mpirun  # noqa: E402


def _engines():
    from hvdlike.core import api

    runtime = api.runtime()
    control = type(runtime.process_sets[0].controller.control).__name__
    cpu = type(runtime.process_sets[0].groups.data("cpu")).__name__
    return runtime.engines, control, cpu


def _collectives():
    import torch

    import hvdlike.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {"engines": _engines()}
    checks = {}
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8,
                  torch.int8, torch.int16, torch.float16, torch.bfloat16):
        x = torch.full((5,), r + 1, dtype=dtype)
        checks[f"sum {dtype}"] = hvd.allreduce(x, op=hvd.Sum).tolist() == [3] * 5
        checks[f"min {dtype}"] = hvd.allreduce(x, op=hvd.Min).tolist() == [1] * 5
        checks[f"max {dtype}"] = hvd.allreduce(x, op=hvd.Max).tolist() == [2] * 5
        checks[f"prod {dtype}"] = hvd.allreduce(x, op=hvd.Product).tolist() == [2] * 5
    checks["bool"] = hvd.allreduce(torch.tensor([r == 0, False]), op=hvd.Sum).tolist() == [
        True, False]
    checks["average"] = hvd.allreduce(torch.tensor([float(r)])).item() == 0.5
    checks["scaled"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, prescale_factor=2.0,
                                     postscale_factor=0.5).item() == 2.0
    # Many async tensors: fused into one MPI allreduce per cycle.
    handles = [hvd.allreduce_async(torch.full((3, 7), float(i * n + r)), name=f"fused.{i}",
                                   op=hvd.Sum) for i in range(60)]
    checks["fused"] = all(torch.equal(hvd.synchronize(h), torch.full((3, 7), float(2 * i * n + 1)))
                          for i, h in enumerate(handles))
    grouped = hvd.grouped_allreduce([torch.ones(2) * r, torch.ones(3, dtype=torch.float64)],
                                    op=hvd.Sum)
    checks["grouped"] = grouped[0].tolist() == [1.0, 1.0] and grouped[1].tolist() == [2.0] * 3
    # Tensors of MpiDataGroup.alone_bytes (here 400 bytes) and up are reduced unstaged
    # while their small neighbours in the same cycle share a fusion buffer.
    from hvdlike.core import api

    state = api.runtime().process_sets[0]
    plane_type = type(state.groups.cpu_plane)
    default_alone_bytes = plane_type.alone_bytes
    plane_type.alone_bytes = 400
    pool, staged = state.executor.pool, []
    take = pool.take
    pool.take = lambda numel, *args: staged.append(numel) or take(numel, *args)
    sizes = [3, 100, 5, 250, 99]
    mixed = hvd.grouped_allreduce([torch.arange(float(k)) * (r + 1) for k in sizes],
                                  op=hvd.Average, name="mixed")
    checks["mixed sizes"] = all(torch.equal(t, torch.arange(float(k)) * 1.5)
                                for t, k in zip(mixed, sizes))
    checks["large unstaged"] = staged == [3 + 5 + 99]
    inplace = torch.full((4,), float(r))
    hvd.allreduce_(inplace, op=hvd.Sum)
    checks["in place"] = inplace.tolist() == [1.0] * 4
    checks["broadcast"] = hvd.broadcast(torch.tensor([r * 10, 7]), root_rank=1).tolist() == [10, 7]
    checks["broadcast fp16"] = hvd.broadcast(torch.full((2,), float(r), dtype=torch.float16),
                                             root_rank=1).tolist() == [1.0, 1.0]
    checks["allgather"] = hvd.allgather(torch.tensor([[r]] * (r + 1))).flatten().tolist() == [
        0, 1, 1]
    split = hvd.alltoall(torch.tensor([r, r + 10]))
    checks["alltoall"] = split.tolist() == [0 + (10 if r else 0), 1 + (10 if r else 0)]
    checks["reducescatter"] = hvd.reducescatter(torch.ones(4), op=hvd.Sum).tolist() == [2.0, 2.0]
    checks["build queries"] = hvd.mpi_enabled() and hvd.mpi_threads_supported()
    checks["object"] = hvd.allgather_object({"rank": r}) == [{"rank": 0}, {"rank": 1}]
    hvd.barrier()
    hvd.shutdown()
    plane_type.alone_bytes = default_alone_bytes
    out["failed"] = sorted(k for k, ok in checks.items() if not ok)
    return out


def _training():
    import torch

    import hvdlike.torch as hvd

    hvd.init()
    r = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(),
                                *[torch.nn.Linear(32, 32) for _ in range(4)],
                                torch.nn.Linear(32, 1))
    oracle = [p.detach().clone() for p in model.parameters()]
    data = torch.randn(16, 6)
    target = torch.randn(16, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters())
    for _ in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(data[r * 8:(r + 1) * 8]),
                                            target[r * 8:(r + 1) * 8])
        loss.backward()
        opt.step()
    # The same five steps on one process with the whole batch.
    single = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(),
                                 *[torch.nn.Linear(32, 32) for _ in range(4)],
                                 torch.nn.Linear(32, 1))
    with torch.no_grad():
        for p, v in zip(single.parameters(), oracle):
            p.copy_(v)
    ref = torch.optim.SGD(single.parameters(), lr=0.05, momentum=0.9)
    for _ in range(5):
        ref.zero_grad()
        torch.nn.functional.mse_loss(single(data), target).backward()
        ref.step()
    gap = max((a - b).abs().max().item() for a, b in zip(model.parameters(), single.parameters()))
    engines = _engines()[0]
    hvd.barrier()
    hvd.shutdown()
    return engines, gap


def _mixed(cases):
    import os

    import torch

    import hvdlike.torch as hvd

    out = []
    for env in cases:  # one mpirun job, one init/shutdown per choice of knobs
        os.environ.update(env)
        hvd.init()
        engines, control, cpu = _engines()
        total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()
        handles = [hvd.allreduce_async(torch.ones(3) * i, name=f"m{i}", op=hvd.Sum)
                   for i in range(20)]
        fused = all(hvd.synchronize(h).tolist() == [2.0 * i] * 3 for i, h in enumerate(handles))
        hvd.barrier()
        hvd.shutdown()
        for key in env:
            del os.environ[key]
        out.append((engines, control, cpu, total, fused))
    return out


# A plane left to "gloo" runs on shared memory when the set's ranks share a host
# (HVDLIKE_SHM, on by default), on Gloo's sockets otherwise.
KNOB_CASES = [
    ({"HVDLIKE_CPU_OPERATIONS": "gloo"}, (("mpi", "gloo"), "MpiControlPlane", "ShmDataGroup")),
    ({"HOROVOD_CONTROLLER": "gloo"}, (("gloo", "mpi"), "ShmControlPlane", "MpiDataGroup")),
    ({"HVDLIKE_CONTROLLER": "gloo", "HVDLIKE_CPU_OPERATIONS": "gloo"},
     (("gloo", "gloo"), "ShmControlPlane", "ShmDataGroup")),
    ({"HVDLIKE_CONTROLLER": "gloo", "HVDLIKE_CPU_OPERATIONS": "gloo", "HVDLIKE_SHM": "0"},
     (("gloo", "gloo"), "GlooControlPlane", "ProcessGroupGloo")),
]


def _process_sets():
    import torch

    import hvdlike.torch as hvd

    evens = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[evens])
    r = hvd.rank()
    result = None
    if r in (0, 2):
        result = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum,
                               process_set=evens).item()
        result = (result, hvd.broadcast(torch.tensor([r]), root_rank=2,
                                        process_set=evens).item())
    everyone = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
    hvd.barrier()
    hvd.shutdown()
    return result, everyone


def _one_rank_raises():
    import torch

    import hvdlike.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(2), name="before")
    if hvd.rank() == 1:
        raise RuntimeError("rank one gives up")
    hvd.allreduce(torch.ones(2), name="after")  # never matched by rank 1
    hvd.shutdown()


def test_a_failing_rank_ends_the_mpirun_job_without_a_hang():
    code, output = run_mpirun(_one_rank_raises, np=2, timeout=90, expect_failure=True)
    assert code is not None, "mpirun did not finish: a rank hung\n" + output[-3000:]
    assert code != 0
    assert "rank one gives up" in output


def _plain_mpirun(tmp_path, lines, timeout, extra_env=()):
    """Run ``lines`` as a plain script under ``mpirun -np 2``; its exit code and output.

    Fails the test when mpirun does not finish in ``timeout`` seconds (a hang).
    """
    import os
    import subprocess
    import sys

    from .harness import ROOT, _kill_all

    script = tmp_path / "job.py"
    script.write_text("".join(line + "\n" for line in lines))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVDLIKE_")}
    env.update({"PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", ""),
                "OMP_NUM_THREADS": "1", "HVDLIKE_GLOO_TIMEOUT_SECONDS": "300", **dict(extra_env)})
    proc = subprocess.Popen([shutil.which("mpirun"), "-np", "2", sys.executable, str(script)],
                            cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_all([proc])
        pytest.fail("mpirun did not finish: the job hung")
    finally:
        _kill_all([proc])
    return proc.returncode, output


def test_an_uncaught_exception_in_a_plain_script_ends_the_mpirun_job(tmp_path):
    # The harness's worker catches a rank's exception and exits; a plain script
    # does not: its rank used to block in MPI_Finalize at exit, waiting for a
    # peer that waited in a collective for it -- the job hung forever.
    code, output = _plain_mpirun(tmp_path, [
        "import torch",
        "torch.set_num_threads(1)",
        "import hvdlike.torch as hvd",
        "hvd.init()",
        "hvd.allreduce(torch.ones(2), name='before')",
        "if hvd.rank() == 1:",
        "    raise RuntimeError('rank one gives up')",
        "hvd.allreduce(torch.ones(2), name='after')",
        "hvd.shutdown()"], timeout=90)
    assert code != 0, output
    assert "RuntimeError: rank one gives up" in output, output[-3000:]


def test_a_rank_whose_init_fails_ends_the_mpirun_job(tmp_path):
    # Rank 1's init() raises (a bad knob on its host) while rank 0's init()
    # completes and its first collective waits for rank 1: rank 1 used to block
    # in MPI_Finalize at exit, and the job hung until killed.
    code, output = _plain_mpirun(tmp_path, [
        "import os",
        "import torch",
        "torch.set_num_threads(1)",
        "import hvdlike.torch as hvd",
        "if os.environ.get('PMI_RANK') == '1':",
        "    os.environ['HVDLIKE_FUSION_THRESHOLD'] = 'lots'",
        "hvd.init()",
        "hvd.allreduce(torch.ones(2), name='first')",
        "hvd.shutdown()"], timeout=60, extra_env={"HVDLIKE_STALL_CHECK_TIME_SECONDS": "300"})
    assert code != 0, output
    assert "HVDLIKE_FUSION_THRESHOLD" in output and "lots" in output, output[-3000:]


def _timeline(path):
    import json

    import torch

    import hvdlike.torch as hvd

    hvd.init()
    rank = hvd.rank()
    hvd.allreduce(torch.ones(8), name="traced.cpu", op=hvd.Sum)
    hvd.allreduce(torch.ones(8, dtype=torch.float16), name="traced.half", op=hvd.Sum)
    hvd.barrier()
    hvd.shutdown()
    if rank != 0:
        return None
    with open(path) as f:
        events = json.load(f)
    rows = {e["pid"]: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"}
    return sorted({(rows.get(e["pid"]), e["name"]) for e in events
                   if e.get("ph") == "X" and e["name"].endswith("_ALLREDUCE")})


def _timeline_traced(path):
    """``_timeline`` with ``HVDLIKE_TIMELINE=path`` set for its init() only."""
    import os

    os.environ["HVDLIKE_TIMELINE"] = path
    try:
        return _timeline(path)
    finally:
        del os.environ["HVDLIKE_TIMELINE"]


def _two_rank_jobs(path, cases):
    """Each two-rank scenario in turn, each with its own init()/shutdown(), in one mpirun job."""
    return {"collectives": _collectives(), "training": _training(),
            "timeline": _timeline_traced(path), "knobs": _mixed(cases)}


def test_collectives_training_timeline_and_engine_knobs_on_mpi(tmp_path):
    # Four scenarios, one mpirun job: each runs its own init()/shutdown() cycle in
    # the same ranks, so the job also shows that nothing one leaves behind breaks the next.
    path = str(tmp_path / "trace.json")
    cases = [env for env, _ in KNOB_CASES]
    results = run_mpirun(_two_rank_jobs, np=2, args=(path, cases), timeout=510)

    # Collectives run on MPI when started by mpirun.
    for rank, result in enumerate(r["collectives"] for r in results):
        assert result["engines"] == (("mpi", "mpi"), "MpiControlPlane", "MpiDataGroup"), rank
        assert result["failed"] == [], (rank, result["failed"])

    # Training on MPI matches one process on the whole batch.
    for engines, gap in (r["training"] for r in results):
        assert engines == ("mpi", "mpi")
        assert gap < 1e-5

    # The timeline names the engine that moved each tensor: float32 rides MPI;
    # float16, which MPI cannot reduce, stays on Gloo.
    traced = results[0]["timeline"]
    assert ("allreduce.traced.cpu", "MPI_ALLREDUCE") in traced
    assert ("allreduce.traced.half", "GLOO_ALLREDUCE") in traced

    # Engine knobs choose each plane.
    for rank_results in (r["knobs"] for r in results):
        assert len(rank_results) == len(KNOB_CASES)
        for (env, expected), (engines, control, cpu, total, fused) in zip(KNOB_CASES,
                                                                          rank_results):
            assert (engines, control, cpu) == expected, env
            assert total == 3.0 and fused, env


def _dynamic_sets_and_reinit():
    import torch

    import hvdlike.torch as hvd

    out = []
    for round_ in range(3):  # init/shutdown cycles each build and free their communicators
        hvd.init(process_sets="dynamic")
        r = hvd.rank()
        pair = hvd.add_process_set([0, 2])
        value = None
        if r in (0, 2):
            value = hvd.allreduce(torch.tensor([float(r + round_)]), op=hvd.Sum,
                                  process_set=pair).item()
        hvd.remove_process_set(pair)
        total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name=f"all.{round_}").item()
        hvd.barrier()
        hvd.shutdown()
        out.append((value, total))
    return out


def _three_rank_jobs():
    """Static process sets, then dynamic ones over repeated init(), in one mpirun job."""
    return _process_sets(), _dynamic_sets_and_reinit()


def test_static_and_dynamic_process_sets_and_repeated_init_on_mpi():
    both = run_mpirun(_three_rank_jobs, np=3, timeout=330)
    # Static process sets get their own communicators.
    results = [static for static, _ in both]
    assert results[0] == ((2.0, 2), 3.0)
    assert results[1] == (None, 3.0)
    assert results[2] == ((2.0, 2), 3.0)
    # Dynamic sets, built and freed over three init/shutdown cycles.
    results = [dynamic for _, dynamic in both]
    for rank, rounds in enumerate(results):
        for round_, (value, total) in enumerate(rounds):
            assert total == 3.0
            assert value == (None if rank == 1 else 2.0 + 2 * round_)


def _mismatched_names():
    import torch

    import hvdlike.torch as hvd

    hvd.init()
    try:
        hvd.allreduce(torch.ones(2), name="only.on.rank0" if hvd.rank() == 0 else "only.on.rank1")
    except Exception as exc:  # the stall shutdown fails the collective on every rank
        return type(exc).__name__, str(exc)
    return None


def _mismatched_names_slow_watcher():
    import time

    from hvdlike.core import health

    original = health.Health._tick

    def slow_tick(self):  # rank 1's watcher is late, as on a loaded host
        if self.rank == 1 and not getattr(self, "_was_late", False) and \
                self._store_op(lambda: self.store.check(["health/abort"])):
            self._was_late = True
            time.sleep(3)
        original(self)

    health.Health._tick = slow_tick
    return _mismatched_names()


@pytest.mark.parametrize("fn", [_mismatched_names, _mismatched_names_slow_watcher],
                         ids=["watchers-prompt", "rank1-watcher-late"])
def test_stall_shutdown_ends_an_mpi_job_on_every_rank(fn):
    # With rank 1's watcher late, rank 0 (which hosts the store under mpirun) must not
    # take the store away before rank 1 has read why the job ends: rank 1 would
    # otherwise wait on MPI for ever.
    env = {"HVDLIKE_STALL_CHECK_TIME_SECONDS": "1", "HVDLIKE_STALL_SHUTDOWN_TIME_SECONDS": "2"}
    results = run_mpirun(fn, np=2, env=env, timeout=90)
    for kind, text in results:
        assert kind == "StallError"
        assert "only.on.rank0" in text and "missing rank(s) 1" in text
