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
from hvdlike.launcher.rendezvous import StoreServer, new_secret

from . import checks
from .callbacks import Callbacks
from .elastic import ElasticParams, ElasticRayJob, check_params
from .worker import UNPICKLABLE, Worker


def _call_without_executable(fn, args, kwargs, executable):  # noqa: ARG001 - run() ignores it
    return fn(*args, **kwargs)


def _gpus(use_gpu: bool, gpus_per_worker: Optional[float]) -> float:
    """GPUs per rank: 0 without ``use_gpu``; ``None`` (or 0, as in Horovod) means 1."""
    if gpus_per_worker is not None and not use_gpu:
        raise checks.ConfigError("RayExecutor: gpus_per_worker needs use_gpu=True")
    if not use_gpu:
        return 0
    if gpus_per_worker is None or (gpus_per_worker == 0 and not isinstance(gpus_per_worker, bool)):
        return 1
    return checks.amount("RayExecutor", "gpus_per_worker", gpus_per_worker)


def _first_line(exc: BaseException) -> str:
    """The first line of a Ray error (its remote stack follows, not wanted in ours)."""
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _first_gpu(where: Mapping[str, Any]) -> tuple:
    """Sort key of an actor by its first Ray GPU id (none: first)."""
    ids = where.get("gpu_ids") or []
    if not ids:
        return (0, -1, "")
    first = str(ids[0])
    return (0, int(first), "") if first.isdigit() else (1, 0, first)


def visible_devices(node_ids: Sequence[str], gpu_ids: Sequence[Sequence[str]]) -> List[str]:
    """Each rank's ``CUDA_VISIBLE_DEVICES``: the sorted union of its node's ranks' GPUs.

    Ray gives each actor only its own GPU; Horovod shows each rank all of its
    node's job GPUs so that ``torch.cuda.set_device(hvd.local_rank())`` works.
    With one GPU per rank, local rank ``i`` finds its own device at index ``i``,
    since :meth:`RayExecutor._start_workers` numbers a node's ranks in GPU order.
    """
    union: Dict[str, set] = {}
    for node, ids in zip(node_ids, gpu_ids):
        union.setdefault(node, set()).update(str(i) for i in ids)

    def order(gpu: str):
        return (0, int(gpu), "") if gpu.isdigit() else (1, 0, gpu)

    return [",".join(sorted(union[node], key=order)) for node in node_ids]


@dataclasses.dataclass
class RaySettings:
    """What :meth:`RayExecutor.create_settings` returns."""

    timeout_s: float = 30.0
    """Seconds ranks may take to meet, and a collective may wait for a peer."""
    placement_group_timeout_s: float = 100.0
    """Seconds to wait for Ray to reserve every worker's resources."""
    nics: Optional[Sequence[str]] = None
    """Network interface Gloo and the store use (one name); default: chosen per route."""

    def __post_init__(self):
        """Settings built directly (not by ``create_settings``) are checked the same way."""
        self.timeout_s = checks.seconds("RaySettings", "timeout_s", self.timeout_s)
        self.placement_group_timeout_s = checks.seconds(
            "RaySettings", "placement_group_timeout_s", self.placement_group_timeout_s)
        self.nics = checks.nic_list("RaySettings", self.nics)


