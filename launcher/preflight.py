"""Pre-flight check: can every remote host run a rank?

For each remote host, in parallel, the rank helper is started over ssh in probe
mode. That proves ssh works non-interactively, that the remote Python can
import hvdlike, and (from the helper's answer) that the working directory and
the command exist there. Everything must answer within ``--start-timeout``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import threading
from typing import Callable, Dict, List, Optional, Sequence

from .errors import LaunchError
from .launch_config import SshOptions
from .ssh_exec import remote_helper_command


@dataclasses.dataclass
class HostCheck:
    """The outcome of probing one host."""

    host: str
    problem: Optional[str] = None
    helper: Optional[str] = None
    """Path of the rank helper script on the host (run directly, skipping imports)."""


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def interpret(host: str, returncode: int, stdout: str, stderr: str, python: str,
              cwd: str, command: str) -> HostCheck:
    """Turn a probe's outcome into a :class:`HostCheck`."""
    try:
        answer = json.loads(_last_line(stdout)) if returncode == 0 else {}
    except ValueError:
        answer = None
    problem = _problem(returncode, answer, stdout, stderr, python, cwd, command)
    return HostCheck(host, problem, None if problem else answer.get("helper"))


def _problem(returncode: int, answer: Optional[dict], stdout: str, stderr: str, python: str,
             cwd: str, command: str) -> Optional[str]:
    if returncode == 255:
        return f"ssh failed: {_last_line(stderr) or 'no reason given'}"
    if "No module named" in stderr:
        return f"hvdlike is not installed for {python} ({_last_line(stderr)})"
    if returncode == 127:
        return f"{python} not found ({_last_line(stderr)})"
    if returncode != 0:
        return f"probe exited with code {returncode}: {_last_line(stderr)}"
    if not isinstance(answer, dict):
        return f"unexpected probe answer: {_last_line(stdout)!r}"
    if not answer.get("cwd_ok"):
        return f"working directory {cwd} does not exist"
    if command and not answer.get("command"):
        return f"command {command!r} not found"
    return None


def _probe(host: str, ssh: SshOptions, python: str, spec: dict, timeout: float,
           verbose: Callable[[str], None]) -> HostCheck:
    argv = remote_helper_command(host, ssh, python, script=None)
    verbose(" ".join(argv))
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(json.dumps({"probe": spec}).encode() + b"\n", timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return HostCheck(host, f"no answer within {timeout:g}s (--start-timeout)")
    return interpret(host, proc.returncode, out.decode(errors="replace"),
                     err.decode(errors="replace"), python, spec["cwd"], spec["command"])


def check_hosts(hosts: Sequence[str], ssh: SshOptions, python: str, cwd: str,
                command: str, path: str, timeout: float,
                verbose: Callable[[str], None] = lambda text: None) -> List[HostCheck]:
    """Probe every host in parallel; return one :class:`HostCheck` per host, in order."""
    results: Dict[str, HostCheck] = {}
    spec = {"cwd": cwd, "command": command, "path": path}

    def run(host: str) -> None:
        try:
            results[host] = _probe(host, ssh, python, spec, timeout, verbose)
        except OSError as exc:
            results[host] = HostCheck(host, f"cannot run ssh: {exc.strerror or exc}")

    threads = [threading.Thread(target=run, args=(host,), daemon=True) for host in hosts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[host] for host in hosts]


def require_all_ok(checks: Sequence[HostCheck]) -> None:
    """Raise a :class:`LaunchError` with a per-host table if any host failed.

    The first line names the count of failed hosts; one line per host follows.
    """
    failed = [check for check in checks if check.problem]
    if not failed:
        return
    if len(failed) == 1:
        raise LaunchError(f"host {failed[0].host}: {failed[0].problem}")
    width = max(len(check.host) for check in checks)
    table = "\n".join(f"    {c.host:<{width}}  {c.problem or 'ok'}" for c in checks)
    raise LaunchError(f"{len(failed)} of {len(checks)} hosts failed the pre-flight check:\n{table}")
