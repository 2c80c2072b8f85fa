r"""Watching the ranks: states, output, failure, stopping.

Each rank is a :class:`Worker` wrapping its helper process (local or ssh). Its
output is read in bounded chunks and forwarded with a ``[rank]<stdout>:`` /
``[rank]<stderr>:`` prefix to the launcher's stdout / stderr: a line as soon as it
is complete, a ``\r``-ended piece (a progress bar) as soon as it is written, and
text without a line end once the rank pauses (see :class:`PieceSplitter`). The
rank's bytes also go, unchanged, to per-rank log files when asked.
:func:`monitor` waits until every rank has ended; the first failure (non-zero
exit or death by signal) or an interrupt stops every other rank: the helper's
stdin is closed, which makes it SIGTERM the rank's process group and SIGKILL it
after the grace period. Helpers that do not end in time are killed outright.
"""

from __future__ import annotations

import codecs
import collections
import dataclasses
import enum
import errno
import json
import os
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Deque, Dict, Iterable, List, Optional, Sequence, Tuple

from ..core.errors import SHUT_DOWN, SHUT_DOWN_UNDER
from .hosts import RankPlacement
from ..core.output_file import open_output_file

TAIL_LINES = 10
SSH_FAILURE = 255
ROOT_CAUSE_WINDOW = 2.0  # seconds
# How long the ranks a failure names as having shut the job down under it get to
# end with their own status (an interpreter that loaded torch can take seconds
# to exit on a busy host); they announced their exit, so this is not a hang.
LEAVER_WINDOW = 10.0  # seconds
PUMP_DRAIN_SECONDS = 5.0
READ_SIZE = 65536  # bytes taken from a rank's pipe at a time
PIECE_CAP = 65536  # characters of a line held back at most while waiting for its end
SHOW_PARTIAL_AFTER = 0.1  # seconds a rank stays quiet before text without a line end is shown
TAIL_LINE_CHARS = 2000  # characters kept of each line of stderr_tail

# A piece of a rank's output: its text and how it ended: "\n" or "\r\n" (a line),
# "\r" (a carriage return: a progress bar's update), or "" (no end yet: more may follow).
Piece = Tuple[str, str]
_PIECE_END = re.compile("\r\n|\r|\n")


