"""The torch examples, end to end through the real ``hvdlike-run -np 2``."""

import re

from .conftest import run


def test_torch_digits_trains_to_a_good_accuracy_on_two_ranks():
    code, out, err, _ = run(["-np", "2", "python", "examples/torch_digits.py", "--epochs", "4"],
                            timeout=180)
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    final = re.search(r"\[0\]<stdout>:torch_digits: 2 rank\(s\), 4 epochs, global batch 64, "
                      r"[\d.]+s training; test accuracy ([\d.]+) on 397 images", out)
    assert final, out
    assert float(final.group(1)) > 0.9
    assert "[0]<stdout>:[##############################] 88/88" in out  # progress bar, rank 0
    assert "[1]<stdout>:" not in out  # other ranks stay quiet


def test_torch_synthetic_benchmark_reports_per_rank_and_total():
    code, out, err, _ = run(["-np", "2", "python", "examples/torch_synthetic_benchmark.py",
                             "--model", "mlp", "--num-warmup-batches", "1", "--num-iters", "2",
                             "--num-batches-per-iter", "2", "--fp16-allreduce"], timeout=180)
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    for rank in (0, 1):
        assert re.search(rf"\[0\]<stdout>:rank {rank}: [\d.]+ \+-[\d.]+ img/sec", out), out
    assert re.search(r"\[0\]<stdout>:total on 2 rank\(s\): [\d.]+ \+-[\d.]+ img/sec", out), out


def test_torch_elastic_digits_survives_a_killed_rank():
    code, out, err, _ = run(["-np", "3", "--min-np", "2", "-H", "127.0.0.1:2,127.0.0.2:1",
                             "python", "examples/torch_elastic_digits.py", "--epochs", "3",
                             "--kill-rank-at-step", "10"],
                            timeout=240, env=None)
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "[0]<stdout>:torch_elastic_digits: re-formed with 2 rank(s) at step 10" in out, out
    final = re.search(r"\[0\]<stdout>:torch_elastic_digits: 2 rank\(s\) at the end, 3 epochs, "
                      r"(\d+) committed steps; test accuracy ([\d.]+)", out)
    assert final, out
    assert float(final.group(2)) > 0.9
    assert "lost rank 2 (generation 1) on host 127.0.0.2: was killed by signal 9 (SIGKILL)" in err
