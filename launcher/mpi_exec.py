"""``hvdlike-run --mpi``: hand the launch to ``mpirun``.

Open MPI and MPICH (Hydra) take different flags; :func:`mpirun_command` builds
the right command for each. Environment values never go on the command line:
Open MPI gets ``-x NAME`` (value read from mpirun's own environment), Hydra
forwards the whole environment (``-genvall``). The ranks then bootstrap from
MPI's variables (see :mod:`hvdlike.core.mpi_bootstrap`), with rank 0 hosting
the store and mpi4py sharing its address.
"""

from __future__ import annotations

import os
import shlex
import signal
import stat
import subprocess
import sys
import tempfile
from typing import List, Mapping, Optional, Sequence

from . import env as rank_env
from .errors import LaunchError
from .hosts import HostSlots
from .launch_config import LaunchConfig
from .ssh_exec import ssh_options

OPEN_MPI = "openmpi"
MPICH = "mpich"
# Open MPI refuses to start as root without it; Hydra has no such check.
ROOT_FLAG = "--allow-run-as-root"


def flavour_of(version_text: str) -> Optional[str]:
    """Which MPI printed this ``mpirun --version`` text (None: unknown)."""
    low = version_text.lower()
    if "open mpi" in low or "open-mpi" in low or "openrte" in low:
        return OPEN_MPI
    if "hydra" in low or "mpich" in low or "intel(r) mpi" in low:
        return MPICH
    return None


def detect_flavour(mpirun: str = "mpirun") -> str:
    """Run ``mpirun --version`` and tell Open MPI from MPICH.

    Raises:
        LaunchError: mpirun is missing or unrecognised.
    """
    try:
        proc = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=20)
    except FileNotFoundError:
        raise LaunchError(f"--mpi: {mpirun} not found; install Open MPI or MPICH "
                          "(pip install 'hvdlike[mpi]')") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"--mpi: '{mpirun} --version' did not answer within 20s") from None
    flavour = flavour_of(proc.stdout + proc.stderr)
    if flavour is None:
        raise LaunchError(f"--mpi: cannot tell which MPI {mpirun} belongs to")
    return flavour


def _host_list(hosts: Sequence[HostSlots]) -> str:
    return ",".join(f"{h.host}:{h.slots}" for h in hosts)


def mpirun_command(
    flavour: str,
    np: int,
    hosts: Sequence[HostSlots],
    command: Sequence[str],
    env_names: Sequence[str],
    ssh_args: Sequence[str] = (),
    ssh_wrapper: Optional[str] = None,
    extra: Sequence[str] = (),
    as_root: bool = False,
    mpirun: str = "mpirun",
    output_dir: Optional[str] = None,
) -> List[str]:
    """The ``mpirun`` command for ``flavour``.

    Args:
        flavour: :data:`OPEN_MPI` or :data:`MPICH`.
        np: number of ranks.
        hosts: hosts and slots.
        command: the user's program and arguments.
        env_names: variables to forward (Open MPI only; Hydra forwards everything).
        ssh_args: ssh options (Open MPI passes them to its rsh agent).
        ssh_wrapper: an executable that runs ssh with those options (Hydra's
            ``-launcher-exec`` takes a program, not arguments).
        extra: the user's extra mpirun arguments, inserted before the command.
        as_root: add Open MPI's ``--allow-run-as-root``.
        mpirun: the mpirun executable.
        output_dir: write each rank's output to ``<dir>/rank.<N>/stdout`` and
            ``stderr`` instead of the terminal (Hydra's file patterns; Open MPI's
            own option lays files out differently and is left to ``extra``).
    """
    if flavour == OPEN_MPI:
        argv = [mpirun]
        if as_root and ROOT_FLAG not in extra:
            argv.append(ROOT_FLAG)
        argv += ["-np", str(np), "-H", _host_list(hosts)]
        # Defaults the user's own binding or mapping replaces (Open MPI 5 refuses
        # either option twice), as --binding-args does under horovodrun.
        if not _gives(extra, "bind-to"):
            argv += ["--bind-to", "none"]
        if not _gives(extra, "map-by"):
            argv += ["--map-by", "slot"]
        argv.append("--tag-output")
        if ssh_args:
            argv += ["--mca", "plm_rsh_args", " ".join(shlex.quote(a) for a in ssh_args)]
        for name in env_names:
            argv += ["-x", name]
    elif flavour == MPICH:
        argv = [mpirun, "-np", str(np), "-hosts", _host_list(hosts), "-prepend-rank", "-genvall"]
        if ssh_wrapper:
            argv += ["-launcher", "ssh", "-launcher-exec", ssh_wrapper]
        if output_dir:
            folder = os.path.abspath(output_dir)
            argv += ["-outfile-pattern", os.path.join(folder, "rank.%r", "stdout"),
                     "-errfile-pattern", os.path.join(folder, "rank.%r", "stderr")]
    else:
        raise LaunchError(f"--mpi: unsupported MPI flavour {flavour!r}")
    return argv + list(extra) + list(command)


def _gives(extra: Sequence[str], option: str) -> bool:
    """Whether mpirun arguments ``extra`` set ``option`` (``-x``, ``--x``, ``--x=v``)."""
    return any(arg.lstrip("-").split("=", 1)[0] == option for arg in extra
               if arg.startswith("-"))


