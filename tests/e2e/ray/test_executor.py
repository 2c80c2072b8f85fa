"""hvdlike.ray.RayExecutor (fixed size) on the package's real local Ray cluster.

Ray's start-up is slow on a small machine, so the tests share one cluster
(``conftest.py``) and keep to three executors. Every test checks that
``shutdown()`` leaves no rank actor process and gives every CPU back to Ray.
"""

import os
import signal
import threading
import time

import psutil
import pytest

from .conftest import wait_cpus_back, wait_gone


def _shut_down_cleanly(ray_cluster, executor):
    pids = list(executor.pids)
    executor.shutdown()
    wait_gone(pids)
    wait_cpus_back(ray_cluster)


def test_run_execute_and_run_remote_in_rank_order(ray_cluster):
    from hvdlike.ray import RayExecutor

    def train(scale):
        import torch
        torch.set_num_threads(1)
        import hvdlike.torch as hvd

        hvd.init()
        total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
        out = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
               hvd.cross_size(), total * scale, os.environ["HVDLIKE_LAUNCHER"])
        hvd.shutdown()
        return out

    class Model:
        def __init__(self, base):
            self.base = base

    settings = RayExecutor.create_settings(timeout_s=30)
    executor = RayExecutor(settings, num_workers=2, cpus_per_worker=1)
    executor.start(executable_cls=Model, executable_args=[10])
    try:
        assert executor.run(train, args=[2]) == [(0, 2, 0, 2, 0, 1, 6.0, "ray"),
                                                 (1, 2, 1, 2, 0, 1, 6.0, "ray")]
        assert executor.execute(lambda model: model.base + int(os.environ["HVDLIKE_RANK"])) == [
            10, 11]
        assert executor.execute_single(lambda model: model.base) == 10
        refs = executor.run_remote(train, kwargs={"scale": 1})
        assert [r[6] for r in ray_cluster.ray.get(refs)] == [3.0, 3.0]
        # The job secret reaches the actors over Ray's channel, never a command line.
        secret = executor._store.secret
        assert len(secret) == 32
        for proc in psutil.process_iter(["cmdline"]):
            assert not any(secret in part for part in proc.info["cmdline"] or [])
    finally:
        _shut_down_cleanly(ray_cluster, executor)


def test_a_raising_rank_fails_run_with_its_traceback(ray_cluster):
    from hvdlike.core.errors import HvdlikeError
    from hvdlike.launcher.api import RankError
    from hvdlike.ray import RayExecutor

    def train():
        import torch
        torch.set_num_threads(1)
        import hvdlike.torch as hvd

        hvd.init()
        hvd.allreduce(torch.ones(2), name="warm-up")
        if hvd.rank() == 1:
            raise ValueError("rank one fails on purpose")
        for step in range(10_000):  # rank 0 would wait here for rank 1 forever
            hvd.allreduce(torch.ones(2), name=f"step{step}")
        return "not reached"

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=20), num_hosts=1,
                           num_workers_per_host=2)
    executor.start()
    try:
        with pytest.raises(RankError) as caught:
            executor.run(train)
        assert caught.value.rank == 1
        assert "ValueError: rank one fails on purpose" in str(caught.value)
        assert 'in train\n    raise ValueError("rank one fails on purpose")' in str(caught.value)
        with pytest.raises(HvdlikeError, match="call shutdown"):
            executor.run(train)
    finally:
        _shut_down_cleanly(ray_cluster, executor)


def test_a_killed_actor_fails_the_run(ray_cluster, tmp_path):
    from hvdlike.launcher.api import RankError
    from hvdlike.ray import RayExecutor

    ready = str(tmp_path)

    def train():
        import torch
        torch.set_num_threads(1)
        import hvdlike.torch as hvd

        hvd.init()
        for step in range(100_000):
            hvd.allreduce(torch.ones(2), name=f"step{step}")
            if step == 0:
                open(os.path.join(ready, f"ready.{hvd.rank()}"), "w").close()
            time.sleep(0.01)

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=2)
    executor.start()
    victim = executor.pids[1]

    def kill_when_training():
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(ready, "ready.1")) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(victim, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_training, daemon=True)
    killer.start()
    try:
        with pytest.raises(RankError, match="rank 1 .*died") as caught:
            executor.run(train)
        assert caught.value.rank == 1
    finally:
        killer.join(timeout=60)
        _shut_down_cleanly(ray_cluster, executor)


def test_bad_arguments_are_refused_before_anything_starts():
    from hvdlike.ray import RayExecutor

    settings = RayExecutor.create_settings(timeout_s=5)
    with pytest.raises(ValueError, match="num_workers, or num_hosts"):
        RayExecutor(settings)
    with pytest.raises(ValueError, match="num_workers=0"):
        RayExecutor(settings, num_workers=0)
    with pytest.raises(ValueError, match="gpus_per_worker needs use_gpu"):
        RayExecutor(settings, num_workers=1, gpus_per_worker=1)
    with pytest.raises(ValueError, match="timeout_s"):
        RayExecutor.create_settings(timeout_s=0)
