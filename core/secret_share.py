"""Sharing a fresh job secret among the ranks of one host, without a launcher's help.

``hvdlike-run`` and ``mpirun`` give every rank the job secret through a private
channel (the rank's environment; an MPI broadcast). ``torchrun`` and ``srun``
offer none, and their store is readable by anyone who can reach it. When all
ranks of such a job share one host, rank 0 draws a random secret and leaves it
in an owner-only file in ``/dev/shm`` that only the job's user can open; the
others read it there. A file that is not owned by this user, is readable by
others, is a link, or is older than the reader's process is refused (another
local user can at most block the start, never inject a secret).

Rank 0 deletes the file as soon as every rank has joined (see
:meth:`~.job_store.JobStore.joined`) and again when its runtime closes. The
file also names the process that wrote it: a rank 0 killed before it could
delete its file (SIGKILL, or SIGTERM from ``scancel`` during start-up) leaves
it behind, and the next rank 0 of this user on this host removes every such
file whose writer is gone.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import tempfile
import time

from .errors import ConfigError
from .job_secret import new_secret

_SLACK_SECONDS = 120.0  # clock slack between ranks starting


def directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _prefix() -> str:
    return f"hvdlike-secret-{os.geteuid()}-"


def path_for(tag: str) -> str:
    """Where the secret of the job named by ``tag`` is left (per user)."""
    digest = hashlib.sha256(tag.encode()).hexdigest()[:20]
    return os.path.join(directory(), _prefix() + digest)


def _alive_since(pid: int, written: float) -> bool:
    """Whether process ``pid`` exists and may be the one that wrote at ``written``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists (as another user: not the writer, but keep it)
        return True
    try:
        import psutil

        return psutil.Process(pid).create_time() <= written + 1.0  # else: the pid was reused
    except Exception:  # psutil missing, or the process just ended
        return True


def _parse(data: bytes):
    """``(secret, writer pid)`` from a file :func:`publish` wrote, else None."""
    match = re.fullmatch(r"([0-9a-f]{32})\n(\d{1,10})\n", data.decode(errors="replace"))
    return (match.group(1), int(match.group(2))) if match else None


def sweep() -> int:
    """Remove this user's secret files whose writer no longer runs; return how many."""
    removed = 0
    try:
        names = [n for n in os.listdir(directory()) if n.startswith(_prefix())]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(directory(), name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            _check(fd, path)
            written = os.fstat(fd).st_mtime
            found = _parse(os.read(fd, 128))
        except (ConfigError, OSError):
            continue  # not a file this code wrote: leave it alone
        finally:
            os.close(fd)
        if found and not _alive_since(found[1], written):
            try:
                os.unlink(path)
                removed += 1
            except OSError:
                pass
    return removed


def _started_at() -> float:
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # psutil missing or /proc unreadable: accept any recent file
        return time.time() - _SLACK_SECONDS


def _check(fd: int, path: str) -> None:
    info = os.fstat(fd)
    if info.st_uid != os.geteuid():
        raise ConfigError(f"{path} belongs to uid {info.st_uid}, not to this user: refusing "
                          "to take the job secret from it (set HVDLIKE_JOB_SECRET instead)")
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{path} is not a regular file: refusing to take the job secret "
                          "from it (set HVDLIKE_JOB_SECRET instead)")
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{path} is readable or writable by other users: refusing to take "
                          "the job secret from it (set HVDLIKE_JOB_SECRET instead)")


def publish(tag: str) -> str:
    """Rank 0: draw a secret and leave it for the other local ranks; return it."""
    sweep()
    path = path_for(tag)
    try:  # O_NONBLOCK: a FIFO planted at the path must not hang the open
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        fd = None
    if fd is not None:  # a stale file of ours from an earlier run: replace it
        try:
            _check(fd, path)
        finally:
            os.close(fd)
        os.unlink(path)
    secret = new_secret()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot create {path} to share the job secret: {exc.strerror}; "
                          "set HVDLIKE_JOB_SECRET instead") from None
    try:
        os.write(fd, f"{secret}\n{os.getpid()}\n".encode())
    finally:
        os.close(fd)
    return secret


def receive(tag: str, timeout_seconds: float) -> str:
    """Other local ranks: wait for rank 0's file and return the secret in it."""
    path = path_for(tag)
    not_before = _started_at() - _SLACK_SECONDS
    deadline = time.monotonic() + timeout_seconds
    pause = 0.01
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            fd = None
        if fd is not None:
            try:
                _check(fd, path)
                written = os.fstat(fd).st_mtime
                found = _parse(os.read(fd, 128))
            finally:
                os.close(fd)
            # A file whose writer is gone is an earlier job's (its rank 0 was
            # killed before it could delete it): wait for this job's rank 0.
            if found and written >= not_before and _alive_since(found[1], written):
                return found[0]
        if time.monotonic() > deadline:
            raise ConfigError(
                f"rank 0 did not share the job secret within {timeout_seconds:g}s (no fresh "
                f"{path}); is rank 0 on this host? Set HVDLIKE_JOB_SECRET to the same random "
                "value on every rank to skip this step")
        time.sleep(pause)
        pause = min(0.2, pause * 1.5)


def forget(tag: str) -> None:
    """Rank 0: remove the file (every rank has read it)."""
    try:
        os.unlink(path_for(tag))
    except OSError:
        pass
