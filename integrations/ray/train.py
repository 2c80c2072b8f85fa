"""``HvdlikeConfig``: a Ray Train backend, so a ``DataParallelTrainer`` runs hvdlike loops.

Usage::

    from ray.train import ScalingConfig
    from ray.train.data_parallel_trainer import DataParallelTrainer  # or ray.train.v2...
    from hvdlike.ray import HvdlikeConfig

    def train_loop():
        import hvdlike.torch as hvd
        hvd.init()          # reads the variables the backend gave this worker
        ...

    DataParallelTrainer(train_loop, backend_config=HvdlikeConfig(timeout_s=60),
                        scaling_config=ScalingConfig(num_workers=4)).fit()

When Ray Train starts its worker group, the backend (in Ray Train's own
process) hosts the job's rendezvous store, draws a random job secret and gives
every worker its ``HVDLIKE_*`` variables by a call over Ray's channel. Ranks
follow the worker group's order; local and cross ranks come from the workers'
Ray node ids. On shutdown it stops any runtime still up and closes the store.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Set, Union

from ray.train.backend import Backend, BackendConfig

from hvdlike.core.bootstrap import ENV_LAUNCHER
from hvdlike.core.config import KNOBS_BY_FIELD
from hvdlike.core.mpi_bootstrap import topologies
from hvdlike.launcher import env as rank_env
from hvdlike.launcher.hosts import RankPlacement
from hvdlike.launcher.rendezvous import StoreServer, new_secret

from . import checks
from .worker import Worker


@dataclasses.dataclass
class HvdlikeConfig(BackendConfig):
    """Ray Train backend configuration for hvdlike.

    Attributes:
        timeout_s: seconds ranks may take to meet and a collective may wait for a peer.
        nic: network interface for the store and Gloo (default: chosen per route).
        nics: Ray's ``HorovodConfig`` spelling of ``nic``: a set of one interface.
        placement_group_timeout_s: accepted (checked) as in Ray's ``HorovodConfig``;
            Ray Train reserves the workers' resources itself.

    Raises:
        ValueError: (a ``ConfigError``) a value of the wrong type or range, or
            ``nic`` and ``nics`` naming different interfaces.
    """

    timeout_s: float = 300.0
    nic: Optional[str] = None
    nics: Optional[Union[Set[str], str]] = None
    placement_group_timeout_s: float = 100.0

    def __post_init__(self):
        """Refuse bad values here, in the driver, not in Ray Train's controller later."""
        where = "HvdlikeConfig"
        self.timeout_s = checks.seconds(where, "timeout_s", self.timeout_s)
        self.placement_group_timeout_s = checks.seconds(where, "placement_group_timeout_s",
                                                        self.placement_group_timeout_s)
        nic = checks.nic_list(where, self.nic, name="nic")
        nics = checks.nic_list(where, self.nics)
        if nic and nics and nic != nics:
            raise checks.ConfigError(f"{where}: nic={self.nic!r} and nics={self.nics!r} "
                                     "name different interfaces; give one")
        self.nic = (nic or nics or [None])[0]

    @property
    def backend_cls(self):
        return _HvdlikeBackend

    @property
    def framework(self):
        return "hvdlike"


def _where():
    return Worker().where()


def _set_env(env):
    Worker().set_env(env)


def _shutdown():
    from hvdlike.core import api

    api.shutdown()


class _HvdlikeBackend(Backend):
    # Ray Train then shows each worker all of its node's job GPUs (as Ray's Horovod
    # backend does), so torch.cuda.set_device(hvd.local_rank()) works.
    share_cuda_visible_devices: bool = True

    def on_start(self, worker_group, backend_config: HvdlikeConfig):
        import ray

        where = worker_group.execute(_where)
        placements = [RankPlacement(w["ip"], t)
                      for w, t in zip(where, topologies([w["node_id"] for w in where]))]
        if backend_config.nic:  # checked here: this process hosts the store
            addr = checks.nic_address("HvdlikeConfig", backend_config.nic, name="nic")
        elif all(w["node_id"] == ray.get_runtime_context().get_node_id() for w in where):
            addr = "127.0.0.1"
        else:
            addr = ray.util.get_node_ip_address()
        secret = new_secret()
        self._store = StoreServer(addr, len(placements), secret,
                                  backend_config.timeout_s).__enter__()
        timeout = repr(float(backend_config.timeout_s))
        knobs = {KNOBS_BY_FIELD["start_timeout"].env: timeout,
                 KNOBS_BY_FIELD["gloo_timeout_seconds"].env: timeout}
        refs = []
        for index, placement in enumerate(placements):
            env = rank_env.rank_environment({}, placement, addr, self._store.port, secret,
                                            backend_config.nic or "", knobs)
            env[ENV_LAUNCHER] = "ray-train"
            refs.append(worker_group.execute_single_async(index, _set_env, env))
        ray.get(refs)

    def on_shutdown(self, worker_group, backend_config: HvdlikeConfig):
        try:
            worker_group.execute(_shutdown)
        finally:
            store, self._store = getattr(self, "_store", None), None
            if store is not None:
                store.__exit__(None, None, None)