class WorkerState(enum.Enum):
    """Life cycle of one rank."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"  # ended because the launcher stopped it


def rank_folder(rank: int, size: Optional[int] = None) -> str:
    """The ``--output-filename`` folder of ``rank`` among ``size`` ranks: ``rank.N``
    with N zero-padded to the width of the job's largest rank, as horovodrun names
    them, so they sort (``rank.00`` ... ``rank.10`` for 11 ranks; ``rank.0`` ...
    ``rank.9`` for 10). Without ``size``, unpadded."""
    width = len(str(size - 1)) if size and size > 1 else 1
    return f"rank.{rank:0{width}d}"


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
    r"""Serialises prefixed pieces of output from all ranks onto the launcher's streams.

    Every line shown starts with its rank's prefix. A rank's piece that has no
    line end yet (text shown while the rank pauses, or a long line forwarded in
    parts) is continued without a prefix while nothing else was written after it;
    when another rank or a launcher note writes in between, the open line is ended
    first and the rest comes on a new, prefixed line. A ``\r``-ended piece is
    written with its ``\r``, so the rank's next update overwrites it on a terminal;
    anything else written after it starts on a new line, so the update stays shown.

    When a stream's reader goes away (``hvdlike-run ... | head``: a broken pipe),
    its lines are dropped from then on (the ranks' pipes are still drained, and
    ``--output-filename`` files still written) and ``on_closed`` is called once,
    which :func:`monitor` turns into a stop of every rank, as a shell pipeline's
    SIGPIPE would. Any other failure to write (the stream was closed when the
    launcher started, ``EBADF``, a full disk, ``EIO``) drops that stream's lines
    too, but the job keeps running; it is said once on the other stream.
    """

    def __init__(self, stdout: IO[str] = None, stderr: IO[str] = None, timestamps: bool = False):
        self._streams = {"stdout": stdout or sys.stdout, "stderr": stderr or sys.stderr}
        self.timestamps = timestamps  # lines start with time.asctime(), as Horovod's do
        self._lock = threading.Lock()
        self.closed: Dict[str, str] = {}  # stream -> why: its reader went away (the job stops)
        self.dropped: Dict[str, str] = {}  # stream -> why it cannot be written (the job goes on)
        self.on_closed: Optional[Callable[[str], None]] = None
        # Where each stream's text lands: both on one terminal or file share a line.
        shared = _same_file(self._streams["stdout"], self._streams["stderr"])
        self._screen = {"stdout": "stdout", "stderr": "stdout" if shared else "stderr"}
        # screen -> (who wrote last: (rank, stream), or None for the launcher; how it ended)
        self._at: Dict[str, Tuple[Optional[Tuple[int, str]], str]] = {}
        # (rank, stream) -> how the rank's last piece there ended
        self._ends: Dict[Tuple[int, str], str] = {}

    def _write(self, stream: str, text: str) -> None:
        if stream in self.closed or stream in self.dropped:
            return
        out = self._streams[stream]
        try:
            if out is None:  # the launcher was started with this descriptor closed
                raise OSError(errno.EBADF, "closed at start")
            out.write(text)
            out.flush()
        except (OSError, ValueError) as exc:  # ValueError: a closed file object
            _silence(out)
            if _reader_gone(exc):
                self.closed[stream] = str(exc)
                if len(self.closed) == 1 and self.on_closed is not None:
                    self.on_closed(stream)
                return
            why = (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
            self.dropped[stream] = why
            other = "stderr" if stream == "stdout" else "stdout"
            self._emit(other, f"hvdlike-run: cannot write to {stream} ({why}); "
                              "its lines are dropped from now on\n")

    def _emit(self, stream: str, text: str) -> None:
        """Write a launcher message, made of whole lines, on ``stream``."""
        screen = self._screen[stream]
        end = self._at.get(screen, (None, "\n"))[1]
        self._at[screen] = (None, "\n")
        self._write(stream, ("\n" if end in ("", "\r") else "") + text)

    def pieces(self, rank: int, stream: str, pieces: Iterable[Piece]) -> None:
        """Forward pieces of rank ``rank``'s ``stream`` (see :class:`PieceSplitter`)."""
        with self._lock:
            when = time.asctime() if self.timestamps else ""
            me, screen = (rank, stream), self._screen[stream]
            parts = []
            for text, end in pieces:
                last = self._ends.get(me, "\n")
                at = self._at.get(screen, (None, "\n"))
                if not text:
                    if not end:
                        continue
                    if end == "\r":  # back to the start of its line: only if one is open
                        if at == (me, ""):
                            parts.append(end)
                            self._at[screen] = (me, end)
                        self._ends[me] = "\r" if last in ("", "\r") else "\n"
                        continue
                    if last in ("", "\r"):  # ends a line already shown ("\r" + "\n": CR LF)
                        if at == (me, last):
                            parts.append(end)
                            self._at[screen] = (me, "\n")
                        self._ends[me] = "\n"
                        continue
                if at == (me, ""):  # its own open line: continue it
                    parts.append(text + end)
                else:
                    if at[1] == "" or (at[1] == "\r" and at[0] != me):
                        parts.append("\n")  # keep what is shown; start a new line
                    parts.append(f"{when}[{rank}]<{stream}>:{text}{end}")
                ended = "\n" if end == "\r\n" else end
                self._at[screen] = (me, ended)
                self._ends[me] = ended
            if parts:
                self._write(stream, "".join(parts))

    def line(self, rank: int, stream: str, text: str) -> None:
        """Forward one line of rank ``rank``'s ``stream``."""
        self.pieces(rank, stream, [(text, "\n")])

    def note(self, text: str) -> None:
        """A launcher message on stderr."""
        with self._lock:
            self._emit("stderr", f"hvdlike-run: {text}\n")


