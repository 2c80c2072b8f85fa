"""Where a rank sits in the job, and the launcher variables that say so.

One module owns the contract between launchers and ranks: the ``HVDLIKE_*``
variables ``hvdlike-run`` (and ``hvdlike.run``, and the test harness) export,
the :class:`Topology` of a rank (Horovod's rank/local/cross definitions), the
:class:`Rendezvous` facts that say where the job's store is, and how
topologies follow from the host each rank runs on. Bootstrap detectors
(:mod:`.bootstrap`, :mod:`.mpi_bootstrap`), the launcher and ``hvdlike.run``
all import these names from here.
"""

from __future__ import annotations

import dataclasses
import socket
from typing import Dict, List, Sequence

from .errors import ConfigError

ENV_RANK = "HVDLIKE_RANK"
ENV_SIZE = "HVDLIKE_SIZE"
ENV_LOCAL_RANK = "HVDLIKE_LOCAL_RANK"
ENV_LOCAL_SIZE = "HVDLIKE_LOCAL_SIZE"
ENV_CROSS_RANK = "HVDLIKE_CROSS_RANK"
ENV_CROSS_SIZE = "HVDLIKE_CROSS_SIZE"
ENV_HOSTNAME = "HVDLIKE_HOSTNAME"
ENV_STORE_ADDR = "HVDLIKE_STORE_ADDR"
ENV_STORE_PORT = "HVDLIKE_STORE_PORT"
# The per-job secret. It keys the derivation of store key prefixes and the MAC
# of every store value (see store_auth); it is never written to the store, a
# command line or a file. Users may provide their own under torchrun or Slurm.
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


def checked(topo: Topology, source: str) -> Topology:
    """``topo`` if its numbers are consistent, else a ConfigError naming ``source``.

    Launcher variables are read, not trusted: a rank outside the job, or a
    local rank outside its host, would otherwise wait for peers that never come.
    """
    if topo.size < 1:
        raise ConfigError(f"{source}: job size {topo.size} must be >= 1")
    if not 0 <= topo.rank < topo.size:
        raise ConfigError(f"{source}: rank {topo.rank} is outside 0..{topo.size - 1}")
    if not 1 <= topo.local_size <= topo.size:
        raise ConfigError(f"{source}: {topo.local_size} rank(s) on this host is outside "
                          f"1..{topo.size} (the job size)")
    if not 0 <= topo.local_rank < topo.local_size:
        raise ConfigError(
            f"{source}: local rank {topo.local_rank} is outside 0..{topo.local_size - 1}"
        )
    return topo


# What ``horovodrun`` exports to every rank: scripts written for Horovod read
# these from ``os.environ`` (before and after ``init()``). Topology field -> name.
HOROVOD_VARIABLES = {
    "rank": "HOROVOD_RANK",
    "size": "HOROVOD_SIZE",
    "local_rank": "HOROVOD_LOCAL_RANK",
    "local_size": "HOROVOD_LOCAL_SIZE",
    "cross_rank": "HOROVOD_CROSS_RANK",
    "cross_size": "HOROVOD_CROSS_SIZE",
    "hostname": "HOROVOD_HOSTNAME",
}


def horovod_variables(topology: Topology) -> Dict[str, str]:
    """``HOROVOD_RANK``, ... ``HOROVOD_HOSTNAME`` describing ``topology``."""
    return {name: str(getattr(topology, field)) for field, name in HOROVOD_VARIABLES.items()}


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """How to reach the job's store.

    ``host_store`` means this process must create the store itself (rank 0 of a
    job whose launcher does not host one). ``addr`` empty and size 1 means an
    in-process store. ``authenticated`` is False only when no secret could be
    shared (a multi-host torchrun or srun job without ``HVDLIKE_JOB_SECRET``):
    the secret is then public and the store is merely namespaced.
    """

    launcher: str
    addr: str = ""
    port: int = 0
    secret: str = ""
    host_store: bool = False
    gloo_iface: str = ""
    authenticated: bool = True
    secret_file_tag: str = ""  # rank 0 of a torchrun/srun job shared the secret in a file
    # init(comm=...) under mpirun: the members' communicator, which the
    # runtime's MPI planes are built from instead of COMM_WORLD.
    mpi_comm: object = dataclasses.field(default=None, compare=False)

    def __repr__(self) -> str:  # never print the secret
        return (f"Rendezvous(launcher={self.launcher!r}, addr={self.addr!r}, port={self.port}, "
                f"host_store={self.host_store}, authenticated={self.authenticated})")


def topologies(host_of_rank: Sequence[str]) -> List[Topology]:
    """Horovod's topology of every rank, given the host each rank runs on.

    ``local_rank`` is the index of a rank among the ranks of its host;
    ``cross_rank`` is the index of its host among the hosts that have a rank with
    the same ``local_rank`` (hosts ordered by first appearance), and
    ``cross_size`` the number of such hosts.

    Args:
        host_of_rank: host name of rank 0, 1, ... in rank order.

    Returns:
        One :class:`Topology` per rank, in rank order.

    Example:
        >>> [t.cross_rank for t in topologies(["a", "a", "b"])]
        [0, 0, 1]
    """
    ranks_on: Dict[str, List[int]] = {}
    for rank, host in enumerate(host_of_rank):
        ranks_on.setdefault(host, []).append(rank)
    hosts = list(ranks_on)
    result = []
    for rank, host in enumerate(host_of_rank):
        local_rank = ranks_on[host].index(rank)
        peers = [h for h in hosts if len(ranks_on[h]) > local_rank]
        result.append(
            Topology(
                rank=rank,
                size=len(host_of_rank),
                local_rank=local_rank,
                local_size=len(ranks_on[host]),
                cross_rank=peers.index(host),
                cross_size=len(peers),
                hostname=host,
            )
        )
    return result


def local_address_towards(addr: str, port: int) -> str:
    """The local IP this host uses to reach ``addr`` (no packet is sent)."""
    try:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((addr, port or 9))
            return probe.getsockname()[0]
    except OSError:
        return ""
