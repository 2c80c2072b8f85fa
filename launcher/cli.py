"""hvdlike-run: start a data-parallel job on one or many hosts.

Usage::

    hvdlike-run -np 4 python train.py                      # 4 ranks on this machine
    hvdlike-run -np 8 -H host1:4,host2:4 python train.py   # 2 hosts over ssh
    hvdlike-run --hostfile hosts.txt python train.py       # every slot of a hostfile
    hvdlike-run --mpi -np 8 -H host1:4,host2:4 python train.py   # hand over to mpirun

Hosts and slots
    ``-H host1:4,host2:4`` (``host`` alone is one slot; ``user@host`` and
    ``[ipv6]:N`` work) or ``--hostfile F`` with one ``host slots=N`` per line
    (``#`` comments and blank lines ignored). Without either: ``localhost:np``.
    ``-np`` defaults to every slot. Ranks fill hosts in order.

What each rank gets
    Its command runs in the launcher's working directory with the launcher's
    environment (remote hosts: minus host-specific variables such as
    ``HOSTNAME``, ``SSH_*``, ``DISPLAY``), plus ``HVDLIKE_RANK``, ``HVDLIKE_SIZE``,
    ``HVDLIKE_LOCAL_RANK``, ``HVDLIKE_LOCAL_SIZE``, ``HVDLIKE_CROSS_RANK``,
    ``HVDLIKE_CROSS_SIZE``, ``HVDLIKE_HOSTNAME``, ``HVDLIKE_STORE_ADDR``,
    ``HVDLIKE_STORE_PORT``, ``HVDLIKE_JOB_SECRET``, ``HVDLIKE_LAUNCHER`` and, with
    ``--network-interface``, ``HVDLIKE_GLOO_IFACE``; knob flags become their
    ``HVDLIKE_*`` variables. Unless already set: ``PYTHONUNBUFFERED=1``, with
    ``--tcp`` ``NCCL_IB_DISABLE=1``, with interfaces ``NCCL_SOCKET_IFNAME``. The
    environment travels over ssh's stdin: the job secret never appears on a
    command line.

Remote hosts
    Reached with OpenSSH in batch mode (keys, no prompts): ``-p`` port, ``-i``
    key, ``--ssh-option KEY=VALUE`` for anything else. Before starting, every
    remote host is probed in parallel (ssh works, hvdlike imports, the working
    directory and command exist) within ``--start-timeout``; failures are listed
    per host. The launcher hosts the rendezvous store on the address that routes
    to the hosts, or on ``--network-interface``'s address.

Inside a Slurm allocation
    Under ``salloc`` or in an ``sbatch`` script, without ``-H``/``--hostfile``,
    hosts and slots come from the allocation (``SLURM_JOB_NODELIST``,
    ``SLURM_TASKS_PER_NODE`` or ``SLURM_JOB_CPUS_PER_NODE``) and every rank is a
    one-task job step started with ``srun`` instead of ssh. ``--mpi`` hands the
    same hosts to mpirun.

Output
    Every line is prefixed ``[rank]<stdout>:`` or ``[rank]<stderr>:`` and goes to
    the launcher's stdout or stderr respectively. ``--output-filename DIR`` also
    writes ``DIR/rank.N/stdout`` and ``DIR/rank.N/stderr`` (N zero-padded to a common
    width, as horovodrun does). ``--verbose`` prints
    the exact commands; ``--dry-run`` prints them without running anything.

Failure
    When a rank exits non-zero or dies, every other rank on every host gets
    SIGTERM, then SIGKILL after ``--grace-period-seconds``; the launcher prints
    which rank failed, on which host, how (exit code or signal) and the last
    lines of its stderr, and exits with the rank's exit code (128+N for signal
    N). Ctrl-C, SIGTERM or SIGHUP on the launcher stops every rank the same
    way (a second Ctrl-C kills at once) and exits with 130 / 143 / 129; so
    does a closed
    stdout (``hvdlike-run ... | head``), with 141. If the launcher
    itself is killed, ranks notice their closed stdin and stop: nothing is left
    behind. Bad input (malformed hosts, ``-np`` out of range, unknown flag,
    missing command, unreachable host) ends with a one-line reason and exit
    status 2.

Elastic jobs
    ``--min-np``, ``--max-np`` or ``--host-discovery-script`` make the job
    elastic: a failed rank's host is blacklisted and the survivors re-form
    without it; hosts the script adds (up to ``--max-np``) get new ranks. See
    docs/elastic.md for ``--slots-per-host``, ``--reset-limit``,
    ``--elastic-timeout`` and ``--blacklist-cooldown-range``.

Exit status
    0 all ranks succeeded; the failed rank's status; 2 bad input; 130/143/129
    interrupted; 141 the launcher's stdout was closed.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import List, NoReturn, Optional, Sequence

from hvdlike.core import config as core_config

from .errors import LaunchError
from .hosts import MAX_RANKS
from .run_args import check_discovery_script, check_ssh_option
from .launch_config import (
    LaunchConfig,
    SshOptions,
    effective_settings,
    knob_environment,
    resolve_hosts,
)

USAGE_ERROR = 2
PROG = "hvdlike-run"


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("hvdlike")
    except Exception:  # not installed as a distribution
        return "unknown"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{PROG}: error: {message} (see {PROG} --help)\n")
        sys.exit(USAGE_ERROR)


def _integer(text: str) -> int:
    try:
        return core_config.strict_int(text)  # not '2_0' (20) or other scripts' digits
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _rank_count(text: str) -> int:
    """A number of ranks; below 1 is refused downstream with the flag's own message."""
    value = _integer(text)
    if value > MAX_RANKS:
        raise argparse.ArgumentTypeError(f"{text!r} is more than the limit of {MAX_RANKS}")
    return value


