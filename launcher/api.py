"""``hvdlike.run(fn)``: run a Python function on every rank and collect the results.

The function, its arguments and keyword arguments are pickled with cloudpickle,
sealed with an HMAC under the job secret (see :mod:`.payload`) and put in the
job's store; every rank runs ``python -m hvdlike.launcher.task``, which refuses
anything that does not authenticate. Ranks run exactly as under
``hvdlike-run`` (same hosts, ssh, output prefixes, failure handling), so ``fn``
may call ``hvdlike.torch.init()`` and use collectives.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import threading
from typing import (
    Any, Callable, Dict, Iterator, List, Mapping, NoReturn, Optional, Sequence, Tuple, Union,
)

from hvdlike.core import config as core_config
from hvdlike.core.errors import HvdlikeError

from . import run_args
from .errors import LaunchError
from .hosts import HostSlots, assign_ranks
from .job import Job
from .launch_config import LaunchConfig, SshOptions, current_directory, effective_settings
from .monitor import describe_exit
from .task import LOADING_ENV
from .payload import (
    EXCEPTION_PICKLE, MAX_BLOB_BYTES, PAYLOAD_KEY, VALUE_PICKLE, PayloadError, get, put,
    refusal_key, refusal_purpose, result_key, result_purpose, seal, unseal, verify,
)

TASK_MODULE = "hvdlike.launcher.task"


class RankError(HvdlikeError):
    """``fn`` raised on a rank, or a rank ended without a result.

    Attributes:
        rank: the rank that failed.
        host: its host.
        remote_traceback: the traceback printed on that rank ('' if it died).
    """

    def __init__(self, message: str, rank: int, host: str, remote_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.host = host
        self.remote_traceback = remote_traceback


def _current_directory() -> str:
    """The caller's working directory, where the ranks start (see
    :func:`~.launch_config.current_directory`)."""
    try:
        return current_directory()
    except LaunchError as exc:
        raise LaunchError(f"hvdlike.run: {exc}") from None


def _rank_pythonpath(cwd: str, pythonpath: str) -> str:
    """``PYTHONPATH`` for the ranks: the caller's own import directories (not the
    interpreter's) in the caller's ``sys.path`` order, then the entries of
    ``pythonpath`` (what the ranks would get otherwise) not already listed.

    cloudpickle ships functions of importable modules by reference; ranks must
    import those modules from where the caller did, so the caller's directories
    (its script's, and its own ``PYTHONPATH``'s in their place) come first.
    """
    def real(entry: str) -> str:
        return os.path.realpath(os.path.join(cwd, entry))

    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    given = [entry for entry in pythonpath.split(os.pathsep) if entry]
    given_real = {real(entry) for entry in given}
    chosen: Dict[str, str] = {}
    for entry in sys.path:
        if not isinstance(entry, str):
            continue
        path = real(entry)
        interpreter = any(path == p or path.startswith(p + os.sep) for p in prefixes)
        if path in given_real or (os.path.isdir(path) and not interpreter):
            chosen.setdefault(path, path)
    for entry in given:  # not on the caller's sys.path: a missing directory, a zip, env's own
        chosen.setdefault(real(entry), entry)
    return os.pathsep.join(chosen.values())


def _check_call(fn, args, kwargs):
    """``(fn, args, kwargs)`` checked, as they will be shipped."""
    if not callable(fn):
        raise TypeError(f"hvdlike.run: fn must be callable, got {type(fn).__name__}")
    if isinstance(args, (str, bytes)) or not hasattr(args, "__iter__"):
        raise TypeError(f"hvdlike.run: args must be a tuple or list of positional arguments, "
                        f"got {type(args).__name__}")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"hvdlike.run: kwargs must be a mapping of keyword arguments, got "
                        f"{type(kwargs).__name__}")
    bad = [k for k in kwargs if not isinstance(k, str)]
    if bad:
        raise TypeError(f"hvdlike.run: kwargs keys must be str, got {bad[0]!r}")
    return fn, tuple(args), dict(kwargs)


def _sealed_payload(secret: str, fn, args, kwargs) -> bytes:
    """The sealed payload, or a ``TypeError`` naming the part that cannot be pickled."""
    try:
        blob = seal(secret, "payload", (fn, args, kwargs))
    except Exception as exc:
        import cloudpickle

        parts = [("fn", fn)] + [(f"args[{i}]", a) for i, a in enumerate(args)] \
            + [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
        culprit = "fn, args or kwargs"
        for label, value in parts:
            try:
                cloudpickle.dumps(value)
            except Exception:
                culprit = label
                break
        raise TypeError(f"hvdlike.run: {culprit} cannot be pickled to ship it to the ranks "
                        f"({type(exc).__name__}: {exc})") from exc
    if len(blob) > MAX_BLOB_BYTES:
        raise LaunchError(f"hvdlike.run: fn, args and kwargs pickle to {len(blob)} bytes, more "
                          f"than the {MAX_BLOB_BYTES} bytes hvdlike.run carries")
    return blob


def _check_env(env) -> Dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise TypeError(f"hvdlike.run: env must be a mapping of str to str, got "
                        f"{type(env).__name__}")
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"hvdlike.run: env must map str to str; {key!r} maps to "
                            f"{type(value).__name__} {value!r}")
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise ValueError(f"hvdlike.run: env has an invalid variable {key!r}={value!r}")
    return dict(env)


def _knob_env(knobs: Mapping[str, Any]) -> Dict[str, str]:
    """``HVDLIKE_*`` variables for ``knobs`` given by knob field, in the knob's own unit.

    ``True``/``False`` turn a boolean knob on or off (an automatic one too);
    every value is checked by the knob's parser, and an unknown field is refused.
    """
    env: Dict[str, str] = {}
    for field, value in knobs.items():
        knob = core_config.KNOBS_BY_FIELD.get(field)
        if knob is None:
            names = ", ".join(sorted(core_config.KNOBS_BY_FIELD))
            raise LaunchError(f"hvdlike.run: unknown knob {field!r}; knobs are: {names}")
        if value is None:
            continue
        if isinstance(value, bool) and not knob.on_off:
            raise LaunchError(f"hvdlike.run: knobs[{field!r}] = {value!r}: this knob takes "
                              f"a value, not on/off")
        text = ("1" if value else "0") if isinstance(value, bool) else str(value)
        try:
            knob.parse(text)
        except ValueError as exc:
            raise LaunchError(f"hvdlike.run: knobs[{field!r}] = {value!r} is not valid: "
                              f"expected {exc}") from None
        if not text.strip():
            raise LaunchError(f"hvdlike.run: knobs[{field!r}] is empty")
        env[knob.env] = text
    return env


def run(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    np: Optional[int] = None,
    hosts: Union[None, str, Sequence[HostSlots]] = None,
    ssh_port: Optional[int] = None,
    ssh_identity_file: Optional[str] = None,
    ssh_options: Sequence[str] = (),
    network_interface: str = "",
    env: Optional[Mapping[str, str]] = None,
    knobs: Optional[Mapping[str, Any]] = None,
    start_timeout: Optional[float] = None,
    verbose: bool = False,
    python: Optional[str] = None,
    *,
    num_proc: Optional[int] = None,
    min_num_proc: Optional[int] = None,
    max_num_proc: Optional[int] = None,
    min_np: Optional[int] = None,
    max_np: Optional[int] = None,
    slots: Optional[int] = None,
    reset_limit: Optional[int] = None,
    cooldown_range: Optional[Sequence[float]] = None,
    elastic_timeout: Optional[float] = None,
    hostfile: Optional[str] = None,
    host_discovery_script: Optional[str] = None,
    disable_cache: Optional[bool] = None,
    output_filename: Optional[str] = None,
    use_gloo: Optional[bool] = None,
    use_mpi: Optional[bool] = None,
    mpi_args: Union[None, str, Sequence[str]] = None,
    network_interfaces: Optional[Sequence[str]] = None,
    executable: Optional[str] = None,
) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``np`` ranks; return the results in rank order.

    Every argument of ``horovod.run`` is accepted under its Horovod name, with
    the meaning of the ``hvdlike-run`` flag of that name (see docs/launcher.md).

    Args:
        fn: the function; shipped with cloudpickle, so closures and lambdas work.
        args: positional arguments for ``fn`` (the same on every rank).
        kwargs: keyword arguments for ``fn``.
        np: number of ranks (Horovod's ``num_proc``; default: every slot of
            ``hosts``/``hostfile``, else 1 as in Horovod).
        hosts: ``"host1:2,host2:2"`` or a list of :class:`HostSlots` (checked as
            the string is); default ``localhost:np``.
        ssh_port: ssh port of remote hosts.
        ssh_identity_file: ssh private key.
        ssh_options: extra ``KEY=VALUE`` ssh options.
        network_interface: interface for the store and Gloo (a comma-separated
            list, and Horovod's ``network_interfaces`` list, are accepted too: the
            first carries the store and Gloo, all of them NCCL).
        env: extra environment variables for every rank.
        knobs: runtime knobs by field name, in the unit of their ``HVDLIKE_*``
            variable, e.g. ``{"cycle_time": 0.5, "fusion_threshold": 0, "shm": False}``.
        start_timeout: seconds hosts and ranks get to start (default: the
            ``start_timeout`` knob).
        verbose: print the commands run.
        python: interpreter that runs the ranks (Horovod's ``executable``).
        num_proc, min_num_proc, max_num_proc, slots, reset_limit, cooldown_range,
        elastic_timeout, hostfile, host_discovery_script, disable_cache,
        output_filename, use_gloo, use_mpi, mpi_args, network_interfaces,
        executable, min_np, max_np: as ``horovod.run`` and the ``hvdlike-run``
            flags of the same names. ``min_num_proc``, ``max_num_proc`` or
            ``host_discovery_script`` make the job elastic; ``use_mpi`` starts
            the ranks with ``mpirun``.

    Returns:
        ``[fn result on rank 0, rank 1, ...]``; for an elastic job, those of the
        newest generation every rank of which returned one (Horovod returns the
        first ``min_num_proc`` of them).

    Raises:
        RankError: ``fn`` raised on a rank (message names the rank, the exception's
            type and message and its remote traceback; ``__cause__`` is the
            exception when it unpickles in the caller), a rank's return value
            could not be unpickled in the caller (``__cause__`` says why), or a
            rank ended without a result.
        LaunchError: bad arguments, unreachable hosts, or a current directory
            that no longer exists.

    Example:
        >>> import hvdlike
        >>> hvdlike.run(lambda: __import__("os").environ["HVDLIKE_RANK"], np=2)
        ['0', '1']
    """
    if os.environ.get(LOADING_ENV):  # set by a rank loading its function (task.py)
        raise LaunchError(
            "hvdlike.run was called while a rank of another hvdlike.run job was loading its "
            "function: the module that defines the function calls hvdlike.run when it is "
            "imported; put that call under `if __name__ == \"__main__\":`")
    cwd = _current_directory()
    counts = run_args.horovod_arguments(num_proc, np, min_num_proc, min_np, max_num_proc,
                                        max_np, executable, python)
    np, python = counts["np"], counts["python"] or sys.executable
    fn, args, kwargs = _check_call(fn, args, kwargs)
    mpi = run_args.engine(use_gloo, use_mpi)
    environ = dict(os.environ)
    environ.update(_check_env(env))
    environ["PYTHONPATH"] = _rank_pythonpath(cwd, environ.get("PYTHONPATH", ""))
    knob_env = _knob_env(run_args.checked_knobs(knobs, disable_cache))
    discovery = run_args.text_arg(host_discovery_script, "host_discovery_script")
    run_args.check_discovery_script(discovery, "hvdlike.run: host_discovery_script")
    if discovery is not None and (hosts is not None or hostfile is not None):
        raise LaunchError("hvdlike.run: host_discovery_script and hosts/hostfile cannot be "
                          "used together")
    elastic = run_args.elastic_settings(np, counts["min_np"], counts["max_np"], discovery,
                                        run_args.count_arg(slots, "slots"), reset_limit,
                                        cooldown_range, elastic_timeout)
    if elastic is not None and mpi:
        raise LaunchError("hvdlike.run: use_mpi cannot run an elastic job (min_num_proc, "
                          "max_num_proc or host_discovery_script)")
    with run_args.api_terms():
        host_slots = ([] if discovery is not None else
                      run_args.host_list(hosts, hostfile, np if elastic is None else elastic.np))
        if np is None and elastic is None:
            np = run_args.slots_total(host_slots)
        if elastic is None:
            assign_ranks(host_slots, np)  # more ranks than slots: said before anything starts
    output_dir = run_args.text_arg(output_filename, "output_filename")
    nics = run_args.interfaces(network_interface, network_interfaces)
    extra_mpi = run_args.mpi_arguments(mpi_args)
    if extra_mpi and not mpi:
        sys.stderr.write("hvdlike.run: mpi_args applies with use_mpi=True only; ignored\n")
    config = LaunchConfig(
        command=[python, "-m", TASK_MODULE],
        hosts=host_slots,
        np=np if elastic is None else elastic.np,
        ssh=SshOptions(port=run_args.port_arg(ssh_port, "ssh_port"),
                       identity_file=run_args.text_arg(ssh_identity_file, "ssh_identity_file"),
                       options=run_args.ssh_option_list(ssh_options)),
        network_interface=nics[0] if nics else "",
        network_interfaces=nics,
        knob_env=knob_env,
        verbose=bool(verbose),
        output_dir=output_dir,
        use_mpi=mpi,
        mpi_args=extra_mpi if mpi else [],
        preflight=not mpi,
        remote_python=python,
        cwd=cwd,
        environ=environ,
        elastic=elastic,
    )
    config.start_timeout = (run_args.seconds_arg(start_timeout, "start_timeout")
                            if start_timeout is not None
                            else effective_settings(config).start_timeout)
    config.ssh.connect_timeout = min(10.0, config.start_timeout)
    if mpi:
        from .run_engines import run_under_mpirun

        return run_under_mpirun(config, fn, args, kwargs)
    if elastic is not None:
        from .run_engines import run_elastic_function

        return run_elastic_function(config, fn, args, kwargs)
    with shipped(config, fn, args, kwargs) as (job, store):
        result = job.run()
        if not result.interrupted:
            hosts = {p.rank: p.host for p in job.placements}
            outcomes = gather(job, store, list(hosts), None, hosts.__getitem__)
    if result.interrupted:
        interrupted(result.interrupted)
    return _collect(job, result, outcomes)


