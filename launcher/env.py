"""The environment each rank runs with.

Local ranks inherit the launcher's environment. Remote ranks get it forwarded
(PATH, PYTHONPATH, the virtualenv, ``HVDLIKE_*``, the user's own variables),
minus the variables that describe the launcher's own host or login session.
Either way the job's variables from :mod:`hvdlike.core.bootstrap` are added on
top, each also under the ``HOROVOD_*`` name ``horovodrun`` gives it
(``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``, ... ``HOROVOD_HOSTNAME``). The environment travels over the helper's stdin, never on a command line.
"""

from __future__ import annotations

import re
from typing import Dict, Mapping, Sequence

from hvdlike.core.topology import (
    ENV_CROSS_RANK,
    ENV_CROSS_SIZE,
    ENV_GLOO_IFACE,
    ENV_HOSTNAME,
    ENV_JOB_SECRET,
    ENV_LAUNCHER,
    ENV_LOCAL_RANK,
    ENV_LOCAL_SIZE,
    ENV_RANK,
    ENV_SIZE,
    ENV_STORE_ADDR,
    ENV_STORE_PORT,
    HOROVOD_VARIABLES,
)

from .hosts import RankPlacement
from .task import RUN_SECRET_ENV, RUN_STORE_ENV

# Variables that belong to the launcher's host or session, not to the job.
_HOST_SPECIFIC = re.compile(
    r"^(HOSTNAME|HOST|DISPLAY|XAUTHORITY|PWD|OLDPWD|SHLVL|_|TERM|TERMCAP|COLUMNS|LINES"
    r"|SSH_.*|TMUX.*|STY|WINDOW|XDG_.*|DBUS_.*|KRB5CCNAME|MAIL|LS_COLORS|PS1|PS2"
    r"|BASH_FUNC_.*|OMPI_.*|PMI_.*|PMIX_.*|SLURM_.*|HYDRA_.*|MPI_LOCAL.*"
    r"|TORCHELASTIC_.*|MASTER_ADDR|MASTER_PORT|RANK|WORLD_SIZE|LOCAL_RANK"
    r"|LOCAL_WORLD_SIZE|GROUP_RANK)$"
)

# What horovodrun exports to every rank, under the names scripts written for
# Horovod read before init(); each mirrors the hvdlike variable it maps from
# (init() sets them again, for launchers other than this one and elastic re-forms).
HOROVOD_MIRRORS = {
    ENV_RANK: HOROVOD_VARIABLES["rank"],
    ENV_SIZE: HOROVOD_VARIABLES["size"],
    ENV_LOCAL_RANK: HOROVOD_VARIABLES["local_rank"],
    ENV_LOCAL_SIZE: HOROVOD_VARIABLES["local_size"],
    ENV_CROSS_RANK: HOROVOD_VARIABLES["cross_rank"],
    ENV_CROSS_SIZE: HOROVOD_VARIABLES["cross_size"],
    ENV_HOSTNAME: HOROVOD_VARIABLES["hostname"],
}

# The elastic driver's per-worker variables (hvdlike.core.elastic.protocol's ENV_*),
# spelled here: importing that package loads torch, which the launcher imports
# only where a Ctrl-C is held back (see .interrupts); a unit test keeps them equal.
ELASTIC_VARIABLES = ("HVDLIKE_ELASTIC_WORKER", "HVDLIKE_ELASTIC_GENERATION",
                     "HVDLIKE_ELASTIC_TIMEOUT", "HVDLIKE_ELASTIC_WORKER_SECRET")