def _same_file(one, other) -> bool:
    """Whether two streams write to the same terminal, pipe or file."""
    try:
        first, second = os.fstat(one.fileno()), os.fstat(other.fileno())
    except (AttributeError, OSError, ValueError):  # no descriptor (e.g. io.StringIO), or closed
        return False
    return (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)


def _reader_gone(exc: Exception) -> bool:
    """Whether a failed write means the stream's reader went away (a broken pipe)."""
    if isinstance(exc, ValueError):  # the stream's file object was closed
        return True
    return isinstance(exc, (BrokenPipeError, ConnectionResetError)) or exc.errno in (
        errno.EPIPE, errno.ECONNRESET)


class PieceSplitter:
    r"""Cuts the bytes of one rank's stream into :data:`Piece` s to forward.

    Bytes are decoded as UTF-8 (invalid bytes become U+FFFD; a character split
    between two chunks is kept whole). Every ``\n``, ``\r\n`` or ``\r`` ends a
    piece. Text without a line end is held back, up to ``cap`` characters: beyond
    that it is forwarded as an open piece (end ``""``) and the line goes on in the
    next piece, so memory stays bounded whatever the rank writes; :meth:`flush`
    forwards it at once (when the rank pauses), :meth:`close` at the end.
    """

    def __init__(self, cap: int = PIECE_CAP):
        self.cap = cap
        self._decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        self._held: List[str] = []
        self._size = 0
        self._open = False  # part of the current line was already forwarded

    @property
    def pending(self) -> bool:
        """Whether text without a line end is held back."""
        return self._size > 0

    def feed(self, data: bytes) -> List[Piece]:
        """The pieces completed by ``data`` (the next bytes read)."""
        text = self._decode(data)
        found: List[Piece] = []
        start = 0
        for match in _PIECE_END.finditer(text):
            found.append((self._take(text[start:match.start()]), match.group()))
            self._open = False
            start = match.end()
        if start < len(text):
            self._held.append(text[start:])
            self._size += len(text) - start
            if self._size >= self.cap:
                found.extend(self.flush())
        return found

    def flush(self) -> List[Piece]:
        """The text held back, as an open piece (none if nothing is held)."""
        if not self._size:
            return []
        self._open = True
        return [(self._take(""), "")]

    def close(self) -> List[Piece]:
        """The last pieces, at the end of the stream: an unfinished line is ended."""
        text = self._take(self._decode(b"", final=True))
        if text or self._open:
            self._open = False
            return [(text, "\n")]
        return []

    def _take(self, text: str) -> str:
        if self._held:
            text = "".join(self._held) + text
            self._held, self._size = [], 0
        return text


