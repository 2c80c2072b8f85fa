"""Where an elastic job's hosts come from: a discovery script or a fixed list.

The script is run without a shell and must print one ``host[:slots]`` per line
(``#`` comments and blank lines ignored). A host without slots gets
``--slots-per-host`` (1 if not given). The first run must succeed -- its
failure is the launcher's one-line error -- and later failures are logged while
the last good list stays in force.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from typing import Callable, List, Optional, Sequence

from ..errors import LaunchError
from ..hosts import HostSlots, parse_hostfile

SCRIPT_TIMEOUT_SECONDS = 30.0
OUTPUT_MAX_BYTES = 1 << 20  # per stream: thousands of hosts fit


def parse_discovery_output(text: str, slots_per_host: Optional[int], script: str) -> List[HostSlots]:
    """Hosts from a discovery script's output (an empty list is valid: no hosts now).

    Raises:
        LaunchError: a line is malformed (naming the script and line).
    """
    where = f"host discovery script {script!r} output"
    hosts: List[HostSlots] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        (entry,) = parse_hostfile("\n" * (number - 1) + line, where)  # names the line
        named = ":" in line.lstrip("[").split("]")[-1] or "slots=" in line
        if not named and slots_per_host is not None:
            entry = HostSlots(entry.host, slots_per_host)
        if any(h.host == entry.host for h in hosts):
            raise LaunchError(f"{where} names host {entry.host!r} twice")
        hosts.append(entry)
    return hosts


class ScriptDiscovery:
    """Runs the discovery script.

    Args:
        script: path of an executable (run as is, no shell).
        slots_per_host: slots of a host the script gives none.
        run: ``fn(argv, timeout) -> (returncode, stdout, stderr)`` (a seam for tests).
    """

    def __init__(self, script: str, slots_per_host: Optional[int] = None,
                 run: Optional[Callable[[Sequence[str], float], tuple]] = None):
        self.script = script
        self.slots_per_host = slots_per_host
        self._run = run or _run_script

    def find(self) -> List[HostSlots]:
        """Run the script once.

        Raises:
            LaunchError: it could not run, failed, or printed something malformed.
        """
        try:
            code, out, err = self._run([self.script], SCRIPT_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            raise LaunchError(f"host discovery script {self.script!r} did not finish within "
                              f"{SCRIPT_TIMEOUT_SECONDS:g}s") from None
        except OSError as exc:
            raise LaunchError(f"host discovery script {self.script!r} cannot run: "
                              f"{exc.strerror or exc}") from None
        if code != 0:
            last = (err.strip().splitlines() or [""])[-1]
            last = last if len(last) <= 200 else last[:200] + "..."
            raise LaunchError(f"host discovery script {self.script!r} exited with code {code}"
                              + (f": {last}" if last else ""))
        return parse_discovery_output(out, self.slots_per_host, self.script)


class FixedDiscovery:
    """A fixed host list (``-H``/``--hostfile`` without a discovery script)."""

    def __init__(self, hosts: Sequence[HostSlots]):
        self.hosts = list(hosts)

    def find(self) -> List[HostSlots]:
        return list(self.hosts)


def _run_script(argv: Sequence[str], timeout: float) -> tuple:
    """Run the script in a session of its own; ``(returncode, stdout, stderr)``.

    Output is decoded leniently (a stray byte is a malformed line, reported as
    such) and kept up to ``OUTPUT_MAX_BYTES`` per stream, the rest drained and
    dropped (``stdout`` then ends with a line saying so, which fails parsing).
    On the timeout the script's whole process group is killed, so nothing it
    started in the background is left running.
    """
    if not os.path.exists(argv[0]):
        raise OSError(2, "no such file")
    # The file that was found, even when named without a directory (``find.sh``
    # would otherwise be looked up on PATH and reported missing).
    proc = subprocess.Popen([os.path.abspath(argv[0])] + list(argv[1:]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    kept = {"stdout": bytearray(), "stderr": bytearray()}
    over = set()

    def drain(name: str, pipe) -> None:
        with pipe:
            for chunk in iter(lambda: pipe.read1(65536), b""):
                room = OUTPUT_MAX_BYTES - len(kept[name])
                if len(chunk) > room:
                    over.add(name)
                kept[name] += chunk[:max(room, 0)]

    readers = [threading.Thread(target=drain, args=(name, getattr(proc, name)), daemon=True)
               for name in kept]
    for reader in readers:
        reader.start()
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        proc.wait()
        raise
    finally:
        # The group too when the script exited leaving children that hold its pipes.
        _kill_session(proc.pid)
        for reader in readers:
            reader.join(5.0)
    if "stdout" in over:
        raise LaunchError(f"host discovery script {argv[0]!r} printed more than "
                          f"{OUTPUT_MAX_BYTES} bytes")
    out, err = (bytes(kept[name]).decode("utf-8", "replace") for name in ("stdout", "stderr"))
    return code, out, err


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class LastGood:
    """Discovery that keeps the last good list when a run fails (after the first).

    Args:
        source: a :class:`ScriptDiscovery` or :class:`FixedDiscovery`.
        warn: called with a one-line message when a later run fails.
    """

    def __init__(self, source, warn: Callable[[str], None]):
        self.source = source
        self._warn = warn
        self.hosts: Optional[List[HostSlots]] = None
        self._failing = False

    def find(self) -> List[HostSlots]:
        """The current host list.

        Raises:
            LaunchError: the very first run failed.
        """
        try:
            hosts = self.source.find()
        except LaunchError as exc:
            if self.hosts is None:
                raise
            if not self._failing:
                self._warn(f"{exc}; keeping the last good host list")
            self._failing = True
            return list(self.hosts)
        if self._failing:
            self._warn("host discovery works again")
        self._failing = False
        self.hosts = hosts
        return list(hosts)