# The per-rank variables a nested launcher must not leak into its own ranks: every
# variable hvdlike-run, the elastic driver or hvdlike.run sets for the ranks of one
# job (a rank of an elastic job that starts a job of its own would otherwise hand
# its worker id, generation and worker secret to ranks that have no seat there).
JOB_VARIABLES = (
    ENV_RANK, ENV_SIZE, ENV_LOCAL_RANK, ENV_LOCAL_SIZE, ENV_CROSS_RANK, ENV_CROSS_SIZE,
    ENV_HOSTNAME, ENV_STORE_ADDR, ENV_STORE_PORT, ENV_JOB_SECRET, ENV_GLOO_IFACE,
    ENV_LAUNCHER, *HOROVOD_MIRRORS.values(),
    *ELASTIC_VARIABLES, RUN_STORE_ENV, RUN_SECRET_ENV,
)


def library_defaults(interfaces: Sequence[str] = (), tcp: bool = False) -> Dict[str, str]:
    """Variables every rank gets unless the user set them, as ``horovodrun`` sets them:
    ``PYTHONUNBUFFERED=1`` (a rank's ``print()`` shows as it runs, not at its exit),
    with ``--tcp`` ``NCCL_IB_DISABLE=1``, with interfaces named ``NCCL_SOCKET_IFNAME``
    listing them all."""
    env = {"PYTHONUNBUFFERED": "1"}
    if tcp:
        env["NCCL_IB_DISABLE"] = "1"
    if interfaces:
        env["NCCL_SOCKET_IFNAME"] = ",".join(interfaces)
    return env


def forwardable(name: str) -> bool:
    """Whether a launcher variable is forwarded to remote ranks."""
    return not _HOST_SPECIFIC.match(name) and name not in JOB_VARIABLES


def base_environment(launcher_env: Mapping[str, str], remote: bool) -> Dict[str, str]:
    """The launcher's environment as a rank on a local or remote host should see it."""
    if remote:
        return {k: v for k, v in launcher_env.items() if forwardable(k)}
    return {k: v for k, v in launcher_env.items() if k not in JOB_VARIABLES}


def rank_environment(
    base: Mapping[str, str],
    placement: RankPlacement,
    store_addr: str,
    store_port: int,
    secret: str,
    gloo_iface: str = "",
    knobs: Mapping[str, str] = (),
    defaults: Mapping[str, str] = (),
) -> Dict[str, str]:
    """Everything one rank needs: ``base`` plus knobs plus the job's variables.

    Args:
        base: result of :func:`base_environment` for the rank's host.
        placement: the rank's host and topology.
        store_addr: address of the rendezvous store.
        store_port: its port.
        secret: the job secret (key prefix and HMAC key).
        gloo_iface: network interface Gloo binds to; empty lets the core choose.
        knobs: ``HVDLIKE_*`` knob variables set from launcher flags.
        defaults: variables set only where ``base`` does not set them
            (:func:`library_defaults`).
    """
    topo = placement.topology
    env = dict(base)
    env.update(dict(knobs))
    for name, value in dict(defaults).items():
        env.setdefault(name, value)
    env.update({
        ENV_RANK: str(topo.rank),
        ENV_SIZE: str(topo.size),
        ENV_LOCAL_RANK: str(topo.local_rank),
        ENV_LOCAL_SIZE: str(topo.local_size),
        ENV_CROSS_RANK: str(topo.cross_rank),
        ENV_CROSS_SIZE: str(topo.cross_size),
        ENV_HOSTNAME: placement.host,
        ENV_STORE_ADDR: store_addr,
        ENV_STORE_PORT: str(store_port),
        ENV_JOB_SECRET: secret,
        ENV_LAUNCHER: "hvdlike-run",
    })
    env.update({mirror: env[name] for name, mirror in HOROVOD_MIRRORS.items()})
    if gloo_iface:
        env[ENV_GLOO_IFACE] = gloo_iface
    return env


def redact(env: Mapping[str, str]) -> Dict[str, str]:
    """A copy of ``env`` safe to print: the job secret is masked."""
    hidden = (ENV_JOB_SECRET, "HVDLIKE_ELASTIC_WORKER_SECRET", RUN_SECRET_ENV)
    return {k: ("<hidden>" if k in hidden else v) for k, v in env.items()}