def interrupted(reason: str) -> NoReturn:
    """After a signal (or the output closing, ``reason``) stopped the job's ranks.

    SIGINT raises ``KeyboardInterrupt``, as in any Python program. SIGTERM and
    SIGHUP go on to the handler the caller had before ``run()`` (restored by
    now): the caller's own runs, or the default action ends the process with
    the signal's status, as it would have without ``run()``. Otherwise -- an
    ignored signal, a handler that returned, the output closed -- raises
    ``KeyboardInterrupt``.
    """
    number = getattr(signal, reason, None) if reason.startswith("SIG") else None
    if (number is not None and number != signal.SIGINT
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(number) not in (signal.SIG_IGN, None)):
        signal.raise_signal(number)
    raise KeyboardInterrupt(f"hvdlike.run interrupted ({reason})")


@contextlib.contextmanager
def shipped(config: LaunchConfig, fn, args, kwargs) -> Iterator[Tuple[Job, Any]]:
    """The job of ``config``, entered (its store up), holding ``fn``'s sealed payload;
    yields ``(job, store)``. The payload is sealed before anything starts, so what
    cannot be shipped is refused first."""
    with run_args.api_terms():
        job = Job(config)
    payload = _sealed_payload(job.secret, fn, args, kwargs)
    with contextlib.ExitStack() as stack:
        with run_args.api_terms():  # the checks before anything starts
            stack.enter_context(job)
        store = job.store.client(MAX_BLOB_BYTES)
        put(store, PAYLOAD_KEY, payload)
        del payload
        yield job, store


