"""Ray Train: a ``DataParallelTrainer`` with :class:`hvdlike.ray.HvdlikeConfig` runs an
hvdlike loop on the package's local Ray cluster (``.ci/run`` installs ``ray[train]``)."""

import os

import pytest


def test_ray_train_trainer_runs_an_hvdlike_loop(ray_cluster, tmp_path):
    try:
        import ray.train  # noqa: F401
    except ImportError as exc:
        print(f"Ray Train test skipped: {exc} (pip install 'hvdlike[ray-train]')")
        pytest.skip(f"Ray Train test skipped: {exc} (pip install 'hvdlike[ray-train]')")
    from ray.train import RunConfig, ScalingConfig
    from ray.train.v2._internal.constants import is_v2_enabled

    from hvdlike.ray import HvdlikeConfig

    if is_v2_enabled():
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
    else:
        from ray.train.data_parallel_trainer import DataParallelTrainer

    def train_loop():
        import torch
        torch.set_num_threads(1)
        import hvdlike.torch as hvd

        hvd.init()
        total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
        out = {"sum": total, "size": hvd.size(), "rank": hvd.rank(),
               "launcher": os.environ["HVDLIKE_LAUNCHER"]}
        hvd.shutdown()
        return out

    trainer = DataParallelTrainer(
        train_loop, backend_config=HvdlikeConfig(timeout_s=60),
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(tmp_path), name="hvdlike-train"))
    result = trainer.fit()
    assert result.error is None, result.error
    # Rank 0's return value (Ray Train keeps the first worker's).
    assert getattr(result, "return_value", None) == {
        "sum": 3.0, "size": 2, "rank": 0, "launcher": "ray-train"}, result
