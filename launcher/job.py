"""One job from start to end: place ranks, check hosts, host the store, run, monitor.

:class:`Job` is shared by the CLI and ``hvdlike.run``. Used as a context manager
it prepares everything (placement, pre-flight, store); :meth:`Job.run` starts the
ranks and monitors them; leaving the context closes the store.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import stat
import sys
from typing import Dict, List, Optional

from hvdlike.core import config as core_config

from . import env as rank_env
from . import slurm
from .errors import LaunchError
from .hosts import RankPlacement, assign_ranks
from .launch_config import LaunchConfig
from .local_exec import helper_command
from .monitor import Output, RunResult, Worker, describe_exit, monitor, rank_folder
from .preflight import check_hosts, require_all_ok
from .remote import interpreter_hint, missing_interpreter
from .rendezvous import StoreServer, check_interfaces, choose_address, is_local, new_secret
from .ssh_exec import remote_helper_command, start_delay


def check_local_command(command: List[str], cwd: str, path: Optional[str]) -> None:
    """Fail early, in one line, when the command does not exist on this machine."""
    if not command:
        raise LaunchError("no command given: usage is hvdlike-run [options] command [args...]")
    program = command[0]
    if not program.strip():
        raise LaunchError(f"the command is an empty string ({program!r})")
    if os.sep in program:
        full = os.path.join(cwd, program)
        if os.path.isdir(full):
            raise LaunchError(f"the command {program} is a directory")
        if not os.path.isfile(full):
            raise LaunchError(f"command not found: {program}")
        if not os.access(full, os.X_OK):
            raise LaunchError(f"command is not executable: {program}")
    else:
        full = shutil.which(program, path=path)
        if full is None:
            raise LaunchError(f"command not found: {program}")
    interpreter = missing_interpreter(full)
    if interpreter:
        raise LaunchError(f"cannot run {program}: its interpreter {interpreter} (the '#!' "
                          f"line) does not exist{interpreter_hint(interpreter)}")


def interfaces_of(config: LaunchConfig) -> List[str]:
    """Every interface ``config`` names, the store's and Gloo's first."""
    names = list(config.network_interfaces)
    if config.network_interface and config.network_interface not in names:
        names.insert(0, config.network_interface)
    return names


def check_output_files(output_dir: str, rank: int, size: Optional[int] = None) -> None:
    """Create ``output_dir/rank.N/{stdout,stderr}`` (N padded as
    :func:`~.monitor.rank_folder` pads it among ``size`` ranks) as the rank's output will be
    written (see :mod:`hvdlike.core.output_file`): regular files only, no symbolic
    link followed at ``rank.N`` or the file, none another user planted in a
    sticky shared folder on the way -- something planted in a shared folder (a
    FIFO that would block the launcher, a link to a file of the user's) is
    refused by name."""
    from hvdlike.core.output_file import open_output_file

    folder = os.path.join(output_dir, rank_folder(rank, size))
    with _output_errors(output_dir):
        for stream in ("stdout", "stderr"):
            os.close(open_output_file(os.path.join(folder, stream), truncate=False,
                                      make_folders=True, own_names=2))


@contextlib.contextmanager
def _output_errors(output_dir: str):
    """An unsafe or unusable ``--output-filename`` path as a one-line LaunchError."""
    from hvdlike.core.output_file import UnsafeOutputPath

    try:
        yield
    except UnsafeOutputPath as exc:
        raise LaunchError(f"--output-filename {output_dir}: {exc}") from None
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise LaunchError(f"--output-filename {output_dir}: {exc.strerror or exc}{where}") \
            from None


def check_output_unmade(output_dir: str, np: int, padded: bool = True) -> None:
    """What a dry run checks of ``--output-filename`` without creating anything: the
    nearest existing folder on the way (a file there, a link another user controls),
    and any ``rank.N`` folder (``padded`` as :func:`~.monitor.rank_folder` pads it)
    and output file of ``np`` ranks already there, as :func:`check_output_files`
    would find them."""
    from hvdlike.core.output_file import open_output_file, output_folder

    with _output_errors(output_dir):
        existing = output_dir
        while existing and not os.path.lexists(existing):
            existing = os.path.dirname(existing.rstrip(os.sep))
        output_folder(existing or ".")
        if existing != output_dir:
            return
        for rank in range(np):
            folder = os.path.join(output_dir, rank_folder(rank, np if padded else None))
            if not os.path.lexists(folder):
                continue
            output_folder(folder, own_names=1)
            for stream in ("stdout", "stderr"):
                name = os.path.join(folder, stream)
                if os.path.lexists(name):
                    os.close(open_output_file(name, truncate=False, create=False, own_names=2))


def check_writable_file(path: str, cwd: str, what: str) -> None:
    """Fail early, in one line, when a rank on this machine could not create ``path``."""
    from hvdlike.core.output_file import UnsafeOutputPath, output_folder

    full = os.path.join(cwd, path)
    try:  # a link or folder on the way another user controls (the rank refuses it too)
        output_folder(os.path.dirname(full) or ".")
    except UnsafeOutputPath as exc:
        raise LaunchError(f"{what} {path}: {exc}") from None
    except OSError:
        pass  # a missing folder and the like: said below
    if os.path.islink(full):  # planted in a shared folder, it would make the job write there
        raise LaunchError(f"{what} {path}: is a symbolic link; refusing to follow it")
    if os.path.isdir(full):
        raise LaunchError(f"{what} {path}: is a directory")
    try:
        mode = os.stat(full).st_mode
    except OSError:
        mode = 0
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISBLK(mode):
        raise LaunchError(f"{what} {path}: is a FIFO, socket or block device, not a file")
    if stat.S_ISCHR(mode):  # /dev/null: the rank opens regular files only
        raise LaunchError(f"{what} {path}: is a character device, not a file")
    folder = os.path.dirname(full) or "."
    if not os.path.isdir(folder):
        raise LaunchError(f"{what} {path}: directory {folder} does not exist")
    if os.path.exists(full) and not os.access(full, os.W_OK) \
            or not os.path.exists(full) and not os.access(folder, os.W_OK | os.X_OK):
        raise LaunchError(f"{what} {path}: permission denied")
    if not os.path.exists(full):
        # Permission bits do not tell everything (root, read-only or special file
        # systems): create it, as the rank will, and leave nothing behind.
        try:
            os.close(os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            return
        except OSError as exc:
            raise LaunchError(f"{what} {path}: cannot be created: "
                              f"{exc.strerror or exc}") from None
        os.unlink(full)


def _named(field: str, environ) -> str:
    """The knob's flag and the variable that set it (``HOROVOD_*`` when that one did)."""
    knob = core_config.KNOBS_BY_FIELD[field]
    found = core_config.lookup(environ, knob)
    return f"{knob.flag} ({found[0] if found else knob.env})"


STORE_CONNECT_SECONDS = 5.0


class Job:
    """A prepared job; see the module docstring."""

    def __init__(self, config: LaunchConfig, output: Optional[Output] = None):
        self.config = config
        self.output = output or Output(timestamps=config.timestamps)
        self.placements: List[RankPlacement] = assign_ranks(config.hosts, config.np)
        self.local: Dict[str, bool] = {}
        for placement in self.placements:
            if placement.host not in self.local:
                self.local[placement.host] = is_local(placement.host)
        self.secret = new_secret()
        self.store: Optional[StoreServer] = None
        self.helper_scripts: Dict[str, Optional[str]] = {}  # remote host -> helper path
        self.srun: Optional[str] = None  # the srun executable, inside a Slurm allocation
        self.srun_binds = True  # whether its cluster can bind CPUs (--cpu-bind=none then)

    @property
    def remote_hosts(self) -> List[str]:
        return [host for host, local in self.local.items() if not local]

    def _verbose(self, text: str) -> None:
        if self.config.verbose:
            self.output.note(text)

    def check(self) -> None:
        """Check the command locally and every remote host over ssh.

        Raises:
            LaunchError: the command is missing here, or a host failed its probe.
        """
        cfg = self.config
        path = cfg.environ.get("PATH")
        self.check_here()
        if cfg.output_dir:  # after the checks above: a refused job leaves no folders
            for p in self.placements:
                check_output_files(cfg.output_dir, p.rank, len(self.placements))
        if self.remote_hosts and cfg.preflight and not cfg.use_srun:
            checks = check_hosts(self.remote_hosts, cfg.ssh, cfg.remote_python, cfg.cwd,
                                 cfg.command[0], path or "", cfg.start_timeout,
                                 verbose=lambda argv: self._verbose(f"pre-flight: {argv}"))
            require_all_ok(checks)
            self.helper_scripts = {check.host: check.helper for check in checks}

    def check_here(self) -> None:
        """What can be checked on this machine without creating or starting anything
        (all a dry run checks): the command, the files ranks here write, the ssh key,
        the network interfaces.

        Raises:
            LaunchError: naming the first problem.
        """
        cfg = self.config
        if not cfg.command or any(self.local.values()):
            check_local_command(cfg.command, cfg.cwd, cfg.environ.get("PATH"))
        self.check_rank_files()
        key = cfg.ssh.identity_file
        if self.remote_hosts and key and not cfg.use_srun and not os.path.isfile(
                os.path.join(cfg.cwd, os.path.expanduser(key))):
            # ssh would go on without it and fail later on a password prompt it cannot show
            raise LaunchError(f"-i/--ssh-identity-file {key}: no such file")
        check_interfaces(interfaces_of(cfg))
        if cfg.output_dir and cfg.dry_run:  # a real start creates and checks them
            check_output_unmade(cfg.output_dir, len(self.placements))
        self.note_thread_affinity()

    def note_thread_affinity(self) -> None:
        """Say once, before anything starts, when ``--thread-affinity`` names fewer
        cores than a host runs ranks: those ranks log an error and run unpinned."""
        from .launch_config import effective_settings

        cfg = self.config
        cores = effective_settings(cfg).thread_affinity
        if not cores or not self.placements:
            return
        count = len(cores.split(","))
        widest = max(self.placements, key=lambda p: p.topology.local_size)
        if count < widest.topology.local_size:
            self.output.note(f"{_named('thread_affinity', {**cfg.environ, **cfg.knob_env})} "
                             f"{cores!r} names {count} core(s), but host {widest.host} runs "
                             f"{widest.topology.local_size} ranks: no background thread "
                             f"there is pinned (give one core per local rank)")

    def check_rank_files(self) -> None:
        """The timeline and autotune log that ranks on this machine will write."""
        from hvdlike.core.timeline import configured_path

        from .launch_config import effective_settings

        cfg = self.config
        if cfg.use_srun:
            return
        settings = effective_settings(cfg)
        timeline = configured_path(settings.timeline)
        environ = {**cfg.environ, **cfg.knob_env}
        for p in self.placements:
            if not self.local[p.host]:
                continue
            if timeline and ("{rank}" in timeline or p.rank == 0):
                check_writable_file(timeline.replace("{rank}", str(p.rank)), cfg.cwd,
                                    _named("timeline", environ))
            if settings.autotune_log and not settings.autotune and p.rank == 0:
                self.output.note(f"{_named('autotune_log', environ)} is ignored without "
                                 "--autotune (HVDLIKE_AUTOTUNE=1)")
            if settings.autotune and settings.autotune_log and p.rank == 0:
                check_writable_file(settings.autotune_log, cfg.cwd,
                                    _named("autotune_log", environ))

    def __enter__(self) -> "Job":
        self.check()
        addr = choose_address(self.remote_hosts, self.config.network_interface)
        # The launcher's own connection to its store: not subject to a --start-timeout
        # too short to connect at all (the ranks still get what was asked).
        self.store = StoreServer(addr, len(self.placements), self.secret,
                                 max(self.config.start_timeout, STORE_CONNECT_SECONDS)).__enter__()
        self._verbose(f"rendezvous store listening on {addr}:{self.store.port}")
        return self

    def __exit__(self, *exc_info) -> None:
        if self.store is not None:
            self.store.__exit__(*exc_info)
            self.store = None
        if any(self.local.values()):
            # Ranks unlink their shared memory as soon as all have mapped it; only
            # ranks killed during that moment leave a name, and it carries the job's tag.
            from hvdlike.core.shm_segment import job_tag, sweep

            sweep(job_tag(self.secret))

    def launch_argv(self, placement: RankPlacement) -> List[str]:
        """The local command that starts the helper of one rank."""
        if self.config.use_srun:
            if self.srun is None:
                self.srun = slurm.find_srun(self.config.environ)
                self.srun_binds = slurm.binds_cpus(self.srun, self.config.environ)
            return slurm.srun_command(placement.host, helper_command(self.config.remote_python),
                                      self.srun, cpu_bind=self.srun_binds)
        if self.local[placement.host]:
            return helper_command()
        return remote_helper_command(placement.host, self.config.ssh, self.config.remote_python,
                                     self.helper_scripts.get(placement.host))

    def rank_spec(self, placement: RankPlacement, addr: str, port: int) -> dict:
        """The description the helper receives on stdin (command, cwd, environment)."""
        cfg = self.config
        if cfg.use_srun:
            base = slurm.rank_base_environment(cfg.environ)
        else:
            base = rank_env.base_environment(cfg.environ, not self.local[placement.host])
        env = rank_env.rank_environment(base, placement, addr, port, self.secret,
                                        cfg.network_interface, cfg.knob_env,
                                        rank_env.library_defaults(interfaces_of(cfg),
                                                                  cfg.tcp))
        return {"argv": cfg.command, "cwd": cfg.cwd, "env": env, "grace": cfg.grace_seconds}

    def _how(self, host: str) -> str:
        if self.config.use_srun:
            return "srun"
        return "local" if self.local[host] else "ssh"

    def describe(self, addr: str = "<store-addr>", port: int = 0) -> str:
        """What would run, one block per rank (the job secret hidden)."""
        lines = []
        for p in self.placements:
            t = p.topology
            spec = self.rank_spec(p, addr, port)
            job_vars = {k: v for k, v in rank_env.redact(spec["env"]).items()
                        if k.startswith("HVDLIKE_")}
            lines.append(
                f"rank {t.rank} on {p.host} ({self._how(p.host)}; "
                f"local_rank {t.local_rank}/{t.local_size}, cross_rank {t.cross_rank}/{t.cross_size})"
            )
            lines.append("    start:   " + shlex.join(self.launch_argv(p)))
            lines.append("    command: " + shlex.join(spec["argv"]) + f"  (in {spec['cwd']})")
            lines.append("    env:     " + " ".join(f"{k}={v}" for k, v in sorted(job_vars.items())))
        return "\n".join(lines)

    def run(self) -> RunResult:
        """Start every rank, forward output, stop everything on failure; return the result."""
        if self.store is None:
            raise RuntimeError("Job.run() needs the job to be entered (with Job(...) as job)")
        addr, port = self.store.endpoint()
        if self.config.verbose:
            self.output.note("launching:\n" + self.describe(addr, port))
        workers = []
        for p in self.placements:
            worker = Worker(p, self.launch_argv(p), self.rank_spec(p, addr, port),
                            remote=not self.local[p.host] and not self.config.use_srun,
                            output=self.output,
                            log_dir=self.config.output_dir)
            if worker.remote:
                worker.start_delay = start_delay(p.topology.local_rank)
            workers.append(worker)
        return monitor(workers, self.output, self.config.grace_seconds,
                       on_exit=self._exit_reporter())

    def _exit_reporter(self):
        """Records each rank's end in the store (``health.exited_key``), so ranks
        still waiting for it -- to start, or in a later ``init()`` -- fail at once
        naming it instead of waiting out their timeout. Elastic jobs report
        through their driver instead."""
        from hvdlike.core.health import exited_key

        store = []

        def report(worker: Worker) -> None:
            try:
                if not store:
                    store.append(self.store.client())
                store[0].set(exited_key(worker.rank),
                             f"{describe_exit(worker.exit_code, worker.remote)} "
                             "(seen by hvdlike-run)")
            except Exception as exc:  # the ranks' own timeouts still end their waits
                self._verbose(f"could not record rank {worker.rank}'s exit in the store: "
                              f"{exc}")

        return report


def print_dry_run(job: Job, stream=None) -> None:
    """Print what ``job`` would run without starting anything."""
    stream = stream or sys.stdout
    stream.write(job.describe() + "\n")
