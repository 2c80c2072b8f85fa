"""The launch configuration: everything a job needs, independent of argparse.

The CLI builds one :class:`LaunchConfig` from its flags; ``hvdlike.run`` builds
one from its arguments. Everything downstream (hosts, exec, monitor) reads only
this object.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Dict, List, Mapping, Optional

from hvdlike.core import config as core_config
from hvdlike.core.errors import ConfigError

from .errors import LaunchError
from .hosts import HostSlots, parse_hosts, read_hostfile


@dataclasses.dataclass
class SshOptions:
    """How to reach remote hosts."""

    port: Optional[int] = None
    """``-p``: ssh port of every remote host (default: ssh's own)."""
    identity_file: Optional[str] = None
    """``-i``: private key to authenticate with."""
    connect_timeout: float = 10.0
    """Seconds ssh may spend connecting (``ConnectTimeout``)."""
    options: List[str] = dataclasses.field(default_factory=list)
    """Extra ``-o KEY=VALUE`` options, placed before hvdlike-run's defaults so they win."""


def current_directory() -> str:
    """The working directory the ranks start in.

    Raises:
        LaunchError: it was deleted under the launcher, or cannot be read.
    """
    try:
        return os.getcwd()
    except FileNotFoundError:
        raise LaunchError("the current directory no longer exists (it was deleted); the "
                          "ranks start in it, so change to an existing one first") from None
    except OSError as exc:
        raise LaunchError(f"the current directory cannot be determined: "
                          f"{exc.strerror or exc}") from None


@dataclasses.dataclass
class LaunchConfig:
    """One job: what to run, where, and how.

    Attributes are documented inline; their CLI flags are in :mod:`.cli`.
    """

    command: List[str]
    """The program and its arguments, run once per rank."""
    hosts: List[HostSlots]
    """Hosts and slots, filled with ranks in order."""
    np: Optional[int] = None
    """Number of ranks (default: every slot)."""
    ssh: SshOptions = dataclasses.field(default_factory=SshOptions)
    network_interface: str = ""
    """Interface the store binds to and Gloo uses (default: the one routing to the hosts)."""
    network_interfaces: List[str] = dataclasses.field(default_factory=list)
    """Every interface named (the first is :attr:`network_interface`); NCCL gets them all
    as ``NCCL_SOCKET_IFNAME``."""
    tcp: bool = False
    """``--tcp``: NCCL must not use InfiniBand (``NCCL_IB_DISABLE=1``)."""
    knob_env: Dict[str, str] = dataclasses.field(default_factory=dict)
    """``HVDLIKE_*`` variables set from knob flags."""
    start_timeout: float = 60.0
    """Seconds the pre-flight check may take per host, and ranks may take to meet."""
    grace_seconds: float = 5.0
    """Seconds between SIGTERM and SIGKILL when ranks are stopped."""
    output_dir: Optional[str] = None
    """Also write ``<dir>/rank.<N>/stdout`` and ``stderr`` for every rank."""
    timestamps: bool = False
    """Start every forwarded output line with the time (``--prefix-output-with-timestamp``)."""
    verbose: bool = False
    """Print the exact commands run."""
    dry_run: bool = False
    """Print what would run and exit."""
    preflight: bool = True
    """Check every remote host over ssh before starting ranks."""
    use_mpi: bool = False
    """Hand the launch to ``mpirun`` instead of starting ranks ourselves."""
    mpi_args: List[str] = dataclasses.field(default_factory=list)
    """Extra arguments for ``mpirun``."""
    use_srun: bool = False
    """Start every rank as a Slurm job step with ``srun`` (inside an allocation)."""
    remote_python: str = sys.executable
    """Python interpreter that runs the rank helper on remote hosts."""
    cwd: str = dataclasses.field(default_factory=lambda: current_directory())
    """Working directory of every rank."""
    environ: Mapping[str, str] = dataclasses.field(default_factory=lambda: dict(os.environ))
    """The launcher's environment, forwarded to ranks."""
    elastic: Optional[object] = None
    """An :class:`~.elastic.settings.ElasticSettings` for an elastic job, else None."""


def resolve_hosts(hosts: Optional[str], hostfile: Optional[str], np: Optional[int]) -> List[HostSlots]:
    """Hosts from ``-H`` or ``--hostfile``; ``localhost:np`` when neither is given.

    Raises:
        LaunchError: both are given, or either is malformed.
    """
    if hosts and hostfile:
        raise LaunchError("-H/--hosts and --hostfile cannot be used together")
    if hostfile:
        return read_hostfile(hostfile)
    if hosts is not None:
        return parse_hosts(hosts)
    if np is None:
        raise LaunchError("-np is required when no -H/--hosts or --hostfile is given")
    return [HostSlots("localhost", max(np, 1))]


def knob_environment(values: Mapping[str, object]) -> Dict[str, str]:
    """Turn knob flag values (by knob field) into ``HVDLIKE_*`` variables.

    Flags with a scale (``--fusion-threshold-mb``) are multiplied; booleans become
    ``"1"``. Values are validated by the core's own parser so a bad flag fails
    here, naming the flag, rather than in every rank.

    Raises:
        LaunchError: a value is not acceptable to its knob.
    """
    env: Dict[str, str] = {}
    for knob in core_config.KNOBS:
        value = values.get(knob.field)
        if value is None or value is False:
            continue
        if value is True:
            text = "1"
        elif knob.flag_scale:
            try:
                number = core_config.strict_float(value) if isinstance(value, str) \
                    else float(value)
                scaled = number * knob.flag_scale
            except ValueError:
                scaled = math.nan
            if not math.isfinite(scaled):
                raise LaunchError(f"{knob.flag} {value!r} is not valid: expected a number")
            if isinstance(knob.default, int) and 0 < scaled < 1:
                # It would round to 0, which means something else (fusion off).
                raise LaunchError(f"{knob.flag} {value!r} is less than one byte; pass 0 if "
                                  "that is what you mean")
            # floor, not int(): a negative fraction must stay negative for the knob to refuse.
            text = str(math.floor(scaled)) if isinstance(knob.default, int) else repr(scaled)
        else:
            text = str(value)
        try:
            knob.parse(text)
        except ValueError as exc:
            raise LaunchError(f"{knob.flag} {value!r} is not valid: expected {exc}") from None
        if not text.strip():
            # An empty variable means "unset" (no timeline, no log); an empty flag is a mistake.
            raise LaunchError(f"{knob.flag} is empty")
        env[knob.env] = text
    return env


def effective_settings(config: LaunchConfig) -> core_config.Config:
    """The core settings ranks will run with (environment plus knob flags).

    Raises:
        LaunchError: an ``HVDLIKE_*``/``HOROVOD_*`` variable holds a bad value.
    """
    try:
        settings = core_config.load({**config.environ, **config.knob_env})
    except ConfigError as exc:
        raise LaunchError(str(exc)) from None
    if not config.use_mpi:
        # MPI planes need ranks started by mpirun: say so before starting any.
        for field in ("controller", "cpu_operations"):
            if getattr(settings, field) == "mpi":
                knob = core_config.KNOBS_BY_FIELD[field]
                raise LaunchError(f"{knob.env}=mpi ({knob.flag} mpi) needs ranks started by "
                                  "mpirun (hvdlike-run --mpi)")
    return settings
