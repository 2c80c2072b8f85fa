"""Watching the ranks: states, output, failure, stopping.

Each rank is a :class:`Worker` wrapping its helper process (local or ssh). Output
is forwarded line by line with a ``[rank]<stdout>:`` / ``[rank]<stderr>:``
prefix to the launcher's stdout / stderr, and optionally to per-rank log files.
:func:`monitor` waits until every rank has ended; the first failure (non-zero
exit or death by signal) or an interrupt stops every other rank: the helper's
stdin is closed, which makes it SIGTERM the rank's process group and SIGKILL it
after the grace period. Helpers that do not end in time are killed outright.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Deque, Dict, List, Optional, Sequence

from ..core.errors import SHUT_DOWN, SHUT_DOWN_UNDER
from .hosts import RankPlacement

TAIL_LINES = 10
SSH_FAILURE = 255
ROOT_CAUSE_WINDOW = 2.0  # seconds
PUMP_DRAIN_SECONDS = 5.0


class WorkerState(enum.Enum):
    """Life cycle of one rank."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"  # ended because the launcher stopped it


def describe_exit(code: int, remote: bool) -> str:
    """Human-readable reason for a helper's exit status."""
    if code < 0:
        code = 128 - code
    if remote and code == SSH_FAILURE:
        return "lost its ssh connection (ssh exit status 255)"
    if 128 < code < 128 + 65:
        try:
            name = signal.Signals(code - 128).name
        except ValueError:
            name = "unknown"
        return f"was killed by signal {code - 128} ({name})"
    if code == 127:
        return "could not start: command not found (exit code 127)"
    return f"exited with code {code}"


class Output:
    """Serialises prefixed lines from all ranks onto the launcher's streams.

    When a stream's reader goes away (``hvdlike-run ... | head``), writing to it
    fails: from then on its lines are dropped (the ranks' pipes are still
    drained, and ``--output-filename`` files still written) and ``on_closed``
    is called once, which :func:`monitor` turns into a stop of every rank.
    """

    def __init__(self, stdout: IO[str] = None, stderr: IO[str] = None, timestamps: bool = False):
        self._streams = {"stdout": stdout or sys.stdout, "stderr": stderr or sys.stderr}
        self.timestamps = timestamps  # lines start with time.asctime(), as Horovod's do
        self._lock = threading.Lock()
        self.closed: Dict[str, str] = {}  # stream -> why writing to it failed
        self.on_closed: Optional[Callable[[str], None]] = None

    def _write(self, stream: str, text: str) -> None:
        if stream in self.closed:
            return
        out = self._streams[stream]
        try:
            if out is None:  # the launcher was started with this descriptor closed
                raise OSError("not open")
            out.write(text)
            out.flush()
        except (OSError, ValueError) as exc:  # ValueError: a closed file object
            self.closed[stream] = str(exc)
            _silence(out)
            if len(self.closed) == 1 and self.on_closed is not None:
                self.on_closed(stream)

    def line(self, rank: int, stream: str, text: str) -> None:
        with self._lock:
            when = time.asctime() if self.timestamps else ""
            self._write(stream, f"{when}[{rank}]<{stream}>:{text}\n")

    def note(self, text: str) -> None:
        """A launcher message on stderr."""
        with self._lock:
            self._write("stderr", f"hvdlike-run: {text}\n")


def _close_quietly(handle) -> None:
    try:
        handle.close()
    except OSError:
        pass


def _silence(stream) -> None:
    """Point a dead stream at /dev/null, so buffered text flushed at exit fails quietly."""
    try:
        fd = stream.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
    except (AttributeError, OSError, ValueError):
        return
    try:
        os.dup2(devnull, fd)
    except OSError:
        pass
    finally:
        os.close(devnull)


