"""Start test ranks by forking a server that has already imported torch.

A fresh interpreter spends one to three seconds of CPU importing torch; a
multi-process test pays that once per rank, and the suite runs hundreds of
ranks on two cores. ``start_rank`` instead asks a long-lived
``multiprocessing`` fork server, which imported torch once, to fork the rank.
The forked rank then behaves like the ``python -m tests.multiproc.worker``
process it replaces:

- its environment is exactly the one given (``os.environ`` replaced);
- it leads a new session, so ``os.killpg(pid, SIGKILL)`` ends it with its
  children;
- stdout and stderr go to the given log file, stdin is ``/dev/null``;
- the random generators are reseeded, as a fresh process would have them;
- ``atexit`` handlers run when the function returns, as at interpreter exit.

Only torch, ``torch.distributed``, numpy and cloudpickle are imported ahead:
hvdlike itself is imported fresh in every rank, so no runtime state and no
variable read at import time leaks from one test into another. Tests that
need a brand-new interpreter pass ``fresh=True`` to ``run_ranks``; setting
``HVDLIKE_TEST_FRESH_RANKS=1`` makes every rank fresh.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import subprocess
import sys
import threading
from typing import Dict, Sequence

_PRELOAD = ["torch", "torch.distributed", "numpy", "cloudpickle", "tests.multiproc.worker"]
_lock = threading.Lock()
_context = None


def enabled() -> bool:
    """Whether ranks are forked (False under ``HVDLIKE_TEST_FRESH_RANKS=1`` or off Linux)."""
    return (sys.platform.startswith("linux")
            and os.environ.get("HVDLIKE_TEST_FRESH_RANKS", "0") in ("", "0"))


@contextlib.contextmanager
def _main_not_inherited():
    """Keep forked ranks from re-running the caller's main script.

    ``multiprocessing`` makes a child import the parent's ``__main__`` when it
    was started from a file; for a script that calls ``run_ranks`` at module
    level that would run the script again inside every rank.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or getattr(main, "__spec__", None) is not None:
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def _get_context():
    global _context
    with _lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(_PRELOAD)
            # The server inherits this process's environment once; torch's
            # OpenMP runtime reads the thread count when it loads.
            saved = os.environ.get("OMP_NUM_THREADS")
            os.environ["OMP_NUM_THREADS"] = "1"
            try:
                from multiprocessing import forkserver
                with _main_not_inherited():
                    forkserver.ensure_running()
            finally:
                if saved is None:
                    os.environ.pop("OMP_NUM_THREADS", None)
                else:
                    os.environ["OMP_NUM_THREADS"] = saved
            _context = ctx
        return _context


def _rank_main(argv: Sequence[str], env: Dict[str, str], cwd: str, log_path: str) -> None:
    """Body of a forked rank: become a fresh-looking worker process, run it, exit."""
    import atexit
    import random

    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    from tests.multiproc import worker

    sys.argv = [worker.__file__, *argv]
    random.seed()
    try:
        import numpy
        numpy.random.seed()
    except ImportError:
        pass

    code = 1
    try:
        code = worker.main()
    finally:
        try:
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
    raise SystemExit(code)


class ForkedRank:
    """The part of ``subprocess.Popen`` the harness uses, for a forked rank."""

    def __init__(self, process):
        self._process = process
        self.pid = process.pid

    @property
    def returncode(self):
        return self._process.exitcode

    def poll(self):
        return self._process.exitcode

    def wait(self, timeout=None):
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
        return self._process.exitcode


def start_rank(argv: Sequence[str], env: Dict[str, str], cwd: str, log_path: str) -> ForkedRank:
    """Fork one rank running ``tests.multiproc.worker`` with arguments ``argv`` and ``env``."""
    ctx = _get_context()
    process = ctx.Process(target=_rank_main, args=(list(argv), dict(env), cwd, log_path),
                          daemon=False)
    with _lock, _main_not_inherited():
        process.start()
    return ForkedRank(process)
