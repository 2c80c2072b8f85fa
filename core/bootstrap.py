"""Find out who we are and where the rendezvous store is.

A rank learns its place in the job from the environment of whatever started
it. Detectors are tried in order; the first that recognises its launcher wins:

* ``hvdlike-run`` sets the ``HVDLIKE_*`` variables named below;
* ``torchrun`` sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``...;
* ``mpirun``/``srun`` (see :mod:`hvdlike.core.mpi_bootstrap`);
* nothing: a single process job of size 1.

The contract with the launcher is the set of ``ENV_*`` constants; the launcher
imports them from here rather than spelling them again.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
from typing import Callable, List, Mapping, Optional

from .errors import ConfigError, HvdlikeInternalError

ENV_RANK = "HVDLIKE_RANK"
ENV_SIZE = "HVDLIKE_SIZE"
ENV_LOCAL_RANK = "HVDLIKE_LOCAL_RANK"
ENV_LOCAL_SIZE = "HVDLIKE_LOCAL_SIZE"
ENV_CROSS_RANK = "HVDLIKE_CROSS_RANK"
ENV_CROSS_SIZE = "HVDLIKE_CROSS_SIZE"
ENV_HOSTNAME = "HVDLIKE_HOSTNAME"
ENV_STORE_ADDR = "HVDLIKE_STORE_ADDR"
ENV_STORE_PORT = "HVDLIKE_STORE_PORT"
# Unguessable per-job secret: prefix of every store key and HMAC key of
# ``hvdlike.run`` payloads. Passed in the environment, never on a command line.
ENV_JOB_SECRET = "HVDLIKE_JOB_SECRET"
# Optional: the network interface (or local address) Gloo binds to.
ENV_GLOO_IFACE = "HVDLIKE_GLOO_IFACE"
ENV_LAUNCHER = "HVDLIKE_LAUNCHER"


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where this process sits in the job (Horovod's definitions).

    ``local_*`` count ranks on this host; ``cross_rank`` is the index of this
    host among hosts that have a rank with the same ``local_rank``, and
    ``cross_size`` is the number of such hosts.
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    hostname: str = ""


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """How to reach the job's store.

    ``host_store`` means this process must create the store itself (rank 0 of a
    job whose launcher does not host one). ``addr`` empty and size 1 means an
    in-process store.
    """

    launcher: str
    addr: str = ""
    port: int = 0
    secret: str = ""
    host_store: bool = False
    gloo_iface: str = ""


def _int(environ: Mapping[str, str], name: str) -> int:
    text = environ.get(name)
    if text is None:
        raise ConfigError(f"{name} is not set; it is required when launched this way")
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not valid: expected an integer") from None


def _check(topo: Topology, source: str) -> Topology:
    if topo.size < 1:
        raise ConfigError(f"{source}: job size {topo.size} must be >= 1")
    if not 0 <= topo.rank < topo.size:
        raise ConfigError(f"{source}: rank {topo.rank} is outside 0..{topo.size - 1}")
    if not 0 <= topo.local_rank < topo.local_size:
        raise ConfigError(
            f"{source}: local rank {topo.local_rank} is outside 0..{topo.local_size - 1}"
        )
    return topo


def from_hvdlike_run(environ: Mapping[str, str]):
    if ENV_RANK not in environ:
        return None
    size = _int(environ, ENV_SIZE)
    local_size = int(environ.get(ENV_LOCAL_SIZE, size))
    topo = _check(
        Topology(
            rank=_int(environ, ENV_RANK),
            size=size,
            local_rank=int(environ.get(ENV_LOCAL_RANK, environ[ENV_RANK])),
            local_size=local_size,
            cross_rank=int(environ.get(ENV_CROSS_RANK, 0)),
            cross_size=int(environ.get(ENV_CROSS_SIZE, 1)),
            hostname=environ.get(ENV_HOSTNAME, socket.gethostname()),
        ),
        "hvdlike-run environment",
    )
    if size > 1 and ENV_STORE_ADDR not in environ:
        raise ConfigError(f"{ENV_RANK} is set but {ENV_STORE_ADDR} is not")
    rdzv = Rendezvous(
        launcher=environ.get(ENV_LAUNCHER, "hvdlike-run"),
        addr=environ.get(ENV_STORE_ADDR, ""),
        port=int(environ.get(ENV_STORE_PORT, "0")),
        secret=environ.get(ENV_JOB_SECRET, ""),
        gloo_iface=environ.get(ENV_GLOO_IFACE, ""),
    )
    return topo, rdzv


def from_torchrun(environ: Mapping[str, str]):
    if "TORCHELASTIC_RUN_ID" not in environ and not (
        "RANK" in environ and "WORLD_SIZE" in environ and "MASTER_ADDR" in environ
    ):
        return None
    size = _int(environ, "WORLD_SIZE")
    local_size = int(environ.get("LOCAL_WORLD_SIZE", size))
    nodes = max(1, size // max(1, local_size))
    topo = _check(
        Topology(
            rank=_int(environ, "RANK"),
            size=size,
            local_rank=int(environ.get("LOCAL_RANK", 0)),
            local_size=local_size,
            cross_rank=int(environ.get("GROUP_RANK", _int(environ, "RANK") // max(1, local_size))),
            cross_size=nodes,
            hostname=socket.gethostname(),
        ),
        "torchrun environment",
    )
    run_id = environ.get("TORCHELASTIC_RUN_ID", "none")
    restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rdzv = Rendezvous(
        launcher="torchrun",
        addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        port=_int(environ, "MASTER_PORT"),
        secret=f"torchrun-{run_id}-{restart}",
        gloo_iface=environ.get(ENV_GLOO_IFACE, ""),
    )
    return topo, rdzv


def single_process(environ: Mapping[str, str]):
    return Topology(hostname=socket.gethostname()), Rendezvous(launcher="none")


def _mpi_or_slurm(environ: Mapping[str, str]):
    from . import mpi_bootstrap  # only touches mpi4py when an MPI/Slurm job is detected

    return mpi_bootstrap.detect(environ)


DETECTORS: List[Callable[[Mapping[str, str]], Optional[tuple]]] = [
    from_hvdlike_run,
    from_torchrun,
    _mpi_or_slurm,
    single_process,
]


def detect(environ: Optional[Mapping[str, str]] = None):
    """Return ``(Topology, Rendezvous)`` for this process."""
    environ = os.environ if environ is None else environ
    for detector in DETECTORS:
        found = detector(environ)
        if found is not None:
            return found
    raise AssertionError("single_process always detects")  # pragma: no cover


def local_address_towards(addr: str, port: int) -> str:
    """The local IP this host uses to reach ``addr`` (no packet is sent)."""
    try:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((addr, port or 9))
            return probe.getsockname()[0]
    except OSError:
        return ""


# The store server this process hosts, by (addr, port): further connect_store()
# calls of the hosting rank join it as clients instead of binding the port again.
# Held strongly (wrappers such as PrefixStore keep only the C++ object alive);
# hosting a new one releases the previous, so re-inits never pile servers up.
_hosted: dict = {}


def release_hosted_store() -> None:
    """Drop the store server this process hosts (call once its runtime has shut down)."""
    _hosted.clear()


def connect_store(topo: Topology, rdzv: Rendezvous, timeout_seconds: float):
    """Connect to (or host) the job's store; return it wrapped in the job prefix.

    May be called several times per process (one connection per user); only the
    first call of the hosting rank creates the server.
    """
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_seconds)
    if topo.size == 1 and not rdzv.addr:
        return dist.HashStore()
    host = rdzv.host_store and topo.rank == 0 and (rdzv.addr, rdzv.port) not in _hosted
    try:
        store = dist.TCPStore(
            rdzv.addr,
            rdzv.port,
            topo.size,
            host,
            timeout=timeout,
            wait_for_workers=False,
        )
        if host:
            _hosted.clear()
            _hosted[(rdzv.addr, rdzv.port)] = store
    except Exception as exc:  # torch raises RuntimeError/DistStoreError/TimeoutError
        raise HvdlikeInternalError(
            f"rank {topo.rank} could not reach the rendezvous store at "
            f"{rdzv.addr}:{rdzv.port} within {timeout_seconds:g}s ({rdzv.launcher}): {exc}"
        ) from None
    return dist.PrefixStore(f"hvdlike/{rdzv.secret}/", store)