def _parent_death_signal():
    """A function for mpirun's process, run before it execs: be sent SIGTERM when the
    launcher dies (None where the C library has no ``prctl``).

    A launcher killed with SIGKILL cannot pass anything on; without this its
    mpirun (and every rank) ran on, orphaned. The library is loaded here, in the
    launcher: the child of a fork should import nothing.
    """
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the launcher's own signals still pass
        return None

    def set_signal() -> None:
        prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG

    return set_signal


def _write_ssh_wrapper(folder: str, ssh_args: Sequence[str]) -> str:
    path = os.path.join(folder, "ssh")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("#!/bin/sh\nexec ssh " + " ".join(shlex.quote(a) for a in ssh_args)
                     + ' "$@"\n')
    os.chmod(path, stat.S_IRWXU)
    return path


def mpi_environment(config: LaunchConfig) -> Mapping[str, str]:
    """mpirun's environment: the launcher's plus knob variables, minus job variables,
    plus NCCL's variables for ``--tcp`` and the interfaces named, unless the user set
    them (:func:`.env.library_defaults`). Not ``PYTHONUNBUFFERED``: mpirun forwards
    output itself, and Hydra's ``-prepend-rank`` would prefix every piece of a line
    an unbuffered ``print()`` writes."""
    from .job import interfaces_of

    env = {k: v for k, v in config.environ.items() if k not in rank_env.JOB_VARIABLES}
    env.update(config.knob_env)
    defaults = rank_env.library_defaults(interfaces_of(config), config.tcp)
    del defaults["PYTHONUNBUFFERED"]
    for name, value in defaults.items():
        env.setdefault(name, value)
    return env


# The launcher's own signals: passed on to mpirun as SIGTERM (it stops every rank);
# the launcher then exits 128 + the signal it got, as without --mpi.
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run_with_mpirun(config: LaunchConfig, np: int, dry_run: bool = False,
                    verbose=print, mpirun: str = "mpirun", say=None,
                    job_env: Optional[Mapping[str, str]] = None) -> int:
    """Run the job under mpirun; return its exit status (or 0 after a dry run).

    ``say``: reports a line of the launcher's own (an interrupted job).
    ``job_env``: variables of this job for every rank (``hvdlike.run``'s store and
    secret), set after the launcher's own job variables were taken out.
    """
    flavour = detect_flavour(mpirun)
    as_root = hasattr(os, "geteuid") and os.geteuid() == 0
    if as_root and flavour == OPEN_MPI and ROOT_FLAG not in config.mpi_args:
        sys.stderr.write(f"hvdlike-run: running as root: passing {ROOT_FLAG} to Open MPI's "
                         "mpirun, which refuses root otherwise\n")
    env = mpi_environment(config)
    env.update(job_env or {})
    names = sorted(k for k in env if rank_env.forwardable(k) or k in (job_env or {}))
    remote = any(h.host not in ("localhost", "127.0.0.1") for h in config.hosts)
    ssh_args = ssh_options(config.ssh) if remote else []
    output_dir = config.output_dir
    if output_dir and flavour == OPEN_MPI:
        sys.stderr.write("hvdlike-run: --output-filename is not applied under Open MPI's mpirun, "
                         "whose own option lays files out differently; pass it in --mpi-args "
                         "(--mpi-args=\"--output-filename DIR\")\n")
        output_dir = None
    elif output_dir and dry_run:
        from .job import check_output_unmade

        check_output_unmade(output_dir, np, padded=False)  # MPICH's folders
    elif output_dir:
        sys.stderr.write(f"hvdlike-run: under MPICH's mpirun the ranks' output goes to "
                         f"{output_dir}/rank.N/stdout and stderr only\n")
        # Folders made and files checked as without --mpi (no link another user
        # planted, no folder of another user's); mpirun opens the files itself.
        from .job import check_output_files

        for rank in range(np):
            check_output_files(output_dir, rank)
    with tempfile.TemporaryDirectory(prefix="hvdlike-mpi-") as folder:
        wrapper = _write_ssh_wrapper(folder, ssh_args) if ssh_args and flavour == MPICH else None
        argv = mpirun_command(flavour, np, config.hosts, config.command, names,
                              ssh_args=ssh_args if flavour == OPEN_MPI else (),
                              ssh_wrapper=wrapper, extra=config.mpi_args,
                              as_root=as_root,
                              mpirun=mpirun, output_dir=output_dir)
        if dry_run or config.verbose:
            verbose(shlex.join(argv))
        if dry_run:
            return 0
        received = []

        def forward(signum, _frame) -> None:
            received.append(signum)
            proc.send_signal(signal.SIGTERM)

        proc = subprocess.Popen(argv, env=dict(env), cwd=config.cwd,
                                preexec_fn=_parent_death_signal() if sys.platform == "linux"
                                else None)
        previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
        try:
            code = proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if received:
        name = signal.Signals(received[0]).name
        if say is not None:
            say(f"job interrupted ({name}); mpirun stopped every rank")
        return 128 + received[0]
    return 128 - code if code < 0 else code
