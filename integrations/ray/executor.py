"""``RayExecutor``: hvdlike ranks as Ray actors (the ``horovod.ray`` API).

The driver (the process that calls :meth:`RayExecutor.start`) reserves one
placement group, starts one actor per rank in it, orders the ranks so each
node's ranks are contiguous (local and cross ranks follow from the actors' Ray
node ids, Horovod's definitions), and hosts the job's rendezvous store (the
launcher's :class:`~hvdlike.launcher.rendezvous.StoreServer`). Each actor
receives its ``HVDLIKE_*`` variables, the random job secret among them, as a
method argument over Ray's own channel: never on a command line. User
functions then call ``hvdlike.torch.init()`` as under ``hvdlike-run``.

Failure: :meth:`run` returns as soon as any rank fails. A function that raises
aborts that rank's runtime (its peers' collectives fail at once) and ``run``
raises :class:`~hvdlike.launcher.api.RankError` with the remote traceback; a
dead actor (killed, its node lost) raises ``RankError`` naming the rank. The
executor is then unusable until :meth:`shutdown`, which kills every actor and
releases the placement group and the store.

With ``min_workers``/``max_workers`` instead of ``num_workers`` the job is
elastic (:mod:`.elastic`): no placement group, actors per generation, a lost
rank re-forms the job instead of failing ``run``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from hvdlike.core.bootstrap import ENV_LAUNCHER
from hvdlike.core.config import KNOBS_BY_FIELD
from hvdlike.core.errors import HvdlikeError
from hvdlike.core.mpi_bootstrap import topologies
from hvdlike.launcher import env as rank_env
from hvdlike.launcher.api import RankError
from hvdlike.launcher.hosts import RankPlacement
from hvdlike.launcher.rendezvous import StoreServer, interface_address, new_secret

from .elastic import ElasticParams, ElasticRayJob, check_params
from .worker import Worker


def _call_without_executable(fn, args, kwargs, executable):  # noqa: ARG001 - run() ignores it
    return fn(*args, **kwargs)


@dataclasses.dataclass
class RaySettings:
    """What :meth:`RayExecutor.create_settings` returns."""

    timeout_s: float = 30.0
    """Seconds ranks may take to meet, and a collective may wait for a peer."""
    placement_group_timeout_s: float = 100.0
    """Seconds to wait for Ray to reserve every worker's resources."""
    nics: Optional[Sequence[str]] = None
    """Network interface Gloo and the store use (one name); default: chosen per route."""