def _port(text: str) -> int:
    value = _integer(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1-65535)")
    return value


def _seconds(text: str) -> float:
    try:
        value = core_config.strict_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if value != value or value == math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    if value > core_config.MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text!r} must be at most {core_config.MAX_SECONDS:g}")
    return value


class _Interfaces(argparse.Action):
    """``--network-interface(s)``: comma-separated names, every use adding to one list
    (each name once, in the order given), as horovodrun takes them."""

    def __call__(self, parser, namespace, values, option_string=None):
        names = list(getattr(namespace, self.dest, None) or [])
        given = [n.strip() for n in values.split(",") if n.strip()]
        if not given:  # refused by to_config, with the other empty values
            setattr(namespace, "empty_interface_flag", option_string)
        names += [n for n in given if n not in names]
        setattr(namespace, self.dest, names)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; knob flags come from :data:`hvdlike.core.config.KNOBS`."""
    parser = _Parser(
        prog=PROG, allow_abbrev=False,
        usage=f"{PROG} [options] command [args...]",
        description="Start a Horovod-style data-parallel job (see docs/launcher.md).",
    )
    add = parser.add_argument
    add("-np", "--num-proc", dest="np", type=_rank_count, metavar="N",
        help="number of ranks (default: every slot)")
    add("-H", "--hosts", metavar="HOST:SLOTS,...", help="hosts and slots, e.g. h1:4,h2:4")
    add("-hostfile", "--hostfile", metavar="FILE", help="file of 'host slots=N' lines")
    add("-p", "--ssh-port", type=_port, metavar="PORT", help="ssh port of remote hosts")
    add("-i", "--ssh-identity-file", metavar="FILE", help="ssh private key")
    add("--ssh-option", action="append", default=[], metavar="KEY=VALUE",
        help="extra ssh -o option (repeatable)")
    add("--network-interface", "--network-interfaces", dest="network_interfaces",
        action=_Interfaces, metavar="IFACE[,IFACE...]",
        help="interfaces to use (comma-separated, repeatable): the first carries the "
             "rendezvous store and Gloo, all of them NCCL (NCCL_SOCKET_IFNAME) "
             "(default: the one routing to the hosts)")
    add("--remote-python", metavar="PATH", default=sys.executable,
        help="Python on remote hosts (default: this launcher's interpreter path)")
    add("--output-filename", metavar="DIR", help="also write DIR/rank.N/{stdout,stderr}")
    add("-prefix-timestamp", "--prefix-output-with-timestamp", action="store_true",
        help="start every forwarded output line with the time")
    add("--grace-period-seconds", type=_seconds, default=5.0, metavar="S",
        help="time between SIGTERM and SIGKILL when stopping ranks (default 5)")
    add("--skip-preflight", action="store_true", help="do not probe remote hosts first")
    add("--verbose", action="store_true", help="print the exact commands run")
    add("--dry-run", action="store_true", help="print what would run, run nothing")
    add("-cb", "--check-build", action="store_true",
        help="show available frameworks and backends")
    add("--mpi", action="store_true", help="launch with mpirun (Open MPI or MPICH)")
    add("--gloo", action="store_true",
        help="launch with hvdlike's own launcher (the default; accepted as in Horovod)")
    add("--mpi-args", default="", metavar="ARGS",
        help='extra mpirun arguments as one string; write --mpi-args="-x ..." when it starts with -')
    add("--binding-args", default="", metavar="ARGS",
        help="process binding arguments for mpirun (--mpi only), e.g. '--bind-to core'")
    add("--tcp", action="store_true",
        help="TCP only: NCCL_IB_DISABLE=1 for NCCL (hvdlike's own traffic is TCP already)")
    add("--disable-cache", action="store_true",
        help="accepted as in Horovod, where it turns off the launcher's cache of host "
             "checks; hvdlike-run keeps no such cache, so it changes nothing (the response "
             "cache is --cache-capacity 0)")
    add("--jsrun", action="store_true", help=argparse.SUPPRESS)
    add("--config-file", metavar="FILE",
        help="Horovod-style YAML file of settings; flags on the command line win")
    add("-v", "--version", action="version", version=f"{PROG} {_version()}")
    elastic = parser.add_argument_group("elastic jobs (see docs/elastic.md)")
    elastic.add_argument("--min-np", "--min-num-proc", type=_rank_count, metavar="N",
                         help="fewest ranks the job runs with (default: -np)")
    elastic.add_argument("--max-np", "--max-num-proc", type=_rank_count, metavar="N",
                         help="most ranks the job grows to (default: every usable slot)")
    elastic.add_argument("--host-discovery-script", metavar="SCRIPT",
                         help="executable printing one host[:slots] per line; re-run every second")
    elastic.add_argument("--slots-per-host", type=_rank_count, metavar="N",
                         help="slots of a discovered host that names none (default 1)")
    elastic.add_argument("--reset-limit", type=_integer, metavar="N",
                         help="fail once the job would re-form more than N times")
    elastic.add_argument("--elastic-timeout", type=_seconds, metavar="S",
                         help="fail after S seconds below --min-np (default 600)")
    elastic.add_argument("--blacklist-cooldown-range", type=_seconds, nargs=2,
                         metavar=("LO", "HI"),
                         help="a failed host may return after a random LO..HI seconds "
                              "(default: never)")
    knobs = parser.add_argument_group("runtime knobs (each sets the HVDLIKE_* variable shown)")
    for knob in core_config.KNOBS:
        if not knob.flag:
            continue
        if knob.default is True:  # on by default: the flag turns it off
            knobs.add_argument(knob.flag, dest=f"knob_{knob.field}", action="store_const",
                               const="0", default=None, help=f"{knob.help} ({knob.env}=0)")
        elif knob.default is None and knob.parse is core_config.auto_bool:
            # auto by default: the flag forces it on, its --no- form off
            knobs.add_argument(knob.flag, dest=f"knob_{knob.field}", action="store_const",
                               const="1", default=None, help=f"{knob.help} ({knob.env}=1)")
            knobs.add_argument("--no-" + knob.flag[2:], dest=f"knob_{knob.field}",
                               action="store_const", const="0", default=None,
                               help=f"never: {knob.env}=0")
        elif isinstance(knob.default, bool):
            knobs.add_argument(knob.flag, dest=f"knob_{knob.field}", action="store_true",
                               default=None, help=f"{knob.help} ({knob.env}=1)")
        else:
            target = f"{knob.env} = VALUE x {knob.flag_scale:.12g}" if knob.flag_scale else knob.env
            knobs.add_argument(knob.flag, dest=f"knob_{knob.field}", metavar="VALUE",
                               help=f"{knob.help} ({target})")
    for flag, field, value, text in _KNOB_ALIASES:
        knobs.add_argument(flag, dest=f"knob_{field}", action="store_const", const=value,
                           default=None, help=text)
    add("command", nargs=argparse.REMAINDER, help="the program each rank runs, and its arguments")
    return parser


# Horovod's other spellings of knob flags: (flag, knob field, variable value, help).
_KNOB_ALIASES = (
    ("--no-autotune", "autotune", "0", "do not autotune (HVDLIKE_AUTOTUNE=0)"),
    ("--no-timeline-mark-cycles", "timeline_mark_cycles", "0",
     "do not mark cycles in the timeline (HVDLIKE_TIMELINE_MARK_CYCLES=0)"),
    ("--stall-check", "stall_check_disable", "0",
     "keep the stall inspector on (HVDLIKE_STALL_CHECK_DISABLE=0)"),
    ("--log-without-timestamp", "log_hide_time", "1", "same as --log-hide-timestamp"),
    ("--log-with-timestamp", "log_hide_time", "0",
     "put the time in hvdlike's log lines (HVDLIKE_LOG_HIDE_TIME=0, the default)"),
    ("--no-log-hide-timestamp", "log_hide_time", "0", "same as --log-with-timestamp"),
    ("--no-mpi-threads-disable", "mpi_threads_disable", "0",
     "MPI with thread support (HVDLIKE_MPI_THREADS_DISABLE=0, the default)"),
    ("--no-torus-allreduce", "torus_allreduce", "0", "HVDLIKE_TORUS_ALLREDUCE=0"),
)


def to_config(args: argparse.Namespace) -> LaunchConfig:
    """Turn parsed flags into a :class:`LaunchConfig`.

    Raises:
        LaunchError: a value is invalid.
    """
    import shlex

    if args.mpi and args.gloo:
        raise LaunchError("--mpi and --gloo cannot be used together")
    if args.jsrun:
        raise LaunchError("--jsrun (IBM Spectrum LSF) is not supported: inside an LSF "
                          "allocation start the job with --mpi or with -H and the "
                          "allocation's hosts")
    if getattr(args, "empty_interface_flag", None):
        raise LaunchError(f"{args.empty_interface_flag} is empty")
    interfaces = list(args.network_interfaces or [])
    if args.binding_args.strip() and not args.mpi:
        sys.stderr.write("hvdlike-run: --binding-args applies to --mpi launches only; "
                         "ignored\n")
    if args.prefix_output_with_timestamp and args.mpi:
        sys.stderr.write("hvdlike-run: --prefix-output-with-timestamp applies to hvdlike-run's "
                         "own launch; under --mpi use mpirun's option (Open MPI: "
                         "--mpi-args=--timestamp-output)\n")
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if args.hosts is not None and not args.hosts.strip():
        raise LaunchError("-H/--hosts is empty")
    for flag, value in (("--hostfile", args.hostfile), ("--output-filename", args.output_filename),
                        ("-i/--ssh-identity-file", args.ssh_identity_file),
                        ("--remote-python", args.remote_python),
                        ("--host-discovery-script", args.host_discovery_script)):
        if value is not None and not value.strip():
            raise LaunchError(f"{flag} is empty")
    check_discovery_script(args.host_discovery_script, "--host-discovery-script")
    try:
        mpi_args = shlex.split(args.mpi_args)
    except ValueError as exc:  # e.g. an unbalanced quote
        raise LaunchError(f"--mpi-args {args.mpi_args!r} is not valid: {exc}") from None
    if mpi_args and not args.mpi:
        sys.stderr.write("hvdlike-run: --mpi-args applies to --mpi launches only; ignored\n")
    try:
        mpi_args += shlex.split(args.binding_args) if args.mpi else []
    except ValueError as exc:
        raise LaunchError(f"--binding-args {args.binding_args!r} is not valid: {exc}") from None
    knob_values = {name[len("knob_"):]: value for name, value in vars(args).items()
                   if name.startswith("knob_")}
    import os

    from . import slurm

    elastic = any(flag is not None
                  for flag in (args.min_np, args.max_np, args.host_discovery_script))
    allocated = (None if elastic
                 else slurm.hosts_if_allocated(os.environ, args.hosts, args.hostfile))
    if (elastic and args.hosts is None
            and not args.hostfile and not args.host_discovery_script
            and slurm.in_allocation(os.environ)):
        # Elastic jobs start ranks over ssh or locally, never as srun steps.
        sys.stderr.write(
            f"hvdlike-run: elastic flags inside Slurm job {os.environ.get('SLURM_JOB_ID')}: "
            "the allocation's hosts are not used; pass -H/--hostfile or "
            "--host-discovery-script to run on them (now: this host only)\n")
    if (allocated is None and args.np is None and args.min_np is None and not args.hosts
            and not args.hostfile and not args.host_discovery_script
            and slurm.why_not_allocated(os.environ)):
        raise LaunchError("-np is required when no -H/--hosts or --hostfile is given; the "
                          "Slurm allocation's hosts are not used: "
                          + slurm.why_not_allocated(os.environ))
    config = LaunchConfig(
        command=command,
        hosts=([] if args.host_discovery_script
               else allocated or resolve_hosts(args.hosts, args.hostfile,
                                               args.np if args.np is not None else args.min_np)),
        np=args.np,
        ssh=SshOptions(port=args.ssh_port, identity_file=args.ssh_identity_file,
                       options=list(args.ssh_option)),
        network_interface=interfaces[0] if interfaces else "",
        network_interfaces=interfaces,
        tcp=args.tcp,
        knob_env=knob_environment(knob_values),
        grace_seconds=args.grace_period_seconds,
        output_dir=args.output_filename,
        verbose=args.verbose,
        dry_run=args.dry_run,
        preflight=not args.skip_preflight,
        use_mpi=args.mpi,
        use_srun=bool(allocated) and not args.mpi,
        mpi_args=mpi_args,
        remote_python=args.remote_python,
        timestamps=args.prefix_output_with_timestamp,
    )
    from .elastic.launch import is_elastic, settings_from_flags

    if is_elastic(args.min_np, args.max_np, args.host_discovery_script):
        if args.mpi:
            raise LaunchError("--mpi cannot run an elastic job (--min-np/--max-np/"
                              "--host-discovery-script)")
        if args.host_discovery_script and (args.hosts or args.hostfile):
            raise LaunchError("--host-discovery-script and -H/--hostfile cannot be used together")
        config.elastic = settings_from_flags(
            args.np, args.min_np, args.max_np, args.host_discovery_script, args.slots_per_host,
            args.reset_limit, args.elastic_timeout, args.blacklist_cooldown_range)
    else:
        for flag, value in (("--slots-per-host", args.slots_per_host),
                            ("--reset-limit", args.reset_limit),
                            ("--elastic-timeout", args.elastic_timeout),
                            ("--blacklist-cooldown-range", args.blacklist_cooldown_range)):
            if value is not None:
                raise LaunchError(f"{flag} needs an elastic job (--min-np, --max-np or "
                                  f"--host-discovery-script)")
    config.start_timeout = effective_settings(config).start_timeout
    config.ssh.connect_timeout = min(10.0, config.start_timeout)
    for option in config.ssh.options:
        check_ssh_option(option, "--ssh-option")
    return config


def _say(text: str) -> None:
    try:
        sys.stderr.write(f"{PROG}: {text}\n")
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):
        pass  # stderr is closed or its reader is gone: nobody to tell


def execute(config: LaunchConfig) -> int:
    """Run a job described by ``config``; return the launcher's exit status."""
    from .hosts import assign_ranks
    from .job import Job, print_dry_run
    from .monitor import failure_summary

    if not config.command:
        raise LaunchError(f"no command given: usage is {PROG} [options] command [args...]")
    if config.use_mpi:
        from .mpi_exec import run_with_mpirun

        np = len(assign_ranks(config.hosts, config.np))
        from .job import check_local_command
        from .rendezvous import is_local

        if all(is_local(h.host) for h in config.hosts):
            check_local_command(config.command, config.cwd, config.environ.get("PATH"))
            Job(config).check_rank_files()  # the timeline and autotune log, as without --mpi
        Job(config).note_thread_affinity()
        return run_with_mpirun(config, np, dry_run=config.dry_run, verbose=print, say=_say)
    if config.elastic is not None:
        from .elastic.launch import run_elastic

        return run_elastic(config, config.elastic, _say)
    job = Job(config)
    if config.use_srun and (config.verbose or config.dry_run):
        from .slurm import describe

        _say(describe(config.environ, config.hosts))
    if config.dry_run:
        job.check_here()  # what a run would refuse before starting, a dry run refuses too
        print_dry_run(job)
        return 0
    with job:
        result = job.run()
    if result.failure is not None:
        _say("job failed: " + failure_summary(result.failure).replace("\n", f"\n{PROG}: "))
    elif result.interrupted:
        _say(f"job interrupted ({result.interrupted}); every rank was stopped")
    return result.exit_code


