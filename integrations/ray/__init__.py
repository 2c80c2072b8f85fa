"""hvdlike on Ray: ``RayExecutor`` runs ranks as Ray actors (``horovod.ray``'s API).

Needs ``pip install 'hvdlike[ray]'``; Ray is imported when an executor starts,
not by ``import hvdlike.ray``. See docs/launcher.md ("Ray").
"""

from .executor import RayExecutor, RaySettings
from .worker import RankFailure

__all__ = ["RayExecutor", "RaySettings", "RankFailure"]
