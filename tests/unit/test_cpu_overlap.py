"""When DistributedOptimizer starts reducing CPU gradients: the auto rule and the knob."""

import types

import pytest

from hvdlike.core import config
from hvdlike.torch import optimizer


def _runtime(monkeypatch, env, local_size, cpus, host_cpus, threads, quota=None):
    rt = types.SimpleNamespace(config=config.load(env),
                               topology=types.SimpleNamespace(local_size=local_size))
    monkeypatch.setattr(optimizer._core_api, "runtime", lambda: rt)
    monkeypatch.setattr(optimizer, "_usable_cpus", lambda: cpus)
    monkeypatch.setattr(optimizer.os, "cpu_count", lambda: host_cpus)
    monkeypatch.setattr(optimizer.torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(optimizer, "_cpu_quota", lambda: quota)


@pytest.mark.parametrize("local_size,cpus,host_cpus,threads,overlaps", [
    (2, 2, 2, 1, False),   # two ranks of one thread on two cores: no idle core
    (2, 4, 4, 1, True),    # two idle cores for the background threads
    (2, 4, 4, 2, False),   # 2 x 2 threads fill 4 cores
    (4, 2, 2, 1, False),   # oversubscribed
    (1, 8, 8, 4, True),    # one rank of 4 threads on 8 cores
    (4, 2, 8, 1, True),    # pinned to 2 of the host's 8 CPUs, one thread: one idle
    (4, 2, 8, 2, False),   # pinned to 2 CPUs, two threads fill them
])
def test_auto_overlaps_while_a_core_is_left_idle(monkeypatch, local_size, cpus, host_cpus,
                                                 threads, overlaps):
    _runtime(monkeypatch, {}, local_size, cpus, host_cpus, threads)
    assert optimizer._overlaps_cpu() is overlaps


@pytest.mark.parametrize("local_size,cpus,threads,quota,overlaps", [
    (2, 64, 1, 2.0, False),  # a container of 2 CPUs on a 64-CPU host: full
    (2, 64, 1, 4.0, True),
    (2, 64, 2, 4.0, False),
    (1, 64, 1, 0.5, False),  # half a CPU: never an idle one
])
def test_auto_counts_a_container_quota_not_the_hosts_cpus(monkeypatch, local_size, cpus,
                                                         threads, quota, overlaps):
    _runtime(monkeypatch, {}, local_size, cpus, cpus, threads, quota)
    assert optimizer._overlaps_cpu() is overlaps


@pytest.mark.parametrize("value,overlaps", [("1", True), ("on", True), ("0", False),
                                            ("false", False)])
def test_the_knob_wins_over_the_rule(monkeypatch, value, overlaps):
    _runtime(monkeypatch, {"HVDLIKE_CPU_OVERLAP": value}, 2, 2, 2, 1)
    assert optimizer._overlaps_cpu() is overlaps
    _runtime(monkeypatch, {"HOROVOD_CPU_OVERLAP": value}, 1, 64, 64, 1)
    assert optimizer._overlaps_cpu() is overlaps