def with_config_file(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     argv: List[str]) -> argparse.Namespace:
    """``--config-file``: the file's settings as flags before the command line's own,
    so every flag given on the command line wins (as with horovodrun).

    Raises:
        LaunchError: the file is unreadable or holds a bad setting.
    """
    from . import config_file

    if not args.config_file.strip():
        raise LaunchError("--config-file is empty")
    tokens = config_file.to_flags(args.config_file)
    if args.mpi or args.gloo:  # the command line chose the launcher: the file's choice yields
        tokens = [t for t in tokens if t not in ("--mpi", "--gloo")]
    return parser.parse_args(tokens + argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``hvdlike-run``; returns the exit status."""
    try:
        parser = build_parser()
        argv = list(sys.argv[1:] if argv is None else argv)
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        _say("interrupted")
        return 130
    try:
        if args.config_file is not None:
            args = with_config_file(parser, args, argv)
        if args.check_build:
            from .check_build import report

            sys.stdout.write(report(_version()))
            return 0
        return execute(to_config(args))
    except LaunchError as exc:
        _say(f"error: {exc}")
        return USAGE_ERROR
    except KeyboardInterrupt:
        _say("interrupted")
        return 130
    except Exception as exc:  # a bug, not bad input: one line, the traceback on request
        if args.verbose:
            import traceback

            traceback.print_exc()
        _say(f"internal error: {type(exc).__name__}: {exc} (--verbose shows the traceback)")
        return 1


if __name__ == "__main__":
    sys.exit(main())
