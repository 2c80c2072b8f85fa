"""Run a function on N real ranks talking over loopback sockets.

``run_ranks(fn, np)`` plays the launcher's part: it hosts a TCPStore, starts
``np`` fresh Python processes with the ``HVDLIKE_*`` variables set, runs
``fn(*args)`` in each and returns their results in rank order. Every run has a
hard deadline; on expiry or failure all processes are killed (their whole
process groups) before the error is raised, so nothing is left behind.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Optional, Sequence

import cloudpickle

from hvdlike.core import bootstrap
from tests.multiproc import rank_forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class RankFailure(AssertionError):
    def __init__(self, message: str, outputs: Dict[int, str]):
        super().__init__(message)
        self.outputs = outputs


def describe(codes: Sequence[Optional[int]], outputs: Dict[int, str], tail: int = 6000) -> str:
    """Every rank's exit code and the end of its log, for an assertion message."""
    return "\n".join(f"--- rank {r} (exit {codes[r]}) ---\n{outputs[r][-tail:]}" for r in outputs)


def _kill_all(procs: Sequence[subprocess.Popen], dump: bool = False) -> None:
    """Kill every process still running (with its session).

    With ``dump``, each is first asked for its threads' stacks (the worker
    registers SIGUSR2 with faulthandler), so a hang's log says where it hung.
    """
    running = [proc for proc in procs if proc.poll() is None]
    if dump and running:
        for proc in running:
            try:
                os.kill(proc.pid, signal.SIGUSR2)
            except ProcessLookupError:
                pass
        time.sleep(1.0)
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                # A forked rank that has not yet made its own session.
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    for proc in procs:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def run_ranks(fn: Callable, np: int = 2, args: Sequence[Any] = (), env: Optional[dict] = None,
              timeout: float = 90.0, expect_failure: bool = False,
              per_rank_env: Optional[Callable[[int], dict]] = None, fresh: bool = False):
    """Run ``fn(*args)`` on ``np`` ranks; return results (or outputs if expect_failure).

    Args:
        fn: picklable callable; it may ``import hvdlike.torch`` and call ``init()``.
        np: number of ranks.
        args: positional arguments for ``fn``.
        env: extra environment variables for every rank.
        timeout: hard deadline in seconds for the whole run.
        expect_failure: when True, do not raise on a failing rank; return
            ``(returncodes, outputs)`` instead.
        per_rank_env: ``fn(rank) -> dict`` of further variables for one rank.
        fresh: start each rank as a new interpreter instead of forking it from
            the server that has torch imported (see ``rank_forkserver``).
    """
    import datetime

    from hvdlike.core.job_store import serve

    store, _ = serve("127.0.0.1", 0, np, datetime.timedelta(seconds=300))
    secret = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="hvdlike-test-") as tmp:
        payload = os.path.join(tmp, "fn.pkl")
        with open(payload, "wb") as f:
            cloudpickle.dump((fn, tuple(args)), f)
        procs, logs = [], []
        for rank in range(np):
            rank_env = dict(os.environ)
            rank_env.update({
                bootstrap.ENV_RANK: str(rank), bootstrap.ENV_SIZE: str(np),
                bootstrap.ENV_LOCAL_RANK: str(rank), bootstrap.ENV_LOCAL_SIZE: str(np),
                bootstrap.ENV_CROSS_RANK: "0", bootstrap.ENV_CROSS_SIZE: "1",
                bootstrap.ENV_STORE_ADDR: "127.0.0.1", bootstrap.ENV_STORE_PORT: str(store.port),
                bootstrap.ENV_JOB_SECRET: secret, bootstrap.ENV_LAUNCHER: "test-harness",
                "PYTHONPATH": ROOT + os.pathsep + rank_env.get("PYTHONPATH", ""),
                "OMP_NUM_THREADS": "1",
            })
            rank_env.update(env or {})
            rank_env.update(per_rank_env(rank) if per_rank_env else {})
            log_path = os.path.join(tmp, f"rank{rank}.log")
            log = open(log_path, "w+")
            logs.append(log)
            args_ = [payload, os.path.join(tmp, f"result{rank}.pkl")]
            if fresh or not rank_forkserver.enabled():
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tests.multiproc.worker", *args_], cwd=ROOT,
                    env=rank_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            else:
                procs.append(rank_forkserver.start_rank(args_, rank_env, ROOT, log_path))
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    break
                if not expect_failure and any(p.poll() not in (None, 0) for p in procs):
                    # One rank failed: give the others a moment to report, then stop.
                    grace = time.monotonic() + 40
                    while any(p.poll() is None for p in procs) and time.monotonic() < grace:
                        time.sleep(0.05)
                    break
                time.sleep(0.02)
            timed_out = any(p.poll() is None for p in procs)
        finally:
            _kill_all(procs, dump=True)
        outputs = {}
        for rank, log in enumerate(logs):
            log.seek(0)
            outputs[rank] = log.read()
            log.close()
        codes = [p.returncode for p in procs]
        if expect_failure:
            return codes, outputs
        if timed_out or any(codes):
            text = "\n".join(f"--- rank {r} (exit {codes[r]}) ---\n{outputs[r][-4000:]}"
                             for r in range(np))
            what = f"timed out after {timeout:g}s" if timed_out else f"exit codes {codes}"
            raise RankFailure(f"ranks failed: {what}\n{text}", outputs)
        results = []
        for rank in range(np):
            with open(os.path.join(tmp, f"result{rank}.pkl"), "rb") as f:
                results.append(cloudpickle.load(f))
        return results


def run_mpirun(fn: Callable, np: int = 2, args: Sequence[Any] = (), env: Optional[dict] = None,
               timeout: float = 90.0, expect_failure: bool = False):
    """Like :func:`run_ranks`, but the ranks are started by ``mpirun`` (MPICH or Open MPI).

    The ranks bootstrap through mpi4py as in a real ``mpirun`` job. Returns the
    results in rank order, or ``(returncode, output)`` with ``expect_failure``.
    The whole mpirun process group is killed on expiry.
    """
    import shutil

    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise RuntimeError("mpirun is not on PATH")
    with tempfile.TemporaryDirectory(prefix="hvdlike-mpi-test-") as tmp:
        payload = os.path.join(tmp, "fn.pkl")
        with open(payload, "wb") as f:
            cloudpickle.dump((fn, tuple(args)), f)
        rank_env = {k: v for k, v in os.environ.items() if not k.startswith("HVDLIKE_")}
        rank_env.update({"PYTHONPATH": ROOT + os.pathsep + rank_env.get("PYTHONPATH", ""),
                         "OMP_NUM_THREADS": "1"})
        rank_env.update(env or {})
        log = open(os.path.join(tmp, "mpirun.log"), "w+")
        proc = subprocess.Popen(
            [mpirun, "-np", str(np), sys.executable, "-m", "tests.multiproc.worker", payload,
             os.path.join(tmp, "result{rank}.pkl")],
            cwd=ROOT, env=rank_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_all([proc])
        log.seek(0)
        output = log.read()
        log.close()
        if expect_failure:
            return (None if timed_out else proc.returncode), output
        if timed_out or proc.returncode:
            what = f"timed out after {timeout:g}s" if timed_out else f"exit code {proc.returncode}"
            raise RankFailure(f"mpirun ranks failed: {what}\n{output[-6000:]}", {0: output})
        results = []
        for rank in range(np):
            with open(os.path.join(tmp, f"result{rank}.pkl"), "rb") as f:
                results.append(cloudpickle.load(f))
        return results
