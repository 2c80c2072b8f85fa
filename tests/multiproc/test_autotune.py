"""Autotune on real ranks: the search finishes, every rank keeps the same settings."""

import csv
import importlib.util
import json
import os
import shutil

import pytest

from tests.multiproc.harness import run_mpirun, run_ranks

# Tensors per step (float32 elements): 1.2 MB, 0.8 MB, 0.2 MB and a tiny one, so the
# 1 MiB threshold splits the step into several batches and larger ones fuse it whole.
SIZES = (300_000, 200_000, 50_000, 7)
WARMUP, STEPS_PER_SAMPLE = 1, 2
# 5 thresholds + 3 more cycle times, 3 samples each; one more step to see the last one end.
NEEDED_STEPS = (WARMUP + (5 + 4 - 1) * 3) * STEPS_PER_SAMPLE + 1
ITERATIONS = NEEDED_STEPS + 10


def _train(out_dir):
    import torch

    import hvdlike.torch as hvd
    from hvdlike.core import api

    hvd.init()
    rank = hvd.rank()
    rt = api.runtime()
    wrong = []
    for i in range(ITERATIONS):
        tensors = [torch.full((n,), float(rank + 1 + i)) for n in SIZES]
        handles = [hvd.allreduce_async(t, name=f"grad{k}", op=hvd.Sum)
                   for k, t in enumerate(tensors)]
        for k, h in enumerate(handles):
            out = hvd.synchronize(h)
            expected = float(2 * i + 3)
            if not bool((out == expected).all()):
                wrong.append((i, k, float(out.min()), float(out.max()), expected))
    tuning = rt.autotuner is not None
    result = {
        "rank": rank,
        "wrong": wrong[:5],
        "still_tuning": tuning,
        "threshold": rt.settings.fusion_threshold,
        "executor_thresholds": [s.executor.fusion_threshold for s in rt.process_sets.values()],
        "cycle_seconds": rt.settings.cycle_seconds,
        "control_plane": type(rt.process_sets[0].controller.control).__name__,
    }
    hvd.barrier()
    hvd.shutdown()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _env(log):
    return {"HVDLIKE_AUTOTUNE": "1", "HVDLIKE_AUTOTUNE_LOG": log,
            "HVDLIKE_AUTOTUNE_WARMUP_SAMPLES": str(WARMUP),
            "HVDLIKE_AUTOTUNE_STEPS_PER_SAMPLE": str(STEPS_PER_SAMPLE)}


def _check(tmp_path, log, rank0_output, control_plane):
    """Both ranks settled alike, the CSV has every sample, rank 0 printed the settings."""
    results = []
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            results.append(json.load(f))
    for r in results:
        assert r["wrong"] == [], r  # values exact while the threshold kept changing
        assert not r["still_tuning"]
        assert r["executor_thresholds"] == [r["threshold"]]
        assert r["control_plane"] == control_plane
    assert results[0]["threshold"] == results[1]["threshold"]
    assert results[0]["cycle_seconds"] == results[1]["cycle_seconds"]

    with open(log) as f:
        rows = list(csv.DictReader(f))
    samples = WARMUP + (5 + 4 - 1) * 3
    assert [r["kind"] for r in rows] == ["warmup"] * WARMUP + ["sample"] * (samples - WARMUP) \
        + ["chosen"]
    mib = 1024 * 1024
    assert {int(r["fusion_threshold_bytes"]) for r in rows[:-1]} == \
        {n * mib for n in (1, 4, 16, 64, 128)}
    assert {float(r["cycle_time_ms"]) for r in rows[:-1]} == {0.5, 1.0, 2.5, 5.0}
    step_bytes = 4 * sum(SIZES)
    assert all(int(r["bytes"]) == STEPS_PER_SAMPLE * step_bytes for r in rows[:-1])
    assert all(float(r["score_bytes_per_second"]) > 0 for r in rows[:-1])
    chosen = rows[-1]
    assert int(chosen["fusion_threshold_bytes"]) == results[0]["threshold"]
    assert float(chosen["cycle_time_ms"]) / 1000.0 == results[0]["cycle_seconds"]

    lines = [line.strip() for line in rank0_output.splitlines()]
    assert lines.count(f"HVDLIKE_FUSION_THRESHOLD={chosen['fusion_threshold_bytes']}") == 1, \
        rank0_output
    assert lines.count(f"HVDLIKE_CYCLE_TIME={chosen['cycle_time_ms']}") == 1, rank0_output
    assert "autotune settled" in rank0_output


def test_autotune_two_ranks(tmp_path):
    log = str(tmp_path / "autotune.csv")
    codes, outputs = run_ranks(_train, np=2, args=(str(tmp_path),), env=_env(log), timeout=150,
                               expect_failure=True)
    assert codes == [0, 0], outputs
    _check(tmp_path, log, outputs[0], "ShmControlPlane")
    assert "HVDLIKE_FUSION_THRESHOLD=" not in outputs[1]


@pytest.mark.skipif(shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None,
                    reason="needs mpirun and mpi4py (pip install 'hvdlike[mpi]')")
def test_autotune_over_the_mpi_control_plane(tmp_path):
    log = str(tmp_path / "autotune.csv")
    code, output = run_mpirun(_train, np=2, args=(str(tmp_path),), env=_env(log), timeout=150,
                              expect_failure=True)
    assert code == 0, output
    _check(tmp_path, log, output, "MpiControlPlane")  # mpirun merges the ranks' output: printed once


def _start_with_bad_log():
    import hvdlike.torch as hvd

    try:
        hvd.init()
    except ValueError as exc:
        print("init failed:", exc, flush=True)
        return
    hvd.shutdown()
    print("init succeeded", flush=True)


def test_autotune_bad_log_path_fails_init(tmp_path):
    bad = str(tmp_path / "missing" / "autotune.csv")
    env = {"HVDLIKE_AUTOTUNE": "1", "HVDLIKE_AUTOTUNE_LOG": bad}
    codes, outputs = run_ranks(_start_with_bad_log, np=1, env=env, timeout=60,
                               expect_failure=True)
    assert codes == [0], outputs
    assert f"init failed: HVDLIKE_AUTOTUNE_LOG={bad!r}: cannot write" in outputs[0], outputs