class Worker:
    """One rank's helper process and what it said."""

    def __init__(self, placement: RankPlacement, argv: Sequence[str], spec: dict,
                 remote: bool, output: Output, log_dir: Optional[str] = None):
        self.placement = placement
        self.argv = list(argv)
        self.remote = remote
        self.state = WorkerState.PENDING
        self.exit_code: Optional[int] = None
        self.stderr_tail: Deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._spec = spec
        self._output = output
        self._log_dir = log_dir
        self._proc: Optional[subprocess.Popen] = None
        self._pumps: List[threading.Thread] = []
        self.stop_requested_at: Optional[float] = None
        self.failed_at: Optional[float] = None
        self.start_delay = 0.0  # seconds after the job's start (see ssh_exec.SSH_BURST)

    @property
    def rank(self) -> int:
        return self.placement.rank

    @property
    def host(self) -> str:
        return self.placement.host

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc else None

    def start(self) -> None:
        """Start the helper and hand it the rank's description on stdin."""
        self._proc = subprocess.Popen(
            self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,  # Ctrl-C reaches the launcher only; it stops ranks itself
        )
        self.state = WorkerState.RUNNING
        for stream in ("stdout", "stderr"):
            pump = threading.Thread(target=self._pump, args=(stream,), daemon=True,
                                    name=f"hvdlike-run rank {self.rank} {stream}")
            pump.start()
            self._pumps.append(pump)
        try:
            self._proc.stdin.write(json.dumps(self._spec).encode() + b"\n")
            self._proc.stdin.flush()
        except OSError:
            pass  # the helper already died; its exit status tells why

    def _pump(self, stream: str) -> None:
        source = getattr(self._proc, stream)
        log = None
        if self._log_dir:
            path = os.path.join(self._log_dir, f"rank.{self.rank}", stream)
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                log = open(path, "wb")  # the rank's bytes as they came, not re-encoded
            except OSError as exc:  # the rank's output still reaches the launcher's streams
                self._output.note(f"cannot write {path}: {exc.strerror or exc}")
        try:
            for raw in iter(source.readline, b""):
                text = raw.decode("utf-8", errors="replace").rstrip("\n")
                if stream == "stderr":
                    self.stderr_tail.append(text)
                self._output.line(self.rank, stream, text)
                if log:
                    try:
                        log.write(raw)
                        log.flush()
                    except OSError as exc:  # e.g. a full disk: keep forwarding, stop logging
                        self._output.note(f"cannot write {log.name}: {exc.strerror or exc}; "
                                          f"rank {self.rank} {stream} is no longer saved there")
                        _close_quietly(log)
                        log = None
        finally:
            if log:
                _close_quietly(log)

    def wait(self) -> int:
        """Block until the helper ends and its output is drained; return its status."""
        code = self._proc.wait()
        for pump in self._pumps:
            # A process that escaped the rank's session may still hold the pipe open:
            # take what arrives promptly, never wait for it forever.
            pump.join(timeout=PUMP_DRAIN_SECONDS)
        self.exit_code = code
        return code

    def request_stop(self) -> None:
        """Ask the helper to stop the rank (SIGTERM, then SIGKILL after its grace)."""
        if self.stop_requested_at is None and self._proc and self._proc.poll() is None:
            self.stop_requested_at = time.monotonic()
            try:
                self._proc.stdin.close()
            except OSError:
                pass

    def kill(self) -> None:
        """End the helper at once (its rank dies with it or with its connection)."""
        if self._proc and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@dataclasses.dataclass
class RunResult:
    """How a job ended."""

    exit_code: int
    failure: Optional[Worker] = None
    interrupted: Optional[str] = None
    workers: List[Worker] = dataclasses.field(default_factory=list)


def failure_summary(worker: Worker) -> str:
    """Multi-line summary of a failed rank: who, where, why, last stderr lines."""
    lines = [
        f"rank {worker.rank} on host {worker.host} "
        f"{describe_exit(worker.exit_code, worker.remote)}"
    ]
    tail = without_traceback_frames(list(worker.stderr_tail))
    if tail:
        lines.append(f"last line(s) of rank {worker.rank} stderr:")
        lines.extend(f"    {text}" for text in tail)
    return "\n".join(lines)


