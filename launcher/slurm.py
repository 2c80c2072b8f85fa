"""``hvdlike-run`` inside a Slurm allocation (``salloc`` or ``sbatch``).

Without ``-H``/``--hostfile``, a launcher that finds itself in an allocation
(``SLURM_JOB_ID`` and ``SLURM_JOB_NODELIST`` set, not inside a job step) takes
its hosts from the allocation: the node list expanded, each node's slots from
``SLURM_TASKS_PER_NODE`` when tasks were requested (``-n``), else from
``SLURM_JOB_CPUS_PER_NODE``. Every rank is then started as a one-task job step
with ``srun`` instead of ssh, so ranks run inside the job's resources and are
cleaned up by Slurm with the job. Everything else (store, environment on the
helper's stdin, monitoring, failure handling) is the same as over ssh.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Dict, List, Mapping, Optional, Sequence

from hvdlike.core.mpi_bootstrap import expand_nodelist, expand_tasks_per_node
from hvdlike.core.errors import ConfigError

from . import env as rank_env
from .errors import LaunchError
from .hosts import HostSlots

# Variables of the allocation (not of one step) that ranks keep seeing.
_JOB_LEVEL = ("SLURM_JOB_", "SLURM_CLUSTER_NAME", "SLURM_CONF", "SLURM_SUBMIT_")


def in_allocation(environ: Mapping[str, str]) -> bool:
    """Whether this process runs in a Slurm allocation but outside a job step."""
    return ("SLURM_JOB_ID" in environ
            and bool(environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST"))
            and "SLURM_STEP_ID" not in environ)


def allocation_hosts(environ: Mapping[str, str]) -> List[HostSlots]:
    """The allocation's nodes and how many ranks each may run.

    Raises:
        LaunchError: the node list and the per-node counts do not match, or a
            variable is malformed.
    """
    nodes_var = "SLURM_JOB_NODELIST" if environ.get("SLURM_JOB_NODELIST") else "SLURM_NODELIST"
    nodelist = environ.get(nodes_var, "")
    if "SLURM_NTASKS" in environ and environ.get("SLURM_TASKS_PER_NODE"):
        source = "SLURM_TASKS_PER_NODE"
    else:
        source = "SLURM_JOB_CPUS_PER_NODE"
    try:
        nodes = expand_nodelist(nodelist, nodes_var)
        counts = expand_tasks_per_node(environ.get(source, ""), source)
    except (ConfigError, ValueError) as exc:
        raise LaunchError(f"cannot read the Slurm allocation: {exc}") from None
    if len(counts) != len(nodes) or not nodes:
        raise LaunchError(
            f"cannot read the Slurm allocation: {nodes_var}={nodelist!r} names "
            f"{len(nodes)} node(s) but {source}={environ.get(source, '')!r} gives {len(counts)}")
    if 0 in counts:
        raise LaunchError(f"cannot read the Slurm allocation: {source}="
                          f"{environ.get(source, '')!r} gives a node no slots")
    return [HostSlots(node, count) for node, count in zip(nodes, counts)]


def srun_command(host: str, helper_argv: Sequence[str], srun: str = "srun",
                 cpu_bind: bool = True) -> List[str]:
    """The ``srun`` that starts one rank's helper on ``host`` as a one-task step.

    ``--overlap`` lets the steps of all ranks run at once whatever the
    allocation's memory or CPU accounting; ``--cpu-bind=none`` leaves each
    rank free to use every CPU Slurm gave the job on that node (left out with
    ``cpu_bind`` off: on a cluster that binds nothing, srun would print that it
    cannot, once per rank).
    """
    return [srun, "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--overlap",
            *(["--cpu-bind=none"] if cpu_bind else []), "--quiet", "--input=all",
            "--job-name=hvdlike-rank", *helper_argv]


def binds_cpus(srun: str, environ: Mapping[str, str]) -> bool:
    """Whether the cluster's task plugin can bind tasks to CPUs (so that
    ``--cpu-bind=none`` means something); True when ``scontrol`` cannot say."""
    scontrol = os.path.join(os.path.dirname(srun), "scontrol")
    if not os.access(scontrol, os.X_OK):
        scontrol = shutil.which("scontrol", path=environ.get("PATH")) or ""
    if not scontrol:
        return True
    try:
        out = subprocess.run([scontrol, "show", "config"], capture_output=True, text=True,
                             timeout=10, env=dict(environ)).stdout
    except (OSError, subprocess.SubprocessError):
        return True
    found = re.search(r"^TaskPlugin\s*=\s*(\S+)", out, re.MULTILINE)
    if found is None:
        return True
    return any(name in found.group(1) for name in ("affinity", "cgroup"))


def find_srun(environ: Mapping[str, str]) -> str:
    """The srun executable.

    Raises:
        LaunchError: srun is not on PATH.
    """
    found = shutil.which("srun", path=environ.get("PATH"))
    if found is None:
        raise LaunchError("inside a Slurm allocation but srun is not on PATH; pass -H or "
                          "--hostfile to launch over ssh instead")
    return found


def rank_base_environment(launcher_env: Mapping[str, str]) -> Dict[str, str]:
    """What a rank started by srun inherits from the launcher.

    Like a remote rank (host-specific variables dropped), plus the allocation's
    own variables (job id, node list...), which stay true on every node.
    """
    env = rank_env.base_environment(launcher_env, remote=True)
    env.update({k: v for k, v in launcher_env.items()
                if k.startswith(_JOB_LEVEL) and k not in rank_env.JOB_VARIABLES})
    return env


def describe(environ: Mapping[str, str], hosts: Sequence[HostSlots]) -> str:
    listed = ",".join(f"{h.host}:{h.slots}" for h in hosts)
    return f"Slurm job {environ.get('SLURM_JOB_ID')}: hosts {listed}, ranks started with srun"


def why_not_allocated(environ: Mapping[str, str]) -> str:
    """Why a launcher in a Slurm job does not take the allocation's hosts ('' if not in one)."""
    if "SLURM_JOB_ID" not in environ or in_allocation(environ):
        return ""
    if "SLURM_STEP_ID" in environ:
        return (f"inside step {environ['SLURM_STEP_ID']} of Slurm job {environ['SLURM_JOB_ID']} "
                "(run hvdlike-run from the batch script or the salloc shell, not under srun)")
    return f"Slurm job {environ['SLURM_JOB_ID']} sets no SLURM_JOB_NODELIST"


def hosts_if_allocated(environ: Mapping[str, str], hosts: Optional[str],
                       hostfile: Optional[str]) -> Optional[List[HostSlots]]:
    """The allocation's hosts when no host was given and we are in one; else None."""
    if hosts is not None or hostfile or not in_allocation(environ):
        return None
    return allocation_hosts(environ)