def gather(job: Job, store, ranks: List[int], generation: Optional[int],
           host_of: Callable[[int], str]) -> Dict[int, dict]:
    """The authenticated outcomes filed by ``ranks`` (of ``generation``); a blob that
    fails authentication is a :class:`RankError` and is never unpickled. An
    authentic one that does not unpickle here is a failed outcome saying so."""
    outcomes = {}
    for rank in ranks:
        key = result_key(rank, generation)
        if not store.check([key]):
            refused = _refusal(job, store, rank, generation, host_of)
            if refused is not None:
                outcomes[rank] = refused
            continue
        try:
            data = verify(job.secret, result_purpose(rank, generation), get(store, key))
        except (HvdlikeError, PayloadError) as exc:
            raise RankError(f"rank {rank} returned a result that failed authentication: "
                            f"{exc}", rank, host_of(rank)) from None
        outcomes[rank] = _opened(data)
        del data
    return outcomes


def _refusal(job: Job, store, rank: int, generation: Optional[int],
             host_of: Callable[[int], str]) -> Optional[dict]:
    """The failed outcome of a rank that recorded refusing its payload (task.py), or
    None when it recorded no refusal."""
    key = refusal_key(rank, generation)
    if not store.check([key]):
        return None
    try:
        reason = unseal(job.secret, refusal_purpose(rank, generation), get(store, key))
    except (HvdlikeError, PayloadError) as exc:
        raise RankError(f"rank {rank} recorded a refusal that failed authentication: {exc}",
                        rank, host_of(rank)) from None
    return {"ok": False, "type": "PayloadRefused", "message": str(reason), "traceback": "",
            "what": f"refused its payload: it failed authentication, so the job's store was "
                    f"tampered with; nothing was unpickled ({reason})"}