class RayExecutor:
    """Run hvdlike ranks as Ray actors.

    Args:
        settings: from :meth:`create_settings`.
        num_workers: number of ranks, packed onto as few nodes as fit.
        num_hosts: number of nodes (one bundle each, on distinct nodes)...
        num_workers_per_host: ...and ranks per node; use these two instead of ``num_workers``.
        cpus_per_worker: CPUs Ray reserves per rank.
        use_gpu: reserve GPUs too.
        gpus_per_worker: GPUs per rank when ``use_gpu`` (default 1).

    Raises:
        ValueError: the worker counts are missing, mixed or not positive.

    Example:
        >>> ray.init(num_cpus=2)
        >>> executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
        >>> executor.start()
        >>> executor.run(lambda: __import__("hvdlike.torch").torch.init() or 0)
        [0, 0]
        >>> executor.shutdown()
    """

    @staticmethod
    def create_settings(timeout_s: float = 30, ssh_identity_file: Optional[str] = None,
                        ssh_str: Optional[str] = None, placement_group_timeout_s: float = 100,
                        nics: Optional[Sequence[str]] = None) -> RaySettings:
        """Settings for a :class:`RayExecutor`.

        ``ssh_identity_file`` and ``ssh_str`` are accepted for ``horovod.ray``
        compatibility and unused: ranks are actors, no ssh is involved.
        """
        if timeout_s <= 0 or placement_group_timeout_s <= 0:
            raise ValueError("create_settings: timeout_s and placement_group_timeout_s must be > 0")
        nics = list(nics) if nics else None
        if nics and len(nics) != 1:
            raise ValueError(f"create_settings: nics={nics!r}: give exactly one interface")
        return RaySettings(float(timeout_s), float(placement_group_timeout_s), nics)

    def __init__(self, settings: RaySettings, num_workers: Optional[int] = None,
                 num_hosts: Optional[int] = None, num_workers_per_host: int = 1,
                 cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: Optional[float] = None,
                 min_workers: Optional[int] = None, max_workers: Optional[int] = None,
                 reset_limit: Optional[int] = None,
                 cooldown_range: Optional[Sequence[float]] = None,
                 elastic_timeout: float = 600, override_discovery: bool = True):
        self._elastic: Optional[ElasticRayJob] = None
        if min_workers is not None or max_workers is not None:
            self._init_elastic(settings, num_workers, num_hosts, cpus_per_worker, use_gpu,
                               gpus_per_worker, min_workers, max_workers, reset_limit,
                               cooldown_range, elastic_timeout)
            return
        if (num_workers is None) == (num_hosts is None):
            raise ValueError("RayExecutor: give num_workers, or num_hosts with "
                             "num_workers_per_host (not both)")
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("num_workers_per_host", num_workers_per_host)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"RayExecutor: {name}={value!r} must be a positive integer")
        if cpus_per_worker <= 0:
            raise ValueError(f"RayExecutor: cpus_per_worker={cpus_per_worker!r} must be > 0")
        if gpus_per_worker is not None and not use_gpu:
            raise ValueError("RayExecutor: gpus_per_worker needs use_gpu=True")
        self.settings = settings
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.num_workers = num_workers if num_workers is not None else num_hosts * num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.workers: List[Any] = []  # actor handles in rank order
        self.placements: List[RankPlacement] = []
        self.pids: List[int] = []  # actor process ids, in rank order
        self._pg = None
        self._store: Optional[StoreServer] = None
        self._broken: Optional[str] = None

    def _init_elastic(self, settings, num_workers, num_hosts, cpus_per_worker, use_gpu,
                      gpus_per_worker, min_workers, max_workers, reset_limit, cooldown_range,
                      elastic_timeout) -> None:
        if num_workers is not None or num_hosts is not None:
            raise ValueError("RayExecutor: give num_workers/num_hosts (a fixed job) or "
                             "min_workers/max_workers (an elastic job), not both")
        if min_workers is None:
            raise ValueError("RayExecutor: max_workers needs min_workers (a positive integer)")
        if cpus_per_worker <= 0:
            raise ValueError(f"RayExecutor: cpus_per_worker={cpus_per_worker!r} must be > 0")
        if gpus_per_worker is not None and not use_gpu:
            raise ValueError("RayExecutor: gpus_per_worker needs use_gpu=True")
        check_params(min_workers, max_workers, reset_limit, cooldown_range, elastic_timeout)
        self.settings = settings
        self.num_workers = min_workers
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.workers, self.placements, self.pids = [], [], []
        self._pg = self._store = self._broken = None
        params = ElasticParams(min_workers, max_workers, reset_limit,
                               tuple(cooldown_range) if cooldown_range else None,
                               float(elastic_timeout))
        self._elastic = ElasticRayJob(params, settings.timeout_s, (settings.nics or [""])[0],
                                      cpus_per_worker, self.gpus_per_worker)

    @property
    def elastic(self) -> Optional[ElasticRayJob]:
        """The elastic job's state (None for a fixed job)."""
        return self._elastic

    # -- start -------------------------------------------------------------

    def _bundles(self) -> tuple:
        per_rank = {"CPU": self.cpus_per_worker}
        if self.gpus_per_worker:
            per_rank["GPU"] = self.gpus_per_worker
        if self.num_hosts is None:
            return [dict(per_rank) for _ in range(self.num_workers)], "PACK"
        per_host = {k: v * self.num_workers_per_host for k, v in per_rank.items()}
        return [dict(per_host) for _ in range(self.num_hosts)], "STRICT_SPREAD"

    def _reserve(self, ray):
        from ray.util.placement_group import placement_group, remove_placement_group

        bundles, strategy = self._bundles()
        pg = placement_group(bundles, strategy=strategy)
        try:
            ray.get(pg.ready(), timeout=self.settings.placement_group_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise HvdlikeError(
                f"RayExecutor: Ray could not reserve {len(bundles)} x {bundles[0]} "
                f"({strategy}) within {self.settings.placement_group_timeout_s:g}s; the "
                f"cluster has {ray.cluster_resources()}") from None
        return pg

    def start(self, executable_cls: Optional[type] = None,
              executable_args: Optional[Sequence[Any]] = None,
              executable_kwargs: Optional[Mapping[str, Any]] = None,
              extra_env_vars: Optional[Mapping[str, str]] = None) -> None:
        """Reserve resources, start the rank actors and the store.

        Args:
            executable_cls: optional class instantiated once per rank; :meth:`execute`
                passes that object to its function.
            executable_args: its positional arguments.
            executable_kwargs: its keyword arguments.
            extra_env_vars: more variables for every rank (knobs such as
                ``HVDLIKE_CYCLE_TIME`` included).

        Raises:
            HvdlikeError: Ray is not initialized, resources could not be reserved,
                or ``executable_cls`` raised.
        """
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            raise HvdlikeError("RayExecutor.start: call ray.init() (or ray.init(address=...)) first")
        if self._elastic is not None:
            self._elastic.start(executable_cls, executable_args, executable_kwargs,
                                extra_env_vars)
            return
        if self.workers:
            raise HvdlikeError("RayExecutor.start: already started; call shutdown() first")
        self._pg = self._reserve(ray)
        try:
            self._start_workers(ray, PlacementGroupSchedulingStrategy, extra_env_vars or {})
            self._check_all(self._call_all(
                lambda w: w.start_executable.remote(executable_cls, tuple(executable_args or ()),
                                                    dict(executable_kwargs or {}))))
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self, ray, strategy_cls, extra_env: Mapping[str, str]) -> None:
        actor_cls = ray.remote(Worker)
        actors = []
        for index in range(self.num_workers):
            bundle = index if self.num_hosts is None else index // self.num_workers_per_host
            actors.append(actor_cls.options(
                num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
                scheduling_strategy=strategy_cls(placement_group=self._pg,
                                                 placement_group_bundle_index=bundle),
            ).remote())
        self.workers = actors  # so shutdown() finds them whatever happens next
        where = ray.get([actor.where.remote() for actor in actors],
                        timeout=self.settings.placement_group_timeout_s + self.settings.timeout_s)
        # Ranks of one node are contiguous, nodes in order of first appearance.
        node_order = list(dict.fromkeys(w["node_id"] for w in where))
        order = sorted(range(len(actors)), key=lambda i: (node_order.index(where[i]["node_id"]), i))
        self.workers = [actors[i] for i in order]
        where = [where[i] for i in order]
        self.pids = [w["pid"] for w in where]
        topos = topologies([w["node_id"] for w in where])
        self.placements = [RankPlacement(w["ip"], t) for w, t in zip(where, topos)]

        nic = (self.settings.nics or [""])[0]
        if nic:
            addr = interface_address(nic)
        elif all(w["node_id"] == ray.get_runtime_context().get_node_id() for w in where):
            addr = "127.0.0.1"
        else:
            addr = ray.util.get_node_ip_address()
        secret = new_secret()
        self._store = StoreServer(addr, self.num_workers, secret,
                                  self.settings.timeout_s).__enter__()
        knobs = {KNOBS_BY_FIELD["start_timeout"].env: repr(self.settings.timeout_s),
                 KNOBS_BY_FIELD["gloo_timeout_seconds"].env: repr(self.settings.timeout_s)}
        envs = []
        for placement in self.placements:
            env = rank_env.rank_environment(dict(extra_env), placement, addr, self._store.port,
                                            secret, nic, {**knobs, **extra_env})
            env[ENV_LAUNCHER] = "ray"
            envs.append(env)
        ray.get([w.set_env.remote(env) for w, env in zip(self.workers, envs)])

    # -- running -------------------------------------------------------------

    def _call_all(self, submit: Callable[[Any], Any]) -> List[Any]:
        if self._broken:
            raise HvdlikeError(f"RayExecutor: a previous call failed ({self._broken}); "
                               "call shutdown() and start() again")
        if not self.workers:
            raise HvdlikeError("RayExecutor: not started; call start() first")
        return [submit(worker) for worker in self.workers]

    def _check_all(self, refs: Sequence[Any]) -> List[Any]:
        """Values in rank order; raise at the first rank that fails (not the lowest)."""
        import ray

        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        values: Dict[int, Any] = {}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            rank = rank_of[done[0]]
            host = self.placements[rank].host if self.placements else "?"
            try:
                outcome = ray.get(done[0])
            except ray.exceptions.RayActorError as exc:
                self._broken = f"rank {rank} died"
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise RankError(f"rank {rank} (host {host}) died: {reason}", rank, host) from None
            if not outcome["ok"]:
                self._broken = f"rank {rank} raised {outcome['type']}"
                raise RankError(
                    f"rank {rank} (host {host}) raised {outcome['type']}: {outcome['message']}\n"
                    f"{outcome['traceback']}".rstrip(), rank, host, outcome["traceback"])
            values[rank] = outcome["value"]
        return [values[rank] for rank in range(len(refs))]

    def run(self, fn: Callable[..., Any], args: Optional[Sequence[Any]] = None,
            kwargs: Optional[Mapping[str, Any]] = None) -> List[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order.

        Raises:
            RankError: a rank raised (with its traceback) or its actor died.
        """
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        if self._elastic is not None:
            return self._elastic.run(functools.partial(_call_without_executable, fn, args,
                                                       kwargs))
        return self._check_all(self._call_all(lambda w: w.run.remote(fn, args, kwargs)))

    def execute(self, fn: Callable[[Any], Any]) -> List[Any]:
        """``fn(executable)`` on every rank (the ``executable_cls`` object, or None)."""
        if self._elastic is not None:
            return self._elastic.run(fn)
        return self._check_all(self._call_all(lambda w: w.execute.remote(fn)))

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only."""
        self._not_elastic("execute_single")
        self._call_all(lambda w: None)
        return self._check_all([self.workers[0].execute.remote(fn)])[0]

    def run_remote(self, fn: Callable[..., Any], args: Optional[Sequence[Any]] = None,
                   kwargs: Optional[Mapping[str, Any]] = None) -> List[Any]:
        """Start ``fn`` on every rank; return Ray object refs (rank order) of its results.

        ``ray.get`` on a ref of a rank that raised raises an error carrying the
        remote traceback.
        """
        self._not_elastic("run_remote")
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        return self._call_all(lambda w: w.call.remote(fn, args, kwargs))

    def _not_elastic(self, name: str) -> None:
        if self._elastic is not None:
            raise HvdlikeError(f"RayExecutor.{name}: not available in an elastic job (its "
                               "rank actors change between generations); use run() or execute()")

    # -- stopping ------------------------------------------------------------

    def shutdown(self) -> None:
        """Kill every rank actor, release the placement group and the store."""
        import ray

        if self._elastic is not None:
            self._elastic.shutdown()
            return

        for worker in self.workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # already dead
                pass
        self.workers = []
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._pg)
            except Exception:  # the cluster is already gone
                pass
            self._pg = None
        if self._store is not None:
            self._store.__exit__(None, None, None)
            self._store = None
        self._broken = None
