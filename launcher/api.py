"""``hvdlike.run(fn)``: run a Python function on every rank and collect the results.

The function, its arguments and keyword arguments are pickled with cloudpickle,
sealed with an HMAC under the job secret (see :mod:`.payload`) and put in the
job's store; every rank runs ``python -m hvdlike.launcher.task``, which refuses
anything that does not authenticate. Ranks run exactly as under
``hvdlike-run`` (same hosts, ssh, output prefixes, failure handling), so ``fn``
may call ``hvdlike.torch.init()`` and use collectives.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, List, Mapping, Optional, Sequence, Union

from hvdlike.core.errors import HvdlikeError

from .errors import LaunchError
from .hosts import HostSlots, parse_hosts
from .job import Job
from .launch_config import LaunchConfig, SshOptions, effective_settings, knob_environment
from .monitor import describe_exit
from .task import REFUSED
from .payload import MAX_BLOB_BYTES, PAYLOAD_KEY, PayloadError, result_key, seal, unseal

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


def _user_path() -> str:
    """The caller's own import directories (not the interpreter's), for unpickling ``fn``.

    cloudpickle ships functions of importable modules by reference; ranks must be
    able to import those modules too.
    """
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    mine = []
    for entry in sys.path:
        real = os.path.realpath(entry or os.getcwd())
        if os.path.isdir(real) and not any(real.startswith(p + os.sep) or real == p for p in prefixes):
            mine.append(real)
    return os.pathsep.join(dict.fromkeys(mine))


def _hosts(hosts: Union[None, str, Sequence[HostSlots]], np: int) -> List[HostSlots]:
    if hosts is None:
        return [HostSlots("localhost", np)]
    if isinstance(hosts, str):
        return parse_hosts(hosts)
    return list(hosts)


def run(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    np: int = 2,
    hosts: Union[None, str, Sequence[HostSlots]] = None,
    ssh_port: Optional[int] = None,
    ssh_identity_file: Optional[str] = None,
    ssh_options: Sequence[str] = (),
    network_interface: str = "",
    env: Optional[Mapping[str, str]] = None,
    knobs: Optional[Mapping[str, Any]] = None,
    start_timeout: Optional[float] = None,
    verbose: bool = False,
    python: str = sys.executable,
) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``np`` ranks; return the results in rank order.

    Args:
        fn: the function; shipped with cloudpickle, so closures and lambdas work.
        args: positional arguments for ``fn`` (the same on every rank).
        kwargs: keyword arguments for ``fn``.
        np: number of ranks.
        hosts: ``"host1:2,host2:2"`` or a list of :class:`HostSlots`; default
            ``localhost:np``.
        ssh_port: ssh port of remote hosts.
        ssh_identity_file: ssh private key.
        ssh_options: extra ``KEY=VALUE`` ssh options.
        network_interface: interface for the store and Gloo.
        env: extra environment variables for every rank.
        knobs: runtime knobs by field name, e.g. ``{"cycle_time": 0.5}``.
        start_timeout: seconds hosts and ranks get to start (default: the
            ``start_timeout`` knob).
        verbose: print the commands run.
        python: interpreter that runs the ranks.

    Returns:
        ``[fn result on rank 0, rank 1, ...]``.

    Raises:
        RankError: ``fn`` raised on a rank (message names the rank, the exception
            and its remote traceback; ``__cause__`` is the exception when it
            could be pickled), or a rank ended without a result.
        LaunchError: bad arguments or unreachable hosts.

    Example:
        >>> import hvdlike
        >>> hvdlike.run(lambda: __import__("os").environ["HVDLIKE_RANK"], np=2)
        ['0', '1']
    """
    if os.environ.get("HVDLIKE_RUN_LOADING"):  # see launcher/task.py
        raise LaunchError(
            "hvdlike.run was called while a rank of another hvdlike.run job was loading its "
            "function: the module that defines the function calls hvdlike.run when it is "
            "imported; put that call under `if __name__ == \"__main__\":`")
    environ = dict(os.environ)
    environ.update(env or {})
    environ.setdefault("PYTHONPATH", _user_path())
    config = LaunchConfig(
        command=[python, "-m", TASK_MODULE],
        hosts=_hosts(hosts, np),
        np=np,
        ssh=SshOptions(port=ssh_port, identity_file=ssh_identity_file,
                       options=list(ssh_options)),
        network_interface=network_interface,
        knob_env=knob_environment(dict(knobs or {})),
        verbose=verbose,
        remote_python=python,
        environ=environ,
    )
    config.start_timeout = start_timeout or effective_settings(config).start_timeout
    config.ssh.connect_timeout = min(10.0, config.start_timeout)
    job = Job(config)
    with job:
        store = job.store.client(MAX_BLOB_BYTES)
        store.set(PAYLOAD_KEY, seal(job.secret, "payload", (fn, tuple(args), dict(kwargs or {}))))
        result = job.run()
        outcomes = {}
        for placement in job.placements:
            key = result_key(placement.rank)
            if store.check([key]):
                try:
                    outcomes[placement.rank] = store.get(key)
                except HvdlikeError as exc:  # StoreTamperedError: never unpickled
                    raise RankError(f"rank {placement.rank} returned a result that failed "
                                    f"authentication: {exc}", placement.rank,
                                    placement.host) from None
    return _collect(job, result, outcomes)


def _collect(job: Job, result, blobs) -> List[Any]:
    if result.interrupted:
        raise KeyboardInterrupt(f"hvdlike.run interrupted ({result.interrupted})")
    outcomes = {}
    for rank, blob in blobs.items():
        try:
            outcomes[rank] = unseal(job.secret, f"result/{rank}", blob)
        except PayloadError as exc:
            raise RankError(f"rank {rank} returned a result that failed authentication: {exc}",
                            rank, job.placements[rank].host) from None
    failed = [rank for rank in sorted(outcomes) if not outcomes[rank]["ok"]]
    if result.failure is not None and result.failure.rank in failed:
        failed.remove(result.failure.rank)
        failed.insert(0, result.failure.rank)
    if failed:
        rank = failed[0]
        outcome = outcomes[rank]
        host = job.placements[rank].host
        error = RankError(
            f"rank {rank} (host {host}) raised {outcome['type']}: {outcome['message']}\n"
            f"{outcome['traceback']}".rstrip(),
            rank, host, outcome["traceback"])
        raise error from outcome.get("exception")
    if result.failure is not None or len(outcomes) < len(job.placements):
        worker = result.failure or next(w for w in result.workers if w.rank not in outcomes)
        tail = "\n".join(worker.stderr_tail)
        if worker.exit_code == REFUSED:
            what = ("refused its payload: it failed authentication, so the job's store was "
                    "tampered with; nothing was unpickled")
        else:
            what = f"{describe_exit(worker.exit_code or 0, worker.remote)} without a result"
        raise RankError(
            f"rank {worker.rank} (host {worker.host}) {what}"
            + (f"; last stderr lines:\n{tail}" if tail else ""),
            worker.rank, worker.host)
    return [outcomes[p.rank]["value"] for p in job.placements]


__all__ = ["run", "RankError", "LaunchError"]