def _unpickled(data) -> Tuple[bool, Any]:
    """``(True, object)``, or ``(False, the exception unpickling raised)``."""
    try:
        return True, pickle.loads(data)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - whatever rebuilding it raises, name the rank
        return False, exc


def _not_rebuilt(what: str, exc: BaseException, host: Any = None) -> dict:
    """A failed outcome for a result the caller could not unpickle; the error
    unpickling raised (with the caller's traceback) becomes ``__cause__``."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001
        message = "<str() of the error failed>"
    return {"ok": False, "type": type(exc).__name__, "message": message, "traceback": "",
            "host": host, "exception": exc,
            "what": f"{what} that could not be unpickled on the caller's side "
                    f"({type(exc).__name__}: {message})"}


def _opened(data) -> dict:
    """The outcome in ``data`` (authentic), with its value and exception unpickled;
    what does not unpickle here becomes a failed outcome naming it."""
    ok, outcome = _unpickled(data)
    if not ok:
        return _not_rebuilt("filed a result", outcome)
    if not isinstance(outcome, dict) or not isinstance(outcome.get("ok"), bool):
        return _not_rebuilt("filed a result", TypeError(
            f"expected an outcome, got {type(outcome).__name__}"))
    if VALUE_PICKLE in outcome:
        ok, value = _unpickled(outcome.pop(VALUE_PICKLE))
        if not ok:
            return _not_rebuilt("returned a value", value, outcome.get("host"))
        outcome["value"] = value
    pickled = outcome.pop(EXCEPTION_PICKLE, None)
    if pickled is not None:  # the exception as __cause__ only when it is rebuilt here
        ok, exc = _unpickled(pickled)
        if ok and isinstance(exc, BaseException):
            outcome["exception"] = exc
    return outcome


# Errors a rank raises because another rank failed first.
CONSEQUENCES = ("HvdlikeInternalError", "HorovodInternalError")


def raise_outcome(rank: int, host: str, outcome: dict) -> None:
    """Raise the :class:`RankError` for a rank whose ``fn`` raised, or whose result
    could not be unpickled here (``outcome["what"]`` then says so)."""
    what = outcome.get("what") or f"raised {outcome['type']}: {outcome['message']}"
    error = RankError(f"rank {rank} (host {host}) {what}\n{outcome['traceback']}".rstrip(),
                      rank, host, outcome["traceback"])
    raise error from outcome.get("exception")


def first_cause(outcomes: Dict[int, dict], first: Optional[int] = None) -> Optional[int]:
    """The rank to blame among failed outcomes (None: none failed): one that raised
    something other than a consequence of another rank's failure, else any failed
    one; ``first`` (the rank the launcher saw fail first) before the others."""
    failed = sorted((rank != first, rank) for rank in outcomes if not outcomes[rank]["ok"])
    causes = [rank for _, rank in failed if outcomes[rank]["type"] not in CONSEQUENCES]
    return (causes or [rank for _, rank in failed] or [None])[0]


def _collect(job: Job, result, outcomes: Dict[int, dict]) -> List[Any]:
    blamed = first_cause(outcomes, result.failure.rank if result.failure is not None else None)
    # A rank that lost its peers raises HvdlikeInternalError ("rank 1 died ..."):
    # a consequence. Name the cause instead: a rank that raised something else,
    # else a rank that ended without any result.
    silent = [w for w in result.workers if w.rank not in outcomes]
    if blamed is not None and (outcomes[blamed]["type"] not in CONSEQUENCES or not silent):
        raise_outcome(blamed, job.placements[blamed].host, outcomes[blamed])
    failed = blamed is not None
    if failed or result.failure is not None or len(outcomes) < len(job.placements):
        if silent and (failed or result.failure is None or result.failure.rank in outcomes):
            worker = silent[0]
        else:
            worker = result.failure
        tail = "\n".join(worker.stderr_tail)
        what = f"{describe_exit(worker.exit_code or 0, worker.remote)} without a result"
        raise RankError(
            f"rank {worker.rank} (host {worker.host}) {what}"
            + (f"; last stderr lines:\n{tail}" if tail else ""),
            worker.rank, worker.host)
    return [outcomes[p.rank]["value"] for p in job.placements]


__all__ = ["run", "RankError", "LaunchError"]
