"""The side-by-side benchmark runs end to end in its quick mode (no timing assertions)."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Smoke-sized beyond --quick: two rotated rounds of one timed step and no
# warm-up per contender, and the RSS check from its first measured step (10)
# to step 12. Every workload, table row, ratio and target is still produced.
SMALLEST = ["--np", "2", "--quick", "--steps", "1", "--warmup", "0", "--rss-steps", "12"]


@pytest.mark.parametrize("launcher,engine", [("torchrun", "shm"), ("mpirun", "mpi")])
def test_quick_benchmark_writes_every_workload_and_finite_ratios(tmp_path, launcher, engine):
    """Every workload end to end; under torchrun the same job also runs ``floor``
    (one host, shared memory), which must reduce like hvdlike and leave no segment."""
    if launcher == "mpirun" and (shutil.which("mpirun") is None
                                 or not __import__("importlib").util.find_spec("mpi4py")):
        pytest.skip("needs mpirun and mpi4py (pip install mpi4py mpich)")
    floor = launcher == "torchrun"
    workloads = ["train_large", "train_small", "allreduce", "many_small", "overhead"]
    workloads += ["floor"] if floor else []
    before = set(os.listdir("/dev/shm"))
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "benchmark.py")] + SMALLEST +
        ["--workloads", ",".join(workloads), "--json", str(out), "--timeout", "150",
         "--launcher", launcher],
        capture_output=True, text=True, timeout=180, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    results = data["results"]
    # hvdlike ran on the engines this launcher gives it (one host: shared memory unless MPI).
    assert (data["meta"]["hvdlike_controller"], data["meta"]["hvdlike_cpu_operations"]) == (
        engine, engine)
    assert set(results) == {"train_large", "train_small", "allreduce", "many_small",
                            "overhead", "rss"} | ({"floor"} if floor else set())
    for key in ("train_large", "train_small"):
        assert results[key]["hvdlike_optimizer"] == "DistributedOptimizer"
        # Same weights, batches and step count: hvdlike and DDP train identically.
        assert results[key]["max_param_diff_vs_ddp"] < 1e-5
        for contender in ("hvdlike", "ddp", "compute"):
            assert results[key][contender]["n"] >= 2
            faults = results[key][contender]["minor_faults_per_step"]
            # A median of whole counts: whole or halfway between two.
            assert faults >= 0 and 2 * faults == int(2 * faults), (key, contender, faults)
    assert data["ratios"], "no ratios computed"
    for name, value in data["ratios"].items():
        assert math.isfinite(value) and value > 0, (name, value)
    assert {t["target"].split()[0] for t in data["targets"]} >= {
        "train_large", "train_small", "allreduce", "500x4KiB", "control", "whole", "RSS"}
    assert "hvdlike/ddp" in proc.stdout  # the table was printed
    # By default the ranks' glibc keeps freed buffers (see --allocator).
    assert data["meta"]["allocator"].startswith("glibc thresholds MALLOC_MMAP_THRESHOLD_=")
    assert "page faults per step" in proc.stdout
    if floor:
        floor_result = results["floor"]
        # The segment's average and hvdlike's took the same steps on the same batches.
        assert floor_result["max_param_diff_segment_vs_hvdlike"] < 1e-6
        for contender in ("compute", "barrier", "copy", "copy_barrier", "segment", "hvdlike"):
            assert floor_result[contender]["n"] >= 2
        assert "floor of a synchronous step" in proc.stdout
        assert not [n for n in set(os.listdir("/dev/shm")) - before if "bench-floor" in n]