class RayExecutor:
    """Run hvdlike ranks as Ray actors.

    Args:
        settings: from :meth:`create_settings`.
        num_workers: number of ranks, packed onto as few nodes as fit.
        num_hosts: number of nodes (one bundle each, on distinct nodes)...
        num_workers_per_host: ...and ranks per node; use these two instead of ``num_workers``.
        cpus_per_worker: CPUs Ray reserves per rank.
        use_gpu: reserve GPUs too.
        gpus_per_worker: GPUs per rank when ``use_gpu`` (default 1). Every rank
            of a node sees all the GPUs the job's ranks got on that node
            (``CUDA_VISIBLE_DEVICES``), so ``torch.cuda.set_device(hvd.local_rank())``
            picks its own.
        use_current_placement_group: when the executor is created inside a
            placement group that captures child tasks (a Ray Tune trial), start
            the ranks in that group instead of reserving a new one.

    Raises:
        ValueError: (a :class:`~hvdlike.core.errors.ConfigError`) an argument has
            a wrong type or value; the message names it.

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
        where = "create_settings"
        return RaySettings(checks.seconds(where, "timeout_s", timeout_s),
                           checks.seconds(where, "placement_group_timeout_s",
                                          placement_group_timeout_s),
                           checks.nic_list(where, nics))

    def __init__(self, settings: RaySettings, num_workers: Optional[int] = None,
                 num_hosts: Optional[int] = None, num_workers_per_host: int = 1,
                 cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: Optional[float] = None,
                 use_current_placement_group: bool = True,
                 min_workers: Optional[int] = None, max_workers: Optional[int] = None,
                 reset_limit: Optional[int] = None,
                 cooldown_range: Optional[Sequence[float]] = None,
                 elastic_timeout: float = 600, override_discovery: bool = True):
        self._elastic: Optional[ElasticRayJob] = None
        self.cpus_per_worker = checks.amount("RayExecutor", "cpus_per_worker", cpus_per_worker)
        self.gpus_per_worker = _gpus(use_gpu, gpus_per_worker)
        self.use_current_placement_group = bool(use_current_placement_group)
        self.workers: List[Any] = []  # actor handles in rank order
        self.placements: List[RankPlacement] = []
        self.pids: List[int] = []  # actor process ids, in rank order
        self._pg = None
        self._own_pg = False  # whether shutdown() removes self._pg (not a Tune trial's)
        self._store: Optional[StoreServer] = None
        self._broken: Optional[str] = None
        self.settings = settings
        if min_workers is not None or max_workers is not None:
            self._init_elastic(num_workers, num_hosts, num_workers_per_host, min_workers,
                               max_workers, reset_limit, cooldown_range, elastic_timeout)
            return
        if (num_workers is None) == (num_hosts is None) or (
                num_workers is not None and num_workers_per_host != 1):
            raise ValueError("RayExecutor: give num_workers, or num_hosts with "
                             "num_workers_per_host (not both)")
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("num_workers_per_host", num_workers_per_host)):
            if value is not None:
                checks.count("RayExecutor", name, value)
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.num_workers = num_workers if num_workers is not None else num_hosts * num_workers_per_host

    def _init_elastic(self, num_workers, num_hosts, num_workers_per_host, min_workers,
                      max_workers, reset_limit, cooldown_range, elastic_timeout) -> None:
        if num_workers is not None or num_hosts is not None or num_workers_per_host != 1:
            raise ValueError("RayExecutor: give num_workers/num_hosts/num_workers_per_host "
                             "(a fixed job) or min_workers/max_workers (an elastic job), not both")
        if min_workers is None:
            raise ValueError("RayExecutor: max_workers needs min_workers (a positive integer)")
        cooldown_range = check_params(min_workers, max_workers, reset_limit, cooldown_range,
                                      elastic_timeout)
        self.num_workers = min_workers
        self.num_hosts = None
        self.num_workers_per_host = 1
        params = ElasticParams(min_workers, max_workers, reset_limit, cooldown_range,
                               float(elastic_timeout))
        settings = self.settings
        self._elastic = ElasticRayJob(
            params, settings.timeout_s, (settings.nics or [""])[0], self.cpus_per_worker,
            self.gpus_per_worker,
            start_wait_s=settings.placement_group_timeout_s + settings.timeout_s)

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
        """This job's placement group: the current one (a Tune trial's) or a new one."""
        from ray.util.placement_group import (get_current_placement_group, placement_group,
                                              remove_placement_group)

        current = get_current_placement_group() if self.use_current_placement_group else None
        if current is not None:
            self._own_pg = False
            return current
        self._own_pg = True
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
              extra_env_vars: Optional[Mapping[str, Any]] = None) -> None:
        """Reserve resources, start the rank actors and the store.

        Args:
            executable_cls: optional class instantiated once per rank; :meth:`execute`
                passes that object to its function.
            executable_args: its positional arguments.
            executable_kwargs: its keyword arguments.
            extra_env_vars: more variables for every rank (knobs such as
                ``HVDLIKE_CYCLE_TIME`` included); keys and values are made
                strings with ``str()``, as Horovod does.

        Raises:
            HvdlikeError: Ray is not initialized, the executor is already started,
                the ``nics`` interface does not exist on this host (a
                ``ConfigError`` naming ``nics``), resources could not be
                reserved, or ``executable_cls`` raised.
        """
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            raise HvdlikeError("RayExecutor.start: call ray.init() (or ray.init(address=...)) first")
        # Everything that can be refused is checked before any resource is reserved.
        extra_env = checks.env_strings("RayExecutor.start", extra_env_vars)
        if self._elastic is not None:
            if self._elastic.started:
                raise HvdlikeError("RayExecutor.start: already started; call shutdown() first")
            self._elastic.start(executable_cls, executable_args, executable_kwargs, extra_env)
            return
        if self.workers:
            raise HvdlikeError("RayExecutor.start: already started; call shutdown() first")
        nic = (self.settings.nics or [""])[0]
        nic_addr = checks.nic_address("RayExecutor.start", nic) if nic else ""
        self._pg = self._reserve(ray)
        try:
            self._start_workers(ray, PlacementGroupSchedulingStrategy, extra_env, nic_addr)
            self._check_all(self._call_all(
                lambda w: w.start_executable.remote(executable_cls, tuple(executable_args or ()),
                                                    dict(executable_kwargs or {}))))
        except BaseException:
            self.shutdown()
            raise

    def _bundle_of(self, index: int) -> int:
        """Rank actor ``index``'s bundle (-1: any bundle of a group this job did not make)."""
        if not self._own_pg:
            return -1
        return index if self.num_hosts is None else index // self.num_workers_per_host

    def _where(self, ray, actors) -> List[Dict[str, Any]]:
        """Where each actor runs; an actor Ray cannot place fails ``start`` with the group named."""
        wait_s = self.settings.placement_group_timeout_s + self.settings.timeout_s
        try:
            return ray.get([actor.where.remote() for actor in actors], timeout=wait_s)
        except ray.exceptions.GetTimeoutError:
            raise HvdlikeError(
                f"RayExecutor.start: {len(actors)} rank actor(s) of {self.cpus_per_worker:g} CPU"
                + (f" and {self.gpus_per_worker:g} GPU" if self.gpus_per_worker else "")
                + f" did not all start within {wait_s:g}s in placement group "
                f"{self._pg.bundle_specs}"
                + ("" if self._own_pg else " (the current one: use_current_placement_group="
                   "False reserves a new one)")) from None

    def _start_workers(self, ray, strategy_cls, extra_env: Mapping[str, str],
                       nic_addr: str) -> None:
        actor_cls = ray.remote(Worker)
        actors = []
        for index in range(self.num_workers):
            actors.append(actor_cls.options(
                num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
                scheduling_strategy=strategy_cls(
                    placement_group=self._pg, placement_group_bundle_index=self._bundle_of(index),
                    placement_group_capture_child_tasks=False),
            ).remote())
        self.workers = actors  # so shutdown() finds them whatever happens next
        where = self._where(ray, actors)
        # Ranks of one node are contiguous, nodes in order of first appearance,
        # a node's ranks in the order of their GPUs (see visible_devices).
        node_order = list(dict.fromkeys(w["node_id"] for w in where))
        order = sorted(range(len(actors)), key=lambda i: (
            node_order.index(where[i]["node_id"]), _first_gpu(where[i]), i))
        self.workers = [actors[i] for i in order]
        where = [where[i] for i in order]
        self.pids = [w["pid"] for w in where]
        topos = topologies([w["node_id"] for w in where])
        self.placements = [RankPlacement(w["ip"], t) for w, t in zip(where, topos)]
        devices = visible_devices([w["node_id"] for w in where], [w["gpu_ids"] for w in where])

        nic = (self.settings.nics or [""])[0]
        if nic:
            addr = nic_addr
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
            if self.gpus_per_worker:
                env["CUDA_VISIBLE_DEVICES"] = devices[len(envs)]
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
                raise RankError(f"rank {rank} (host {host}) died: {_first_line(exc)}",
                                rank, host) from None
            except ray.exceptions.RayError as exc:  # Ray could not run or answer the call
                self._broken = f"rank {rank} failed in Ray"
                raise RankError(f"rank {rank} (host {host}) failed in Ray: "
                                f"{type(exc).__name__}: {_first_line(exc)}", rank, host) from None
            if not outcome["ok"]:
                raise self._rank_failed(rank, host, outcome)
            values[rank] = outcome["value"]
        return [values[rank] for rank in range(len(refs))]

    def _rank_failed(self, rank: int, host: str, outcome: Mapping[str, Any]) -> RankError:
        """The error of a rank whose call failed (the executor refuses calls until shutdown)."""
        if outcome["type"] == UNPICKLABLE:
            self._broken = f"rank {rank}'s result cannot be pickled"
            return RankError(f"rank {rank} (host {host}): {outcome['message']}", rank, host)
        self._broken = f"rank {rank} raised {outcome['type']}"
        return RankError(
            f"rank {rank} (host {host}) raised {outcome['type']}: {outcome['message']}\n"
            f"{outcome['traceback']}".rstrip(), rank, host, outcome["traceback"])

    def run(self, fn: Callable[..., Any], args: Optional[Sequence[Any]] = None,
            kwargs: Optional[Mapping[str, Any]] = None,
            callbacks: Optional[Sequence[Callable[[Any], Any]]] = None) -> List[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order.

        Args:
            callbacks: callables on the driver, each called with every value a rank
                passes to :func:`hvdlike.ray.ray_logger.log` while ``fn`` runs
                (``horovod.ray``'s meaning), in the order logged.

        Raises:
            RankError: a rank raised (with its traceback), its result cannot be
                pickled, or its actor died.
            HvdlikeError: a callback raised (after the ranks ended).
        """
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        with Callbacks("RayExecutor.run", callbacks) as logged:
            if self._elastic is not None:
                return self._elastic.run(functools.partial(_call_without_executable, fn, args,
                                                           kwargs), logged.queue)
            return self._check_all(self._call_all(
                lambda w: w.run.remote(fn, args, kwargs, logged.queue)))

    def execute(self, fn: Callable[[Any], Any],
                callbacks: Optional[Sequence[Callable[[Any], Any]]] = None) -> List[Any]:
        """``fn(executable)`` on every rank (the ``executable_cls`` object, or None).

        ``callbacks`` as in :meth:`run`.
        """
        with Callbacks("RayExecutor.execute", callbacks) as logged:
            if self._elastic is not None:
                return self._elastic.run(fn, logged.queue)
            return self._check_all(self._call_all(lambda w: w.execute.remote(fn, logged.queue)))

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
        """Kill every rank actor, release the placement group and the store.

        After ``ray.shutdown()`` the actors and the group went with the cluster:
        only the handles and the store remain to drop (calling Ray then would
        start a new local cluster).
        """
        import ray

        if self._elastic is not None:
            self._elastic.shutdown()
            return
        if not ray.is_initialized():
            self._forget()
            return
        for worker in self.workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # already dead
                pass
        if self._pg is not None and self._own_pg:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._pg)
            except Exception:  # the cluster is already gone
                pass
        self._forget()

    def _forget(self) -> None:
        """Drop the actor handles and the group, close the store: a fresh executor again."""
        self.workers = []
        self._pg = None
        self._own_pg = False
        if self._store is not None:
            self._store.__exit__(None, None, None)
            self._store = None
        self._broken = None


@dataclasses.dataclass
class ElasticRaySettings:
    """What :meth:`ElasticRayExecutor.create_settings` returns."""

    min_num_proc: int = 1
    max_num_proc: Optional[int] = None
    reset_limit: Optional[int] = None
    elastic_timeout: float = 600.0
    timeout_s: float = 30.0
    nics: Optional[Sequence[str]] = None
    cooldown_range: Optional[Sequence[float]] = None


class ElasticRayExecutor:
    """``horovod.ray.ElasticRayExecutor``'s API over the elastic :class:`RayExecutor`.

    Kept for code written against Horovod's older elastic class: the job
    bounds live in the settings (``create_settings(min_num_proc=, max_num_proc=)``)
    and ``run(worker_fn)`` calls ``worker_fn()`` with no argument on each rank.
    Hosts always come from Ray's alive nodes (``override_discovery=False``,
    a discovery of one's own, is not supported).

    Example:
        >>> settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=4)
        >>> executor = ElasticRayExecutor(settings, cpus_per_slot=1)
        >>> executor.start()
        >>> executor.run(train)        # train() uses hvd.elastic.run
        >>> executor.shutdown()
    """

    @staticmethod
    def create_settings(min_num_proc: int = 1, max_num_proc: Optional[int] = None,
                        reset_limit: Optional[int] = None, elastic_timeout: float = 600,
                        timeout_s: float = 30, ssh_identity_file: Optional[str] = None,
                        nics: Optional[Sequence[str]] = None, min_np: Optional[int] = None,
                        max_np: Optional[int] = None,
                        cooldown_range: Optional[Sequence[float]] = None,
                        **kwargs: Any) -> ElasticRaySettings:
        """Settings of an elastic job (``min_np``/``max_np`` are the old names).

        ``ssh_identity_file`` and Horovod's other settings (``verbose``...) are
        accepted and unused: ranks are Ray actors.
        """
        min_num_proc = min_np if min_np is not None else min_num_proc
        max_num_proc = max_np if max_np is not None else max_num_proc
        where = "ElasticRayExecutor.create_settings"
        check_params(min_num_proc, max_num_proc, reset_limit, cooldown_range, elastic_timeout)
        return ElasticRaySettings(min_num_proc, max_num_proc, reset_limit,
                                  float(elastic_timeout), checks.seconds(where, "timeout_s",
                                                                         timeout_s),
                                  checks.nic_list(where, nics),
                                  checks.cooldown(where, cooldown_range))

    def __init__(self, settings: ElasticRaySettings, use_gpu: bool = False,
                 cpus_per_slot: float = 1, gpus_per_slot: Optional[float] = None,
                 env_vars: Optional[Mapping[str, Any]] = None, override_discovery: bool = True):
        if not override_discovery:
            raise checks.ConfigError("ElasticRayExecutor: override_discovery=False is not "
                                     "supported; hosts are Ray's alive nodes")
        self.settings = settings
        self.env_vars = checks.env_strings("ElasticRayExecutor", env_vars)
        self._executor = RayExecutor(
            RaySettings(settings.timeout_s, nics=settings.nics), cpus_per_worker=cpus_per_slot,
            use_gpu=use_gpu, gpus_per_worker=gpus_per_slot, min_workers=settings.min_num_proc,
            max_workers=settings.max_num_proc, reset_limit=settings.reset_limit,
            cooldown_range=settings.cooldown_range, elastic_timeout=settings.elastic_timeout)

    def start(self, executable_cls: Optional[type] = None,
              executable_args: Optional[Sequence[Any]] = None,
              executable_kwargs: Optional[Mapping[str, Any]] = None,
              extra_env_vars: Optional[Mapping[str, Any]] = None) -> None:
        """Wait until ``min_num_proc`` slots exist (see :meth:`RayExecutor.start`)."""
        self._executor.start(executable_cls, executable_args, executable_kwargs,
                             {**self.env_vars, **(extra_env_vars or {})})

    def run(self, worker_fn: Callable[[], Any],
            callbacks: Optional[Sequence[Callable[[Any], Any]]] = None) -> List[Any]:
        """``worker_fn()`` on every rank, elastically; the last generation's values."""
        return self._executor.run(worker_fn, callbacks=callbacks)

    def execute(self, fn: Callable[[Any], Any],
                callbacks: Optional[Sequence[Callable[[Any], Any]]] = None) -> List[Any]:
        """``fn(executable)`` on every rank, elastically."""
        return self._executor.execute(fn, callbacks=callbacks)

    def shutdown(self) -> None:
        """Stop whatever rank actor remains."""
        self._executor.shutdown()