def without_traceback_frames(lines: List[str]) -> List[str]:
    """``lines`` with Python traceback frames left out, keeping the exception line.

    The traceback was already streamed with the rank's prefix; the summary
    repeats only what it ended with, so the traceback appears once.
    """
    kept, in_traceback = [], False
    # The tail may begin inside a traceback whose first line scrolled out of it.
    lead = next((i for i, text in enumerate(lines) if not text.startswith(" ")), len(lines))
    if any(text.startswith('  File "') for text in lines[:lead]):
        lines = lines[lead:]
    for text in lines:
        if text.startswith("Traceback (most recent call last):"):
            in_traceback = True
            continue
        if in_traceback and (text.startswith(" ") or not text.strip()):
            continue
        in_traceback = False
        kept.append(text)
    return kept


def _exit_code_for(code: int) -> int:
    if code < 0:
        return 128 - code
    return code if 0 < code < 256 else 1


CLOSED_OUTPUT_STATUS = 128 + signal.SIGPIPE


def closed_reason(stream: str) -> str:
    """What ``interrupted`` says when the launcher's ``stream`` lost its reader."""
    return f"the launcher's {stream} was closed"


class _ClosedOutput:
    """Detaches :attr:`Output.on_closed` when a run ends (the output may be reused)."""

    def __init__(self, output: Output):
        self._output = output

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self._output.on_closed = None


class _Interrupts:
    """Turns SIGINT/SIGTERM/SIGHUP into queue events while the job runs.

    SIGHUP (the launcher's terminal closed) stops the job like Ctrl-C, with the
    same orderly stop of every rank and clean-up of the store, and exit 129.
    """

    def __init__(self, events: "queue.Queue"):
        self._events = events
        self._previous: Dict[int, object] = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self._events.put(("signal", signum))

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def monitor(workers: Sequence[Worker], output: Output, grace_seconds: float,
            clock: Callable[[], float] = time.monotonic,
            on_exit: Optional[Callable[[Worker], None]] = None) -> RunResult:
    """Start every worker and wait until all have ended.

    Args:
        workers: the ranks, not yet started.
        output: where launcher notes go.
        grace_seconds: time a helper gets between SIGTERM and SIGKILL of its rank;
            helpers still alive ``grace_seconds + 10`` s after a stop are killed.
        clock: monotonic clock (a seam for tests).
        on_exit: called with each worker as its exit is taken in (its
            ``exit_code`` set), while the others may still run.

    Returns:
        The run's result; ``exit_code`` is 0 only if every rank succeeded.
    """
    events: "queue.Queue" = queue.Queue()
    result = RunResult(exit_code=0, workers=list(workers))
    live = {w.rank: w for w in workers}
    stopping_since: Optional[float] = None
    # (until when, why, the ranks blamed): a stop held back while those ranks exit
    deferred: Optional[tuple] = None
    interrupts = 0

    def stop_all(reason: str) -> None:
        nonlocal stopping_since
        others = [w for w in live.values() if w.state is WorkerState.RUNNING]
        if stopping_since is None:
            stopping_since = clock()
            if others:
                output.note(f"{reason}; stopping {len(others)} other rank(s)")
        for w in others:
            w.request_stop()

    def waiter(worker: Worker) -> None:
        events.put(("exit", worker.rank, worker.wait()))

    output.on_closed = lambda stream: events.put(("closed", stream))
    with _Interrupts(events), _ClosedOutput(output):
        began = clock()
        for worker in workers:
            wait = worker.start_delay - (clock() - began)
            if wait > 0 and events.empty():
                time.sleep(wait)
            try:
                worker.start()
            except OSError as exc:
                worker.state, worker.exit_code = WorkerState.FAILED, 127
                worker.failed_at = clock()
                worker.stderr_tail.append(f"cannot start {worker.argv[0]}: {exc.strerror or exc}")
                events.put(("exit", worker.rank, 127))
                continue
            threading.Thread(target=waiter, args=(worker,), daemon=True).start()
        while live:
            try:
                event = events.get(timeout=0.2)
            except queue.Empty:
                event = None
            if event and event[0] == "signal":
                interrupts += 1
                name = signal.Signals(event[1]).name
                if result.interrupted is None:
                    result.interrupted = name
                    result.exit_code = 128 + event[1]
                stop_all(f"received {name}")
                if interrupts > 1:
                    for w in live.values():
                        w.kill()
            elif event and event[0] == "closed":
                # Like a shell pipeline whose reader exited (SIGPIPE): the job stops.
                if result.interrupted is None and result.failure is None:
                    result.interrupted = closed_reason(event[1])
                    result.exit_code = CLOSED_OUTPUT_STATUS
                stop_all(closed_reason(event[1]))
            elif event and event[0] == "exit":
                worker = live.pop(event[1])
                code = event[2]
                worker.exit_code = code
                stopped = worker.stop_requested_at is not None
                if code == 0:
                    worker.state = WorkerState.SUCCEEDED
                elif stopped and not (_died(worker, ours=False)
                                      and clock() - worker.stop_requested_at < grace_seconds):
                    worker.state = WorkerState.STOPPED
                elif stopped:  # died on its own just as the stop arrived: a root-cause candidate
                    worker.state = WorkerState.FAILED
                    worker.failed_at = clock()
                else:
                    worker.state = WorkerState.FAILED
                    worker.failed_at = clock()
                    if result.failure is None and result.interrupted is None:
                        result.failure = worker
                        result.exit_code = _exit_code_for(code)
                        why = (f"rank {worker.rank} on host {worker.host} "
                               f"{describe_exit(code, worker.remote)}")
                        blamed = _shut_down_by(worker)
                        if any(r in live for r in blamed):
                            # The ranks it blames are on their way out: let them end
                            # with their own status before stopping them.
                            deferred = (clock() + ROOT_CAUSE_WINDOW, why, blamed)
                        else:
                            stop_all(why)
                if on_exit is not None:
                    on_exit(worker)
            if deferred is not None and (clock() >= deferred[0] or result.interrupted
                                         or not any(r in live for r in deferred[2])):
                stop_all(deferred[1])
                deferred = None
            if stopping_since is not None and clock() - stopping_since > grace_seconds + 10:
                for w in live.values():
                    w.kill()
    if result.failure is not None:
        result.failure = root_cause(result.workers, result.failure)
        result.exit_code = _exit_code_for(result.failure.exit_code)
    return result


