"""Find out who we are and where the rendezvous store is.

A rank learns its place in the job from the environment of whatever started
it. Detectors are tried in order; the first that recognises its launcher wins:

* ``hvdlike-run`` sets the ``HVDLIKE_*`` variables named below;
* ``torchrun`` sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``...;
* ``mpirun``/``srun`` (see :mod:`hvdlike.core.mpi_bootstrap`);
* nothing: a single process job of size 1.

The contract with the launcher (the ``ENV_*`` names, :class:`Topology`,
:class:`Rendezvous`) lives in :mod:`.topology`. Every rendezvous leaves here
with a job secret: the launcher's, the user's ``HVDLIKE_JOB_SECRET``, or one
shared by rank 0 (see :func:`with_secret`).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Callable, List, Mapping, Optional

from . import mpi_bootstrap, secret_share
from .errors import ConfigError
from .log import logger
from .topology import (  # noqa: F401 - re-exported: the launcher contract lives in topology
    ENV_CROSS_RANK, ENV_CROSS_SIZE, ENV_GLOO_IFACE, ENV_HOSTNAME, ENV_JOB_SECRET, ENV_LAUNCHER,
    ENV_LOCAL_RANK, ENV_LOCAL_SIZE, ENV_RANK, ENV_SIZE, ENV_STORE_ADDR, ENV_STORE_PORT,
    Rendezvous, Topology, checked, local_address_towards,
)

def _int(environ: Mapping[str, str], name: str) -> int:
    text = environ.get(name)
    if text is None:
        raise ConfigError(f"{name} is not set; it is required when launched this way")
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not valid: expected an integer") from None


def from_hvdlike_run(environ: Mapping[str, str], start_timeout: float = 60.0):
    if ENV_RANK not in environ:
        return None
    size = _int(environ, ENV_SIZE)
    local_size = int(environ.get(ENV_LOCAL_SIZE, size))
    topo = checked(
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
        gloo_iface=environ.get(ENV_GLOO_IFACE, ""),
    )
    tag = f"{rdzv.launcher}/{rdzv.addr}/{rdzv.port}"
    return topo, with_secret(rdzv, topo, environ, tag, start_timeout)


def _int_or(environ: Mapping[str, str], name: str, default: int) -> int:
    return _int(environ, name) if name in environ else default


def from_torchrun(environ: Mapping[str, str], start_timeout: float = 60.0):
    """torchrun's variables, or the ``env://`` ones a Kubernetes PyTorchJob sets.

    Under torchrun (``TORCHELASTIC_RUN_ID`` set) its agent serves the store at
    ``MASTER_ADDR:MASTER_PORT``; without an agent rank 0 serves it, as
    ``init_process_group("env://")`` does.
    """
    agent = "TORCHELASTIC_RUN_ID" in environ
    if not agent and not (
        "RANK" in environ and "WORLD_SIZE" in environ and "MASTER_ADDR" in environ
    ):
        return None
    size = _int(environ, "WORLD_SIZE")
    rank = _int(environ, "RANK")
    local_size = _int_or(environ, "LOCAL_WORLD_SIZE", size)
    nodes = max(1, size // max(1, local_size))
    topo = checked(
        Topology(
            rank=rank,
            size=size,
            local_rank=_int_or(environ, "LOCAL_RANK", rank % max(1, local_size)),
            local_size=local_size,
            cross_rank=_int_or(environ, "GROUP_RANK", rank // max(1, local_size)),
            cross_size=nodes,
            hostname=socket.gethostname(),
        ),
        "torchrun environment",
    )
    port = _int(environ, "MASTER_PORT")
    if not 1 <= port <= 65535:
        raise ConfigError(f"torchrun environment: MASTER_PORT={port} is not a TCP port "
                          f"(1..65535)")
    run_id = environ.get("TORCHELASTIC_RUN_ID", "none")
    restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    tag = f"torchrun/{run_id}/{restart}/{port}"
    rdzv = Rendezvous(
        launcher="torchrun",
        addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        port=port,
        host_store=not agent and rank == 0,
        gloo_iface=environ.get(ENV_GLOO_IFACE, ""),
    )
    rdzv = with_secret(rdzv, topo, environ, tag, start_timeout)
    if environ.get(ENV_JOB_SECRET) and agent:
        # torchrun's store outlives a restart of its workers: the keys of each
        # attempt must not meet the previous attempt's, which a secret of the
        # user's own would otherwise give them (a drawn one is fresh each time).
        rdzv = dataclasses.replace(rdzv, secret=f"{rdzv.secret}/{tag}")
    return topo, rdzv


def single_process(environ: Mapping[str, str], start_timeout: float = 60.0):
    return Topology(hostname=socket.gethostname()), Rendezvous(launcher="none")


def _mpi_or_slurm(environ: Mapping[str, str], start_timeout: float = 60.0, world=None):
    found = mpi_bootstrap.detect(environ, world)  # imports mpi4py only for an MPI job
    if found is None:
        return None
    topo, rdzv = found
    if rdzv.launcher == "srun":  # no private channel: a shared file or the user's secret
        tag = f"srun/{environ.get('SLURM_JOB_ID', '0')}/{environ.get('SLURM_STEP_ID', '0')}"
        rdzv = with_secret(rdzv, topo, environ, tag, start_timeout)
    elif environ.get(ENV_JOB_SECRET):  # the user's secret wins over the broadcast one
        rdzv = dataclasses.replace(rdzv, secret=environ[ENV_JOB_SECRET])
    return topo, rdzv


def with_secret(rdzv: Rendezvous, topo: Topology, environ: Mapping[str, str], tag: str,
                start_timeout: float) -> Rendezvous:
    """Give a torchrun/srun rendezvous its secret.

    ``HVDLIKE_JOB_SECRET`` when the user set one; else, when every rank is on one
    host, a fresh random secret rank 0 shares through an owner-only file; else
    (several hosts, no channel) a public name: the store is then namespaced but
    not authenticated, and rank 0 says so.
    """
    given = environ.get(ENV_JOB_SECRET, "")
    if given:
        return dataclasses.replace(rdzv, secret=given)
    if topo.size == 1:
        return dataclasses.replace(rdzv, secret=secret_share.new_secret())
    if topo.local_size == topo.size:
        secret = (secret_share.publish(tag) if topo.rank == 0
                  else secret_share.receive(tag, start_timeout))
        return dataclasses.replace(rdzv, secret=secret, secret_file_tag=tag)
    if topo.rank == 0:
        logger.warning(
            "%s started this job on several hosts without %s: its rendezvous store is not "
            "authenticated, so anyone who can reach %s:%d can disturb the job. Set %s to "
            "the same random value on every rank (docs/security.md).",
            rdzv.launcher, ENV_JOB_SECRET, rdzv.addr, rdzv.port, ENV_JOB_SECRET)
    return dataclasses.replace(rdzv, secret=f"public/{tag}", authenticated=False)


DETECTORS: List[Callable[[Mapping[str, str]], Optional[tuple]]] = [
    from_hvdlike_run,
    from_torchrun,
    _mpi_or_slurm,
    single_process,
]


def detect(environ: Optional[Mapping[str, str]] = None, start_timeout: float = 60.0,
           world=None):
    """Return ``(Topology, Rendezvous)`` for this process.

    Args:
        environ: the process environment (default ``os.environ``).
        start_timeout: how long a rank may wait for rank 0 to share the secret.
        world: ``init(comm=...)``'s :class:`~.world.World`, or None. Under
            mpirun the bootstrap runs over its members (the result describes
            them); elsewhere the launched job's place is returned and the
            runtime narrows it (:func:`.world.narrow`).
    """
    environ = os.environ if environ is None else environ
    for detector in DETECTORS:
        if world is not None and detector is _mpi_or_slurm:
            found = detector(environ, start_timeout, world)
        else:
            found = detector(environ, start_timeout)
        if found is not None:
            return found
    raise AssertionError("single_process always detects")  # pragma: no cover
