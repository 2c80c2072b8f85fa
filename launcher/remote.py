"""The helper that runs one rank on its host: ``python -m hvdlike.launcher.remote``.

``hvdlike-run`` starts this helper for every rank, locally or through ssh, and
writes one JSON line to its stdin: the command, the working directory and the
full environment (including the job secret, which therefore never appears on a
command line). The helper starts the command in a new session, lets its stdout
and stderr flow straight through, and keeps reading stdin. End of stdin (the
launcher closed it, died, or the ssh connection dropped) means "stop": the
command's whole process group gets SIGTERM, then SIGKILL after the grace period.
When the command exits, any process it left in its group is killed too, and so
is any it detached from the group (the helper adopts orphans as a Linux
"child subreaper"), so nothing outlives a rank.

Exit status: the command's exit code, ``128 + N`` when signal N ended it, 127
when the command does not exist, 126 when it cannot be started or the working
directory is missing.

With ``{"probe": {...}}`` instead, the helper only reports (as one JSON line)
whether the working directory and command exist on this host: the launcher's
pre-flight check. Only the standard library is used, so the helper starts fast.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from typing import List, Optional

_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _say(message: str) -> None:
    sys.stderr.write(f"hvdlike-run: {message}\n")
    sys.stderr.flush()


def _die_with_parent():
    """A ``preexec_fn`` that asks Linux to SIGKILL the child when this helper dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)

    return preexec


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _adopt_orphans() -> None:
    """Make this helper the parent of every orphan the command leaves (Linux only).

    A process that left the rank's process group (``setsid``, a daemon) is then
    still found among this helper's descendants, and stopped with the rank.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _live_descendants() -> List[int]:
    """Pids of this helper's living descendants, from /proc (empty where there is none)."""
    parents = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields and fields[0] != b"Z":  # zombies hold nothing open
            parents[int(name)] = int(fields[1])
    found, frontier = [], [os.getpid()]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found.extend(children)
        frontier.extend(children)
    return found


def _reap_adopted(command_pid: int) -> None:
    """Collect the exit status of adopted orphans that ended (never the command's own:
    that belongs to ``Popen.wait``)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children") as handle:
                children = [int(pid) for pid in handle.read().split()]
        except (OSError, ValueError):
            continue
        for pid in children:
            if pid != command_pid:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass


def _signal_descendants(sig: int, skip_group: Optional[int] = None) -> None:
    """Send ``sig`` to every living descendant outside process group ``skip_group``
    (the rank's group, already signalled: a process must get one SIGTERM, not two,
    or a handler that checkpoints on it runs twice)."""
    for pid in _live_descendants():
        try:
            if skip_group is not None and os.getpgid(pid) == skip_group:
                continue
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _kill_descendants() -> None:
    """SIGKILL whatever the command left behind, until nothing is left (bounded)."""
    for _ in range(50):
        left = _live_descendants()
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in left:  # reap the ones that became our children; others are not ours
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        threading.Event().wait(0.02)


def _resolve(command: str, cwd: str, path: Optional[str]) -> Optional[str]:
    if os.sep in command:
        full = os.path.join(cwd, command)
        return full if os.path.isfile(full) else None
    return shutil.which(command, path=path)


def missing_interpreter(path: str) -> Optional[str]:
    """The interpreter named by ``path``'s ``#!`` line when it does not exist, else None."""
    try:
        with open(path, "rb") as handle:
            first = handle.readline(4096)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    # As the kernel reads it: up to the first space or tab, a carriage return
    # (a file saved with Windows line endings) being part of the name.
    words = first[2:].rstrip(b"\n").replace(b"\t", b" ").split(b" ")
    words = [w for w in words if w]
    if not words:
        return None
    interpreter = os.fsdecode(words[0])
    if os.path.exists(interpreter):
        return None
    return interpreter[:-1] + "\\r" if interpreter.endswith("\r") else interpreter


def interpreter_hint(interpreter: str) -> str:
    """What to add to an error about :func:`missing_interpreter`'s answer."""
    if interpreter.endswith("\\r"):
        return "; the file has Windows line endings (convert it, e.g. with dos2unix)"
    return ""


def probe(spec: dict) -> int:
    """Report whether ``spec['cwd']`` and ``spec['command']`` (on ``spec['path']``) exist."""
    cwd = spec.get("cwd", "/")
    cwd_ok = os.path.isdir(cwd)
    found = _resolve(spec.get("command", ""), cwd, spec.get("path")) if cwd_ok else None
    print(json.dumps({"python": sys.executable, "helper": os.path.abspath(__file__),
                      "cwd_ok": cwd_ok, "command": found}))
    return 0


class _Events:
    """Wakes the helper when the command exits, stdin ends, or a signal arrives."""

    def __init__(self) -> None:
        self.wake = threading.Event()
        self.stop = False

    def watch_stdin(self) -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        self.stop = True
        self.wake.set()

    def watch_child(self, child: subprocess.Popen) -> None:
        child.wait()
        self.wake.set()

    def on_signal(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self.stop = True
        self.wake.set()


def run(spec: dict) -> int:
    """Run ``spec['argv']`` until it exits or the launcher says stop; return the status."""
    argv: List[str] = spec["argv"]
    env = spec["env"]
    cwd = spec.get("cwd") or os.getcwd()
    grace = float(spec.get("grace", 5.0))
    if not os.path.isdir(cwd):
        _say(f"working directory {cwd} does not exist on this host")
        return 126
    events = _Events()
    for sig in _SIGNALS:
        signal.signal(sig, events.on_signal)
    _adopt_orphans()
    try:
        child = subprocess.Popen(
            argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=_die_with_parent(),
        )
    except FileNotFoundError:
        found = _resolve(argv[0], cwd, env.get("PATH"))
        interpreter = missing_interpreter(found) if found else None
        if interpreter:
            _say(f"cannot run {argv[0]}: its interpreter {interpreter} (the '#!' line) "
                 f"does not exist on this host{interpreter_hint(interpreter)}")
            return 126
        _say(f"command not found: {argv[0]}")
        return 127
    except OSError as exc:
        _say(f"cannot run {argv[0]}: {exc.strerror or exc}")
        return 126
    # Threads start after the fork so preexec_fn runs in a single-threaded process.
    threading.Thread(target=events.watch_stdin, daemon=True).start()
    threading.Thread(target=events.watch_child, args=(child,), daemon=True).start()
    while child.poll() is None:
        events.wake.wait(1.0)  # a timeout keeps signal handlers running promptly
        _reap_adopted(child.pid)
        if events.stop and child.poll() is None:
            _kill_group(child.pid, signal.SIGTERM)
            _signal_descendants(signal.SIGTERM, child.pid)  # those that left the group, too
            try:
                child.wait(grace)
            except subprocess.TimeoutExpired:
                _kill_group(child.pid, signal.SIGKILL)
                child.wait()
            break
    _kill_group(child.pid, signal.SIGKILL)  # whatever the command left in its group
    _kill_descendants()  # and whatever left the group (reparented to this helper)
    code = child.returncode
    return 128 - code if code < 0 else code


def main() -> int:
    line = sys.stdin.buffer.readline()
    if not line:
        _say("the launcher sent no job description")
        return 126
    try:
        spec = json.loads(line)
    except ValueError:
        _say("the launcher sent a malformed job description")
        return 126
    if "probe" in spec:
        return probe(spec["probe"])
    return run(spec)


if __name__ == "__main__":
    sys.exit(main())
