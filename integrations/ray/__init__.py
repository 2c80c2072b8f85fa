"""hvdlike on Ray: ``RayExecutor`` runs ranks as Ray actors (``horovod.ray``'s API;
``ElasticRayExecutor`` is Horovod's older elastic class over it, ``ray_logger.log``
feeds ``run(..., callbacks=)``), ``HvdlikeConfig`` is a Ray Train backend.

Needs ``pip install 'hvdlike[ray]'``; Ray is imported when an executor starts
(``HvdlikeConfig`` imports ``ray.train`` on first use), not by ``import
hvdlike.ray``. See docs/launcher.md ("Ray").
"""

from . import ray_logger
from .executor import ElasticRayExecutor, RayExecutor, RaySettings
from .worker import RankFailure

__all__ = ["ElasticRayExecutor", "HvdlikeConfig", "RayExecutor", "RaySettings", "RankFailure",
           "ray_logger"]


def __getattr__(name):
    if name == "HvdlikeConfig":
        from .train import HvdlikeConfig

        return HvdlikeConfig
    raise AttributeError(f"module 'hvdlike.ray' has no attribute {name!r}")
