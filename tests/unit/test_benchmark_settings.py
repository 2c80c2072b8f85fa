"""The benchmark's rank environment: which allocator settings the ranks get."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import benchmark  # noqa: E402


class Args:
    def __init__(self, allocator):
        self.allocator = allocator


def test_steady_allocator_fixes_both_thresholds():
    env, what = benchmark.rank_environment(Args("steady"), base={"PATH": "/bin"})
    assert env["MALLOC_TRIM_THRESHOLD_"] == str(1 << 30)
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20)
    assert env["OMP_NUM_THREADS"] == "1" and env["PATH"] == "/bin"
    assert what == (f"glibc thresholds MALLOC_MMAP_THRESHOLD_={32 << 20}, "
                    f"MALLOC_TRIM_THRESHOLD_={1 << 30}")


def test_a_threshold_the_caller_set_wins_and_is_reported():
    env, what = benchmark.rank_environment(Args("steady"),
                                           base={"MALLOC_TRIM_THRESHOLD_": "4096"})
    assert env["MALLOC_TRIM_THRESHOLD_"] == "4096"
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20)
    assert "MALLOC_TRIM_THRESHOLD_=4096" in what


@pytest.mark.parametrize("base,expected", [
    ({}, "default"),
    ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "glibc thresholds MALLOC_MMAP_THRESHOLD_=65536"),
])
def test_default_allocator_leaves_the_environment_alone(base, expected):
    env, what = benchmark.rank_environment(Args("default"), base=base)
    assert "MALLOC_TRIM_THRESHOLD_" not in env
    assert env.get("MALLOC_MMAP_THRESHOLD_") == base.get("MALLOC_MMAP_THRESHOLD_")
    assert what == expected


def test_an_unknown_allocator_choice_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        benchmark.main(["--allocator", "jemalloc", "--json", os.devnull])
    assert exc.value.code == 2
    assert "--allocator" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--reps", "0"], "--reps: must be at least 1, got 0"),
    (["--steps", "-2"], "--steps: must be at least 1, got -2"),
    (["--np", "0"], "--np: must be at least 1, got 0"),
    (["--rss-steps", "-3"], "--rss-steps: must be 0 (off) or more, got -3"),
    (["--warmup", "-1"], "--warmup: must be 0 or more, got -1"),
    (["--workloads", "train_large,bogus"], "--workloads: unknown ['bogus']; choose from "
     "train_large, train_small, allreduce, many_small, overhead, floor or none"),
])
def test_bad_counts_are_refused_before_any_rank_starts(argv, message, monkeypatch):
    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(benchmark.subprocess, "run", no_ranks)
    with pytest.raises(SystemExit) as exc:
        benchmark.main(argv + ["--json", os.devnull])
    assert str(exc.value) == message