def _died(worker: Worker, ours: bool = True) -> bool:
    """Whether the rank died (signal, lost host) rather than exited.

    With ``ours=False``, SIGTERM and SIGINT do not count: those are how ranks are stopped.
    """
    code = worker.exit_code if worker.exit_code >= 0 else 128 - worker.exit_code
    if worker.remote and code == SSH_FAILURE:
        return True
    if not 128 < code < 128 + 65:
        return False
    return ours or code - 128 not in (signal.SIGTERM, signal.SIGINT)


def root_cause(workers: Sequence[Worker], first: Worker, window: float = ROOT_CAUSE_WINDOW) -> Worker:
    """The failure to report: ``first``, unless a rank *died* (signal, lost host) within
    ``window`` seconds of it. When a rank is killed, its peers often fail on their own
    a moment later with a connection error; the dead rank is the one to name.

    Likewise a rank that exited non-zero (``sys.exit(7)``) shuts the job down on its
    way out: a peer inside a collective fails at once, saying so and naming it, and
    may be reaped first. The rank it names, failed within ``window``, is the cause.
    """
    if _died(first):
        return first
    near = [w for w in sorted(workers, key=lambda w: w.failed_at or 0.0)
            if w.state is WorkerState.FAILED and w.failed_at is not None
            and abs(w.failed_at - first.failed_at) <= window]
    for worker in near:
        if _died(worker):
            return worker
    named = _shut_down_by(first)
    for worker in near:
        if worker is not first and worker.rank in named and not _shut_down_by(worker):
            return worker
    return first


def _shut_down_by(worker: Worker) -> List[int]:
    """The ranks ``worker``'s last lines say shut the job down under its collective."""
    for text in reversed(worker.stderr_tail):
        for phrase in (SHUT_DOWN_UNDER + ": ", SHUT_DOWN + ": "):
            at = text.find(phrase)
            if at >= 0:
                return [int(r) for r in re.findall(r"(?:^|; )rank (\d+) on ",
                                                   text[at + len(phrase):])]
    return []