class _Tail:
    r"""Keeps the last lines of a rank's stderr, each cut to ``TAIL_LINE_CHARS``.

    A run of ``\r``-ended pieces (a progress bar) keeps only its latest update.
    """

    def __init__(self, lines: Deque[str]):
        self.lines = lines
        self._line = ""
        self._cut = False  # the current line is longer than what is kept of it
        self._progress = False  # the last line kept is a progress update

    def add(self, text: str, end: str) -> None:
        """Take in the next piece of the stream (see :class:`PieceSplitter`)."""
        room = TAIL_LINE_CHARS - len(self._line)
        if len(text) > room:
            text, self._cut = text[:max(room, 0)], True
        self._line += text
        if not end:
            return
        line = self._line + (" ..." if self._cut else "")
        self._line, self._cut = "", False
        if end == "\r":
            if line:
                if self._progress and self.lines:
                    self.lines[-1] = line
                else:
                    self.lines.append(line)
                self._progress = True
        elif line or not self._progress:
            self.lines.append(line)
            self._progress = False
        else:  # the line end after a progress update
            self._progress = False


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
        """Forward one of the rank's streams until it ends (see :class:`PieceSplitter`)."""
        source = getattr(self._proc, stream)
        log = None
        if self._log_dir:
            path = os.path.join(self._log_dir,
                                rank_folder(self.rank, self.placement.topology.size), stream)
            try:
                # The rank's bytes as they came, not re-encoded; never through a
                # symbolic link or into a FIFO planted since the launcher's check
                # (folders made one at a time, see output_file).
                log = os.fdopen(open_output_file(path, make_folders=True, own_names=2), "wb")
            except OSError as exc:  # the rank's output still reaches the launcher's streams
                self._output.note(f"cannot write {path}: {exc.strerror or exc}")
        splitter = PieceSplitter()
        tail = _Tail(self.stderr_tail) if stream == "stderr" else None

        def forward(pieces: List[Piece]) -> None:
            if tail is not None:
                for text, end in pieces:
                    tail.add(text, end)
            if pieces:
                self._output.pieces(self.rank, stream, pieces)

        try:
            fd = source.fileno()
            readable = select.poll()
            readable.register(fd, select.POLLIN)
            while True:
                if splitter.pending and not readable.poll(SHOW_PARTIAL_AFTER * 1000):
                    forward(splitter.flush())  # the rank paused: show what it wrote so far
                try:
                    data = os.read(fd, READ_SIZE)
                except OSError:
                    break
                if not data:
                    break
                if log:
                    try:
                        log.write(data)
                        log.flush()
                    except OSError as exc:  # e.g. a full disk: keep forwarding, stop logging
                        self._output.note(f"cannot write {path}: {exc.strerror or exc}; "
                                          f"rank {self.rank} {stream} is no longer saved there")
                        _close_quietly(log)
                        log = None
                forward(splitter.feed(data))
            forward(splitter.close())
        finally:
            if log:
                _close_quietly(log)
            _close_quietly(source)

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

    def stop_all(reason: str, every: bool = False) -> None:
        """Stop the running ranks; ``every``: none of them ended first (a signal,
        the output closed), so they are not "the other" ranks."""
        nonlocal stopping_since
        others = [w for w in live.values() if w.state is WorkerState.RUNNING]
        if stopping_since is None:
            stopping_since = clock()
            if others:
                which = "" if every and len(others) == len(workers) else "other "
                output.note(f"{reason}; stopping {len(others)} {which}rank(s)")
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
                stop_all(f"received {name}", every=True)
                if interrupts > 1:
                    for w in live.values():
                        w.kill()
            elif event and event[0] == "closed":
                # Like a shell pipeline whose reader exited (SIGPIPE): the job stops.
                if result.interrupted is None and result.failure is None:
                    result.interrupted = closed_reason(event[1])
                    result.exit_code = CLOSED_OUTPUT_STATUS
                stop_all(closed_reason(event[1]), every=True)
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
                            deferred = (clock() + LEAVER_WINDOW, why, blamed)
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


def root_cause(workers: Sequence[Worker], first: Worker, window: float = ROOT_CAUSE_WINDOW,
               leaver_window: float = LEAVER_WINDOW) -> Worker:
    """The failure to report: ``first``, unless a rank *died* (signal, lost host) within
    ``window`` seconds of it. When a rank is killed, its peers often fail on their own
    a moment later with a connection error; the dead rank is the one to name.

    Likewise a rank that exited non-zero (``sys.exit(7)``) shuts the job down on its
    way out: a peer inside a collective fails at once, saying so and naming it, and
    may be reaped first. The rank it names, failed within ``leaver_window``, is the
    cause (its interpreter's exit can take seconds after it announced it).
    """
    if _died(first):
        return first

    def within(seconds: float) -> List[Worker]:
        return [w for w in sorted(workers, key=lambda w: w.failed_at or 0.0)
                if w.state is WorkerState.FAILED and w.failed_at is not None
                and abs(w.failed_at - first.failed_at) <= seconds]

    for worker in within(window):
        if _died(worker):
            return worker
    named = _shut_down_by(first)
    for worker in within(leaver_window):
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
