"""Bootstrap for ranks started by ``mpirun`` (Open MPI, MPICH) or Slurm ``srun``.

Those launchers tell each process its rank and size, but host no rendezvous
store. Rank 0 hosts one (``Rendezvous.host_store``) on a free port; every rank
learns its address and a fresh job secret through ``mpi4py`` (imported only when
such a job is detected); the store listens on that address only. Under ``srun`` without MPI, the first node of the step
hosts the store on a port derived from the job and step ids (or
``MASTER_ADDR``/``MASTER_PORT`` when set).

``detect`` returns None when the environment shows neither launcher; the
``HVDLIKE_*`` variables of ``hvdlike-run`` are checked before this module runs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import random
import re
import socket
import sys
from typing import List, Mapping, Optional, Sequence, Tuple

from .errors import ConfigError
from .job_secret import new_secret
from .topology import (  # noqa: F401 - topologies re-exported for older imports
    ENV_GLOO_IFACE, Rendezvous, Topology, checked, local_address_towards, topologies,
)


# (name, rank variable, size variable) of each MPI, in detection order. Local and
# cross ranks are computed from host names so every flavour agrees with Horovod.
MPI_FLAVOURS = (
    ("mpirun (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("mpirun (MPICH)", "PMI_RANK", "PMI_SIZE"),
)


def _int(environ: Mapping[str, str], name: str) -> int:
    text = environ.get(name, "")
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not valid: expected an integer") from None


def _ephemeral_range() -> Tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            low, high = (int(x) for x in handle.read().split())
            return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _free_port(addr: str) -> int:
    """A port free on ``addr``, below the ephemeral range.

    Other ranks start connecting before rank 0 listens; a client retrying a
    loopback port inside the ephemeral range can end up connected to itself
    (TCP self-connect), which then steals the port from the store.
    """
    low, _ = _ephemeral_range()
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    candidates = list(range(max(1024, low - 12000), low))
    random.shuffle(candidates)
    for port in candidates[:200]:
        with socket.socket(family) as probe:
            try:
                probe.bind((addr, port))
            except OSError:
                continue
            return port
    with socket.socket(family) as probe:
        probe.bind((addr, 0))
        return probe.getsockname()[1]


def _my_addresses() -> List[str]:
    import psutil

    found = []
    for addrs in psutil.net_if_addrs().values():
        for entry in addrs:
            if entry.family == socket.AF_INET and not entry.address.startswith("127."):
                found.append(entry.address)
    return found


def host_key(hostname: str, addrs: Sequence[str]) -> str:
    """What makes two ranks "on the same host": name and network addresses.

    Containers or network namespaces may share a host name but not a loopback.
    """
    return hostname + "|" + ",".join(sorted(addrs))


def choose_store_address(peers: Sequence[Tuple[str, List[str]]]) -> str:
    """The address rank 0 should host the store on.

    Args:
        peers: ``(host name, its IPv4 addresses)`` of every rank, rank 0 first.

    Returns:
        ``127.0.0.1`` when every rank shares rank 0's host, otherwise the local
        address that routes to the first other host.
    """
    mine = host_key(*peers[0])
    for host, addrs in peers:
        if host_key(host, addrs) == mine:
            continue
        for addr in addrs:
            local = local_address_towards(addr, 9)
            if local and not local.startswith("127."):
                return local
    return "127.0.0.1"


def libmpi_of_launcher(environ: Mapping[str, str]) -> Optional[str]:
    """The libmpi of the Open MPI whose mpirun started this process, if it can be found.

    mpi4py's binary wheels carry both the MPICH and the Open MPI ABI and load
    the first ``libmpi`` they find, which is the wrong one when both MPIs are
    installed (say MPICH in the environment, Open MPI elsewhere). Open MPI tells
    its ranks where its libraries are (``OMPI_LIBDIR_LOC``, ``OPAL_PREFIX``).
    """
    if "OMPI_COMM_WORLD_RANK" not in environ:
        return None
    folders = [environ.get("OMPI_LIBDIR_LOC", "")]
    if environ.get("OPAL_PREFIX"):
        folders.append(os.path.join(environ["OPAL_PREFIX"], "lib"))
    for folder in filter(None, folders):
        for name in ("libmpi.so.40", "libmpi.so"):
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                return path
    return None


def threads_disabled(environ: Mapping[str, str]) -> bool:
    """``HVDLIKE_MPI_THREADS_DISABLE`` (or Horovod's variable): MPI without threads."""
    from . import config

    found = config.lookup(environ, config.KNOBS_BY_FIELD["mpi_threads_disable"])
    if found is None:
        return False
    try:
        return config.KNOBS_BY_FIELD["mpi_threads_disable"].parse(found[1])
    except ValueError:
        raise ConfigError(f"{found[0]}={found[1]!r} is not valid: expected a boolean") from None


# The process whose MPI hvdlike finalizes at exit (see select_libmpi), else None.
_FINALIZER_PID: Optional[int] = None


def select_libmpi(environ: Mapping[str, str]) -> None:
    """Point mpi4py at the launching MPI's library unless the user chose one; with
    ``HVDLIKE_MPI_THREADS_DISABLE=1`` ask for MPI_THREAD_SINGLE (before MPI starts).

    MPI started here is finalized by hvdlike, at exit, in this process only
    (:func:`finalize_at_exit`): mpi4py's own exit hook finalizes MPI in every
    process that exits with it loaded, a child forked after ``init()`` that
    leaves through ``sys.exit`` too -- which hung an Open MPI job and failed an
    MPICH one that had succeeded.
    """
    global _FINALIZER_PID
    if "mpi4py.MPI" not in sys.modules:
        try:
            import mpi4py

            if threads_disabled(environ):
                mpi4py.rc.thread_level = "single"
            mpi4py.rc.finalize = False
            _FINALIZER_PID = os.getpid()
        except ImportError:
            pass
    if "MPI4PY_LIBMPI" in os.environ or "MPI4PY_MPIABI" in os.environ:
        return
    if "mpi4py.MPI" in sys.modules:
        return
    path = libmpi_of_launcher(environ)
    if path:
        os.environ["MPI4PY_LIBMPI"] = path


def finalize_at_exit() -> None:
    """Finalize MPI if hvdlike started it in this very process (not in a forked
    child) and it is still running; called after the runtime's shutdown at exit."""
    if _FINALIZER_PID != os.getpid():
        return
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return
    try:
        if mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
    except Exception:  # noqa: BLE001 - the process is exiting anyway
        pass


def _from_mpi(environ: Mapping[str, str], name: str, rank_var: str, size_var: str,
              world=None):
    rank, size = _int(environ, rank_var), _int(environ, size_var)
    if world is not None:
        return _from_mpi_world(environ, name, rank, size, world)
    gloo_iface = environ.get(ENV_GLOO_IFACE, "")
    if size == 1:
        return Topology(hostname=socket.gethostname()), Rendezvous(
            launcher=name, gloo_iface=gloo_iface)
    select_libmpi(environ)
    try:
        from mpi4py import MPI
    except ImportError:
        raise ConfigError(
            f"this process was started by {name} with {size} ranks, which needs mpi4py "
            "to exchange the rendezvous address: pip install 'hvdlike[mpi]'"
        ) from None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != size:
        raise ConfigError(
            f"{size_var}={size} but MPI.COMM_WORLD has {comm.Get_size()} ranks; "
            "mpi4py is linked against a different MPI than the one that started this job"
        )
    return _over(comm, name, gloo_iface)


def _from_mpi_world(environ: Mapping[str, str], name: str, rank: int, size: int, world):
    """``init(comm=...)`` under mpirun: bootstrap over the members' communicator.

    A list of ranks becomes a communicator of those ``COMM_WORLD`` ranks in
    the list's order (collective over the members only, as in MPI); a given
    communicator is duplicated. The runtime's MPI planes are built from it too
    (``Rendezvous.mpi_comm``).
    """
    from . import world as world_mod

    select_libmpi(environ)
    try:
        from mpi4py import MPI
    except ImportError:
        raise ConfigError(f"init(comm=...) in a job started by {name} needs mpi4py: "
                          "pip install 'hvdlike[mpi]'") from None
    launched = Topology(rank=rank, size=size)
    if world.comm is not None:
        if world.comm == MPI.COMM_NULL:
            raise ValueError("init: comm is MPI.COMM_NULL: this process is not in the "
                             "communicator it was given")
        base = world.comm.Dup()
    else:
        world_mod.check_member(world, launched)
        group = MPI.COMM_WORLD.Get_group().Incl(list(world.ranks))
        try:
            base = MPI.COMM_WORLD.Create_group(group, tag=_WORLD_TAG)
        finally:
            group.Free()
    return _over(base, name, environ.get(ENV_GLOO_IFACE, ""), keep=True)


_WORLD_TAG = 7129  # the tag of init(comm=[ranks])'s communicator creation


def _over(comm, name: str, gloo_iface: str, keep: bool = False):
    """Topology and rendezvous of this process within ``comm`` (collective over it)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        return Topology(hostname=socket.gethostname()), Rendezvous(
            launcher=name, gloo_iface=gloo_iface, mpi_comm=comm if keep else None)
    me = socket.gethostname()
    peers = comm.allgather((me, _my_addresses()))
    topo = dataclasses.replace(topologies([host_key(*peer) for peer in peers])[rank], hostname=me)
    offer = None
    if rank == 0:
        addr = choose_store_address(peers)
        offer = (addr, _free_port(addr), new_secret())
    addr, port, secret = comm.bcast(offer, root=0)
    return topo, Rendezvous(launcher=name, addr=addr, port=port, secret=secret,
                            host_store=rank == 0, gloo_iface=gloo_iface,
                            mpi_comm=comm if keep else None)


def _split_top_level(text: str) -> List[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [part.strip() for part in parts if part.strip()]


# More nodes than any Slurm cluster has: a node list or per-node count that
# expands past this is refused before it is built (a typo such as node[1-99999999]
# would otherwise take minutes and gigabytes).
MAX_NODES = 100_000


def _too_many(text: str, name: str = "node list") -> ConfigError:
    return ConfigError(f"{name} {text!r} names more than {MAX_NODES} nodes")


def _expand_one(name: str, text: str) -> List[str]:
    """Expand one host expression; every ``[...]`` group multiplies the names."""
    open_at = name.find("[")
    if open_at < 0:
        if "]" in name:
            raise ConfigError(f"node list {text!r} is not valid: unmatched ']'")
        return [name]
    close_at = name.find("]", open_at)
    if close_at < 0:
        raise ConfigError(f"node list {text!r} is not valid: unmatched '['")
    prefix, ranges, rest = name[:open_at], name[open_at + 1:close_at], name[close_at + 1:]
    numbers: List[str] = []
    for part in ranges.split(","):
        low, _, high = part.strip().partition("-")
        high = high or low
        if not (low.isdigit() and high.isdigit()) or int(high) < int(low):
            raise ConfigError(f"node list {text!r} is not valid: bad range {part!r}")
        if len(numbers) + int(high) - int(low) >= MAX_NODES:
            raise _too_many(text)
        numbers += [f"{n:0{len(low)}d}" for n in range(int(low), int(high) + 1)]
    tails = _expand_one(rest, text)
    if len(numbers) * len(tails) > MAX_NODES:
        raise _too_many(text)
    return [prefix + n + tail for n in numbers for tail in tails]


def expand_nodelist(text: str, name: str = "") -> List[str]:
    """Expand a Slurm node list into host names, in Slurm's order.

    Raises:
        ConfigError: unbalanced brackets, a malformed range, or more than
            ``MAX_NODES`` names (prefixed with ``name``, the variable that
            held ``text``, when given).

    Example:
        >>> expand_nodelist("node[1-3,5],gpu[01-02]")
        ['node1', 'node2', 'node3', 'node5', 'gpu01', 'gpu02']
    """
    hosts: List[str] = []
    try:
        for part in _split_top_level(text):
            hosts += _expand_one(part, text)
            if len(hosts) > MAX_NODES:
                raise _too_many(text)
    except ConfigError as exc:
        if not name:
            raise
        raise ConfigError(f"{name}: {exc}") from None
    return hosts


def _from_slurm(environ: Mapping[str, str]):
    rank = _int(environ, "SLURM_PROCID")
    size_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
    size = _int(environ, size_var)
    local_rank = _int(environ, "SLURM_LOCALID")
    node_id = _int(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else 0
    nodes_var = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in environ else "SLURM_JOB_NODELIST"
    nodes = expand_nodelist(environ.get(nodes_var, ""), nodes_var)
    tasks_var = ("SLURM_STEP_TASKS_PER_NODE" if "SLURM_STEP_TASKS_PER_NODE" in environ
                 else "SLURM_TASKS_PER_NODE")
    tasks_per_node = expand_tasks_per_node(environ.get(tasks_var, ""), tasks_var)
    if tasks_per_node and not 0 <= node_id < len(tasks_per_node):
        raise ConfigError(f"srun: SLURM_NODEID={node_id} is outside the {len(tasks_per_node)} "
                          f"node(s) of {tasks_var}={environ[tasks_var]!r}")
    if tasks_var == "SLURM_STEP_TASKS_PER_NODE" and sum(tasks_per_node) != size:
        # The step's own counts must add up to the step (the job's may be larger).
        raise ConfigError(f"srun: {tasks_var}={environ[tasks_var]!r} adds up to "
                          f"{sum(tasks_per_node)} task(s), {size_var} says {size}")
    local_size = tasks_per_node[node_id] if tasks_per_node else 1
    cross = [n for n, count in enumerate(tasks_per_node) if count > local_rank] or [0]
    topo = checked(Topology(rank=rank, size=size, local_rank=local_rank, local_size=local_size,
                            cross_rank=cross.index(node_id) if node_id in cross else 0,
                            cross_size=len(cross), hostname=socket.gethostname()), "srun")
    job = environ.get("SLURM_JOB_ID", "0")
    step = environ.get("SLURM_STEP_ID", "0")
    addr = environ.get("MASTER_ADDR") or (nodes[0] if nodes else "127.0.0.1")
    if "MASTER_PORT" in environ:
        port = _int(environ, "MASTER_PORT")
    else:
        # Below the usual ephemeral range (see _free_port), stable for the whole step.
        port = 20000 + (int(job) * 131 + int(step)) % 12000 if job.isdigit() and step.isdigit() \
            else 29500
    # The secret is filled in by bootstrap.with_secret (srun has no private channel).
    return topo, Rendezvous(launcher="srun", addr=addr, port=port, host_store=rank == 0,
                            gloo_iface=environ.get(ENV_GLOO_IFACE, ""))


def expand_tasks_per_node(text: str, name: str = "SLURM_TASKS_PER_NODE") -> List[int]:
    """Expand Slurm's per-node counts: ``2(x3),1`` is ``[2, 2, 2, 1]``.

    Raises:
        ConfigError: naming ``name`` when ``text`` is malformed.
    """
    counts: List[int] = []
    for part in filter(None, text.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ConfigError(f"{name}={text!r} is not valid: expected counts like 2(x3),1")
        repeat = int(match.group(2) or 1)
        if len(counts) + repeat > MAX_NODES:
            raise _too_many(text, name)
        counts.extend([int(match.group(1))] * repeat)
    return counts


def detect(environ: Mapping[str, str], world=None) -> Optional[tuple]:
    """Return ``(Topology, Rendezvous)`` for a rank of mpirun or srun, else None.

    ``world``: ``init(comm=...)``'s :class:`~.world.World` (None: every rank);
    under mpirun the bootstrap then runs over the members only.

    Raises:
        ConfigError: the job needs mpi4py and it is missing, or a variable is malformed.
    """
    in_srun = "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ
    for name, rank_var, size_var in MPI_FLAVOURS:
        if rank_var in environ and size_var in environ:
            if in_srun and importlib.util.find_spec("mpi4py") is None:
                break  # srun's PMI variables without MPI: bootstrap from Slurm's own
            return _from_mpi(environ, name, rank_var, size_var, world)
    if in_srun:
        return _from_slurm(environ)
    return None
