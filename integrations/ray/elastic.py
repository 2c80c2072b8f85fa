"""Elastic hvdlike on Ray: ``RayExecutor(settings, min_workers=, max_workers=)``.

The same elastic core as ``hvdlike-run --min-np``: the launcher's
:class:`~hvdlike.launcher.elastic.driver.ElasticDriver` (host table and
blacklist, rank assignment, generations published through the job's store,
``reset_limit``, ``elastic_timeout``) with two Ray-specific parts:

* :class:`RayHostDiscovery` finds hosts in Ray's cluster state: every alive
  node is a host, with ``floor(CPU / cpus_per_worker)`` slots (and no more than
  ``floor(GPU / gpus_per_worker)`` with ``use_gpu``). A node is named
  ``<address>/<node id prefix>`` so two Ray nodes on one machine stay apart.
* each rank is a Ray actor pinned to its node (a hard node-affinity
  scheduling strategy), started for one generation and kept for as long as it
  survives (:class:`RayRank`, the driver's view of it).

Ranks call ``hvd.elastic.run`` as under ``hvdlike-run``: a lost actor makes its
peers' collectives fail, they restore the last commit and meet again in the
next generation without it; a new node with free slots makes the driver grow
the job (up to ``max_workers``) at the next commit. A rank left out of a
generation returns without a value; :meth:`ElasticRayJob.run` returns the
values of the last generation's ranks, in rank order.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from hvdlike.core.bootstrap import ENV_LAUNCHER
from hvdlike.core.config import KNOBS_BY_FIELD
from hvdlike.core.errors import HvdlikeError
from hvdlike.launcher import env as rank_env
from hvdlike.launcher.api import RankError
from hvdlike.launcher.elastic.discovery import LastGood
from hvdlike.launcher.elastic.driver import ElasticDriver
from hvdlike.launcher.elastic.settings import ElasticSettings, validate
from hvdlike.launcher.errors import LaunchError
from hvdlike.launcher.hosts import HostSlots, RankPlacement
from hvdlike.launcher.monitor import Output, WorkerState
from hvdlike.launcher.rendezvous import StoreServer, new_secret

from . import checks
from .worker import UNPICKLABLE, Worker

NODE_ID_CHARS = 12  # of Ray's node id, in a host's name


def host_label(node: Mapping[str, Any]) -> str:
    """The host name the elastic driver uses for one Ray node."""
    return f"{node.get('NodeManagerAddress', '?')}/{str(node['NodeID'])[:NODE_ID_CHARS]}"


class RayHostDiscovery:
    """Hosts and slots from Ray's alive nodes (the driver polls :meth:`find`).

    Args:
        cpus_per_worker: CPUs one rank needs.
        gpus_per_worker: GPUs one rank needs (0: none).
        nodes: returns ``ray.nodes()``-shaped records (a seam for tests).
        first_node: node id listed first when alive (the driver's own), so rank 0
            starts there.
    """

    def __init__(self, cpus_per_worker: float, gpus_per_worker: float = 0,
                 nodes: Optional[Callable[[], List[Mapping[str, Any]]]] = None,
                 first_node: str = ""):
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker
        self._nodes = nodes
        self.first_node = first_node
        self.node_ids: Dict[str, str] = {}  # host label -> Ray node id

    def slots_of(self, resources: Mapping[str, float]) -> int:
        slots = math.floor(resources.get("CPU", 0) / self.cpus_per_worker + 1e-9)
        if self.gpus_per_worker:
            slots = min(slots, math.floor(resources.get("GPU", 0) / self.gpus_per_worker + 1e-9))
        return max(int(slots), 0)

    def find(self) -> List[HostSlots]:
        """Every alive node with at least one slot, the driver's node first."""
        if self._nodes is not None:
            nodes = self._nodes()
        else:
            import ray

            nodes = ray.nodes()
        alive = [n for n in nodes if n.get("Alive")]
        alive.sort(key=lambda n: (n["NodeID"] != self.first_node, str(n["NodeID"])))
        hosts = []
        for node in alive:
            slots = self.slots_of(node.get("Resources") or {})
            if slots < 1:
                continue
            label = host_label(node)
            self.node_ids[label] = node["NodeID"]
            hosts.append(HostSlots(label, slots))
        return hosts


@dataclasses.dataclass
class ElasticParams:
    """The elastic arguments of :class:`~hvdlike.ray.RayExecutor` (``horovod.ray``'s names)."""

    min_workers: int
    max_workers: Optional[int] = None
    reset_limit: Optional[int] = None
    cooldown_range: Optional[Tuple[float, float]] = None
    elastic_timeout: float = 600.0
    discovery_interval: float = 1.0

    def settings(self, available_slots: int) -> ElasticSettings:
        """The driver's settings; start with as many ranks as fit, within the bounds.

        Raises:
            ValueError: the values disagree (naming the argument).
        """
        max_np = self.max_workers if self.max_workers is not None else sys.maxsize
        np = max(self.min_workers, min(max_np, available_slots))
        settings = ElasticSettings(
            min_np=self.min_workers, max_np=max_np, np=np, reset_limit=self.reset_limit,
            elastic_timeout=float(self.elastic_timeout),
            cooldown_range=tuple(self.cooldown_range) if self.cooldown_range else None,
            discovery_interval=self.discovery_interval)
        try:
            return validate(settings)
        except LaunchError as exc:  # the launcher's flag names -> this API's names
            raise checks.ConfigError(f"RayExecutor: {checks.flag_names(str(exc))}") from None


def check_params(min_workers, max_workers, reset_limit, cooldown_range,
                 elastic_timeout) -> Optional[Tuple[float, float]]:
    """Refuse bad elastic arguments before anything starts; the checked ``cooldown_range``.

    Raises:
        ValueError: (a ``ConfigError``) naming the argument and its value.
    """
    where = "RayExecutor"
    checks.count(where, "min_workers", min_workers)
    if max_workers is not None and checks.count(where, "max_workers", max_workers) < min_workers:
        raise checks.ConfigError(f"RayExecutor: max_workers={max_workers!r} must be an "
                                 f"integer >= min_workers ({min_workers})")
    if reset_limit is not None:
        checks.count(where, "reset_limit", reset_limit, minimum=0)
    cooldown_range = checks.cooldown(where, cooldown_range)
    elastic_timeout = checks.seconds(where, "elastic_timeout", elastic_timeout)
    ElasticParams(min_workers, max_workers, reset_limit, cooldown_range,
                  elastic_timeout).settings(min_workers)
    return cooldown_range


class _Notes(Output):
    """The driver's messages, under this API's name."""

    def note(self, text: str) -> None:
        with self._lock:
            self._streams["stderr"].write(f"hvdlike.ray: {checks.flag_names(text)}\n")
            self._streams["stderr"].flush()


class RayRank:
    """The driver's handle on one rank actor (what the elastic driver needs of a process)."""

    remote = True

    def __init__(self, placement: RankPlacement, actor: Any, ref: Any = None):
        self.placement = placement
        self.actor = actor
        self.ref = ref
        self.submitted = threading.Event()  # set once ``ref`` (the run's call) exists
        if ref is not None:
            self.submitted.set()
        self.gpu_ids: List[str] = []
        self.state = WorkerState.RUNNING
        self.exit_code: Optional[int] = None
        self.exit_reason: Optional[str] = None
        self.stop_requested_at: Optional[float] = None
        self.outcome: Optional[dict] = None
        self.pid: Optional[int] = None

    @property
    def rank(self) -> int:
        return self.placement.rank

    @property
    def unpicklable(self) -> bool:
        """Whether the rank ended with a result that cannot be pickled (a job error)."""
        return bool(self.outcome) and self.outcome.get("type") == UNPICKLABLE

    def submit(self, ref: Any) -> None:
        """The run's call on this actor has been submitted: :meth:`wait` may wait for it."""
        self.ref = ref
        self.submitted.set()

    @property
    def host(self) -> str:
        return self.placement.host

    def wait(self) -> int:
        """Block until the rank's function ends; 0 when it returned (or left the job)."""
        import ray

        self.submitted.wait()
        if self.ref is None:  # never submitted: the generation's start failed
            self.exit_reason = "could not be started"
            self.exit_code = 1
            return 1
        try:
            self.outcome = ray.get(self.ref)
        except ray.exceptions.RayActorError as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            self.exit_reason = f"lost its Ray actor ({type(exc).__name__}: {first[:200]})"
            self.exit_code = 1
            return 1
        except Exception as exc:  # noqa: BLE001 - any other Ray failure loses the rank
            self.exit_reason = f"failed in Ray: {type(exc).__name__}: {exc}"
            self.exit_code = 1
            return 1
        self.kill()  # its function has ended: a rank actor serves one run only
        if self.outcome["ok"]:
            self.exit_code = 0
            return 0
        self.exit_reason = f"raised {self.outcome['type']}: {self.outcome['message']}"
        self.exit_code = 1
        return 1

    def request_stop(self) -> None:
        if self.stop_requested_at is None:
            self.stop_requested_at = time.monotonic()
        self.kill()

    def kill(self) -> None:
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


class _RayElasticDriver(ElasticDriver):
    """The launcher's elastic driver, starting Ray actors instead of processes.

    A generation's new actors are created first and given their function only
    once all exist (:meth:`ElasticRayJob.submit_pending`), so each knows the
    GPUs of its node's other new ranks. A rank whose result cannot be pickled
    fails the job at once: that is the function's doing, not a lost node to
    blacklist and re-form without.
    """

    def _publish(self, members, removed_only: bool) -> None:
        try:
            super()._publish(members, removed_only)
        finally:
            self.job.submit_pending()

    def _exited(self, worker_id: str, code: int) -> None:
        rank = self.live.get(worker_id)
        if code != 0 and isinstance(rank, RayRank) and rank.unpicklable:
            del self.live[worker_id]
            rank.state = WorkerState.FAILED
            self._fail(f"rank {rank.rank} (host {rank.host}): {rank.outcome['message']}")
            return
        super()._exited(worker_id, code)

    def _start(self, worker_id: str, placement: RankPlacement, number: int) -> RayRank:
        rank = self.job.spawn(worker_id, placement, self.worker_env(worker_id, number))
        self.workers[worker_id] = rank
        self.live[worker_id] = rank

        def wait() -> None:
            self._events.put(("exit", worker_id, rank.wait()))

        threading.Thread(target=wait, daemon=True, name=f"hvdlike.ray wait {worker_id}").start()
        return rank


@dataclasses.dataclass
class _Config:
    grace_seconds: float = 10.0
    output_dir: Optional[str] = None


class ElasticRayJob:
    """One elastic executor's state: what :class:`~hvdlike.ray.RayExecutor` delegates to.

    Args:
        params: the elastic arguments.
        timeout_s: start and collective timeout of each generation.
        nic: network interface for the store and Gloo ("" chooses per route).
        cpus_per_worker: CPUs per rank actor.
        gpus_per_worker: GPUs per rank actor (0: none).
        output: where driver messages go (stderr by default).
        start_wait_s: how long new rank actors may take to come up before their
            GPU ids are read (``timeout_s`` by default); actor processes start
            slowly on a busy node, as in a fixed job's start.
    """

    def __init__(self, params: ElasticParams, timeout_s: float, nic: str,
                 cpus_per_worker: float, gpus_per_worker: float, output: Optional[Output] = None,
                 start_wait_s: Optional[float] = None):
        self.params = params
        self.timeout_s = timeout_s
        self.start_wait_s = timeout_s if start_wait_s is None else start_wait_s
        self.nic = nic
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker
        self.output = output or _Notes()
        self.config = _Config()
        self.store: Optional[StoreServer] = None
        self.addr = ""
        self.discovery: Optional[RayHostDiscovery] = None
        self.extra_env: Dict[str, str] = {}
        self.executable: Tuple[Optional[type], tuple, dict] = (None, (), {})
        self.ranks: Dict[str, RayRank] = {}  # every actor of the current run, by worker id
        self.driver: Optional[_RayElasticDriver] = None
        self.last_result = None
        self._fn: Optional[Callable[[Any], Any]] = None
        self._queue: Any = None  # the run's callbacks queue (None: no callbacks)
        self._pending: List[Tuple[RayRank, Dict[str, str]]] = []  # created, not yet submitted

    @property
    def started(self) -> bool:
        """Whether :meth:`start` succeeded and :meth:`shutdown` has not been called since."""
        return self.discovery is not None

    # -- start ---------------------------------------------------------------------

    def start(self, executable_cls, executable_args, executable_kwargs, extra_env) -> None:
        """Check the cluster has ``min_workers`` slots (waiting up to ``elastic_timeout``).

        ``extra_env`` is already strings (the executor converts it).
        """
        import ray

        if self.nic:  # the store listens here: a missing interface is known now
            checks.nic_address("RayExecutor.start", self.nic)
        self.executable = (executable_cls, tuple(executable_args or ()),
                           dict(executable_kwargs or {}))
        self.extra_env = dict(extra_env or {})
        here = ray.get_runtime_context().get_node_id()
        self.discovery = RayHostDiscovery(self.cpus_per_worker, self.gpus_per_worker,
                                          first_node=here)
        deadline = time.monotonic() + self.params.elastic_timeout
        while True:
            hosts = self.discovery.find()
            if sum(h.slots for h in hosts) >= self.params.min_workers:
                break
            if time.monotonic() > deadline:
                raise HvdlikeError(
                    f"RayExecutor.start: the Ray cluster has "
                    f"{sum(h.slots for h in hosts)} slot(s) of {self.cpus_per_worker:g} CPU"
                    + (f" and {self.gpus_per_worker:g} GPU" if self.gpus_per_worker else "")
                    + f", fewer than min_workers={self.params.min_workers}, after "
                    f"elastic_timeout={self.params.elastic_timeout:g}s")
            time.sleep(self.params.discovery_interval)
        self.addr = self._store_address(ray)

    def _store_address(self, ray) -> str:
        if self.nic:
            return checks.nic_address("RayExecutor.start", self.nic)
        here = ray.util.get_node_ip_address()
        if all(n.get("NodeManagerAddress") == here for n in ray.nodes() if n.get("Alive")):
            return "127.0.0.1"  # every node on this machine
        return here

    # -- one run -------------------------------------------------------------------

    def spawn(self, worker_id: str, placement: RankPlacement, elastic_env: Mapping[str, str]):
        """Start one rank actor on its node; :meth:`submit_pending` gives it the function."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = self.discovery.node_ids[placement.host]
        actor = ray.remote(Worker).options(
            num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote()
        timeout = repr(float(self.timeout_s))
        knobs = {KNOBS_BY_FIELD["start_timeout"].env: timeout,
                 KNOBS_BY_FIELD["gloo_timeout_seconds"].env: timeout, **self.extra_env}
        env = rank_env.rank_environment(dict(self.extra_env), placement, self.addr,
                                        self.store.port, self.store.secret, self.nic, knobs)
        env[ENV_LAUNCHER] = "ray"
        env.update(elastic_env)
        rank = RayRank(placement, actor)
        self.ranks[worker_id] = rank
        self._pending.append((rank, env))
        return rank

    def submit_pending(self) -> None:
        """Give the actors created for a generation their function, GPUs settled first.

        With GPUs, each new rank sees the union of the GPUs of its node's live
        ranks (``CUDA_VISIBLE_DEVICES``), as in a fixed job.
        """
        import ray

        pending, self._pending = self._pending, []
        if not pending:
            return
        try:
            if self.gpus_per_worker:
                self._settle_gpus(ray, pending)
            cls, args, kwargs = self.executable
            for rank, env in pending:
                rank.submit(rank.actor.run_elastic.remote(env, self._fn, cls, args, kwargs,
                                                          self._queue))
        finally:
            for rank, _ in pending:
                rank.submitted.set()  # a rank not submitted reports that it could not start

    def _settle_gpus(self, ray, pending) -> None:
        from .executor import visible_devices

        try:
            found = ray.get([rank.actor.where.remote() for rank, _ in pending],
                            timeout=self.start_wait_s)
        except Exception as exc:  # noqa: BLE001 - such a rank fails when it runs
            self.output.note(f"could not read the new ranks' GPU ids: {type(exc).__name__}")
            return
        for (rank, _), where in zip(pending, found):
            rank.gpu_ids = list(where["gpu_ids"])
        live = [r for r in self.ranks.values() if r.gpu_ids and r.exit_code is None]
        devices = dict(zip(map(id, live), visible_devices([r.host for r in live],
                                                          [r.gpu_ids for r in live])))
        for rank, env in pending:
            if id(rank) in devices:
                env["CUDA_VISIBLE_DEVICES"] = devices[id(rank)]

    def run(self, fn: Callable[[Any], Any], queue: Any = None) -> List[Any]:
        """Run ``fn(executable)`` elastically; the last generation's values in rank order.

        ``queue``: where ``ray_logger.log`` on the ranks sends values (the callbacks').

        Raises:
            RankError: the job failed (every lost rank listed, with the first
                traceback of a rank that raised).
            HvdlikeError: not started.
        """
        if self.discovery is None:
            raise HvdlikeError("RayExecutor: not started; call start() first")
        discovery = LastGood(self.discovery, warn=self.output.note)
        hosts = discovery.find()
        settings = self.params.settings(sum(h.slots for h in hosts))
        self._fn, self._queue = fn, queue
        self.ranks = {}
        self.store = StoreServer(self.addr, settings.np, new_secret(), self.timeout_s).__enter__()
        try:
            self.driver = _RayElasticDriver(self, settings, discovery)
            result = self.driver.run()
        finally:
            for rank in self.ranks.values():
                rank.kill()
            self.store.__exit__(None, None, None)
            self._fn = self._queue = None
        self.last_result = result
        try:
            if result.exit_code != 0:
                raise self._failure(result)
            return self._values()
        finally:
            self.ranks = {}  # every actor of this run is gone; keep no handles

    def _values(self) -> List[Any]:
        values = []
        for member in self.driver.members:
            rank = self.ranks[member.worker]
            if rank.outcome and rank.outcome.get("ok") and not rank.outcome.get("left"):
                values.append(rank.outcome["value"])
        return values

    def _failure(self, result) -> HvdlikeError:
        if result.interrupted:
            return HvdlikeError(f"RayExecutor: interrupted ({result.interrupted}); "
                                "every rank was stopped")
        unpicklable = [r for r in self.ranks.values() if r.unpicklable]
        if unpicklable:
            first = unpicklable[0]
            return RankError(f"RayExecutor: rank {first.rank} (host {first.host}): "
                             f"{first.outcome['message']}", first.rank, first.host)
        raised = [r for r in self.ranks.values()
                  if r.outcome is not None and not r.outcome.get("ok")]
        text = f"RayExecutor: elastic job failed: {checks.flag_names(result.summary())}"
        if raised:
            first = raised[0]
            return RankError(f"{text}\nrank {first.rank} (host {first.host}) traceback:\n"
                             f"{first.outcome['traceback']}".rstrip(), first.rank, first.host,
                             first.outcome["traceback"])
        lost = result.lost[0] if result.lost else None
        return RankError(text, lost.rank if lost else -1, lost.host if lost else "?")

    def shutdown(self) -> None:
        """Kill what actor remains; after ``ray.shutdown()`` only drop the handles
        (calling Ray then would start a new local cluster)."""
        import ray

        if ray.is_initialized():
            for rank in self.ranks.values():
                rank.kill()
        self.ranks = {}
        self.discovery = None
