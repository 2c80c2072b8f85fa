"""RayExecutor behaviour found missing in review, on the package's local Ray cluster.

Grouped into few tests, since every executor start costs seconds: results that
cannot be pickled, non-string ``extra_env_vars``, a second ``start``,
``callbacks`` with ``ray_logger.log``, CUDA_VISIBLE_DEVICES on a node with
(fake) GPUs, and an executor inside a Ray Tune-like placement group.
"""

import os
import threading

import pytest

from .conftest import wait_cpus_back, wait_gone


def _unpicklable():
    return threading.Lock()


def _log_and_return():
    from hvdlike.ray import ray_logger

    ray_logger.log({"rank": int(os.environ["HVDLIKE_RANK"])})
    return os.environ["NUM"]


@pytest.mark.timeout(120)
def test_fixed_job_env_callbacks_and_unpicklable_result(ray_cluster):
    from hvdlike.core.errors import HvdlikeError
    from hvdlike.launcher.api import RankError
    from hvdlike.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=20), num_workers=2)
    executor.start(extra_env_vars={"NUM": 1})
    pids = list(executor.pids)
    try:
        with pytest.raises(HvdlikeError, match="already started"):
            executor.start()
        logged = []
        assert executor.run(_log_and_return, callbacks=[logged.append]) == ["1", "1"]
        assert sorted(item["rank"] for item in logged) == [0, 1]
        with pytest.raises(RankError, match=r"rank \d \(host .+\): the function's result "
                                            r"\(_thread.lock\) cannot be pickled") as caught:
            executor.run(_unpicklable)
        assert caught.value.host != "?"
    finally:
        executor.shutdown()
        wait_gone(pids)
        wait_cpus_back(ray_cluster)


@pytest.mark.timeout(120)
def test_elastic_job_env_start_twice_and_unpicklable_result(ray_cluster, capfd):
    from hvdlike.core.errors import HvdlikeError
    from hvdlike.launcher.api import RankError
    from hvdlike.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=20), min_workers=1,
                           max_workers=1, elastic_timeout=30)
    executor.start(extra_env_vars={"NUM": 1})
    try:
        with pytest.raises(HvdlikeError, match="already started"):
            executor.start()
        logged = []
        assert executor.run(_log_and_return, callbacks=[logged.append]) == ["1"]
        assert logged == [{"rank": 0}]
        assert executor.elastic.ranks == {}  # no handle of a finished run is kept
        with pytest.raises(RankError, match=r"rank 0 \(host .+\): the function's result "
                                            r"\(_thread.lock\) cannot be pickled"):
            executor.run(_unpicklable)
        assert "blacklisted" not in capfd.readouterr().err  # not taken for a lost node
        assert executor.run(lambda: 5) == [5]
    finally:
        executor.shutdown()
        wait_cpus_back(ray_cluster)


@pytest.mark.timeout(150)
def test_ranks_of_a_gpu_node_see_all_its_job_gpus(ray_cluster):
    from hvdlike.ray import RayExecutor

    node = ray_cluster.cluster.add_node(num_cpus=2, num_gpus=2)
    ray_cluster.cluster.wait_for_nodes()

    def visible():
        return os.environ["HVDLIKE_LOCAL_RANK"], os.environ["CUDA_VISIBLE_DEVICES"]

    try:
        settings = RayExecutor.create_settings(timeout_s=20)
        fixed = RayExecutor(settings, num_workers=2, use_gpu=True)
        fixed.start()
        try:
            assert fixed.run(visible) == [("0", "0,1"), ("1", "0,1")]
        finally:
            fixed.shutdown()
        elastic = RayExecutor(settings, min_workers=2, max_workers=2, use_gpu=True,
                              elastic_timeout=30)
        elastic.start()
        try:
            assert elastic.run(visible) == [("0", "0,1"), ("1", "0,1")]
        finally:
            elastic.shutdown()
    finally:
        ray_cluster.remove_node(node)
    wait_cpus_back(ray_cluster)


@pytest.mark.timeout(210)
def test_an_executor_inside_a_placement_group_uses_it(ray_cluster):
    ray = ray_cluster.ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cpus = int(ray_cluster.total_cpus())
    group = placement_group([{"CPU": 1}] * cpus, strategy="PACK")  # every CPU: no room outside
    ray.get(group.ready(), timeout=60)

    @ray.remote(num_cpus=0)
    def trial():
        from hvdlike.ray import RayExecutor

        executor = RayExecutor(RayExecutor.create_settings(
            timeout_s=20, placement_group_timeout_s=5), num_workers=2)
        try:
            executor.start()
            return executor.run(lambda: 1)
        finally:
            executor.shutdown()

    try:
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_capture_child_tasks=True)
        # The trial is a new Ray worker process that starts two more: slow on a busy node.
        assert ray.get(trial.options(scheduling_strategy=strategy).remote(), timeout=150) == [1, 1]
        # The trial's group is the trial's: shutdown() left it in place.
        assert ray.util.placement_group_table(group)["state"] == "CREATED"
    finally:
        remove_placement_group(group)
    wait_cpus_back(ray_cluster)
