"""The timeline: a Chrome-trace JSON file of what every collective went through.

Open the file in https://ui.perfetto.dev or ``chrome://tracing``. Each tensor
name gets a row; on it, one after the other:

* ``NEGOTIATE_<OP>`` -- from submission until the ranks agreed to run it. Its
  ``args`` say how they agreed (``agreed_by``):

  - ``coordinator``: the request went to the coordinator (the process set's
    rank 0). In the coordinator's own file the span carries one instant per
    rank, named by the rank's number, at the moment the coordinator first held
    that rank's request (the gather of the cycle that rank sent it in), and
    ``ready_ranks`` lists them in that order; the span starts at the earliest
    of this rank's submission and the first such instant. Other ranks' files
    show the span without instants: they never see the others' requests.
  - ``response cache`` / ``learned order``: a repeat of a known collective,
    agreed by the summed ready bits or the one-word vote on the learned order.
    Only "every rank was ready at agreement" crosses the wire on these paths,
    so there are no per-rank instants (and no control traffic is added for them).

* ``QUEUE`` -- from agreement until the executor began launching its batch
  (fusion planning and launching the batches ahead of it);
* ``<OP>`` (``ALLREDUCE``, ``BROADCAST``...) -- from launch until its handle
  completed, containing ``MEMCPY_IN_FUSION_BUFFER`` (or ``LAUNCH`` when not
  fused: staging and starting the transfer), ``GLOO_<OP>``/``NCCL_<OP>``/``MPI_<OP>`` (the
  transfer, until the completion thread saw it done -- in launch order) and
  ``MEMCPY_OUT_FUSION_BUFFER`` (or ``FINALIZE``: copying results out).

With ``mark_cycles`` every background cycle adds a ``CYCLE_START`` instant.

Recording is off unless ``HVDLIKE_TIMELINE=path`` (``HOROVOD_TIMELINE``) is set
or :func:`start` is called. The setting ``DYNAMIC`` means what it means to
Horovod: no file at ``init()``, only what ``start_timeline()`` asks for; when off, each runtime hook costs one attribute
check. As in Horovod, rank 0 writes the file; a path containing ``{rank}``
is formatted per rank and every rank writes its own. Events are queued and
written by a thread of their own, so recording never blocks a collective.
A file never grows past ``max_bytes`` (``HVDLIKE_TIMELINE_MAX_BYTES``, 1 GiB
unless told otherwise): a ``TIMELINE_TRUNCATED`` instant marks the point, later
events are dropped, and the file is still closed as valid JSON -- a forgotten
timeline never fills a disk.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from typing import Dict, Optional

from .output_file import open_output_file

DEFAULT_MAX_BYTES = 1 << 30
MIN_MAX_BYTES = 4096  # room for the header, a few events and the truncation mark
_RESERVE = 256  # kept free for the truncation mark and the closing bracket


DYNAMIC = "DYNAMIC"


def configured_path(text: str) -> str:
    """The file ``init()`` records to for a timeline setting; "" for none (``DYNAMIC``)."""
    return "" if text.strip() == DYNAMIC else text


def check_max_bytes(max_bytes, what: str = "max_bytes") -> int:
    """``max_bytes`` as an int, or ValueError naming ``what`` and the bound."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) \
            or max_bytes < MIN_MAX_BYTES:
        raise ValueError(f"{what} must be an int >= {MIN_MAX_BYTES} (bytes), got {max_bytes!r}")
    return max_bytes


class _NotATimeline(OSError):
    """The file to continue is not a complete timeline."""


class Timeline:
    """An open timeline file; thread-safe (events come from several threads).

    Args:
        path: file to write (truncated).
        mark_cycles: also record an instant at the start of each cycle.
        rank: written into the trace metadata.
        max_bytes: the file never grows past this size (>= ``MIN_MAX_BYTES``).
        append: continue a complete timeline file already at ``path`` (its
            closing bracket is replaced by the new events) instead of truncating.
        origin: the monotonic time of timestamp 0 (default: now).
        must_append: with ``append``, raise instead of truncating a file that
            is not a complete timeline.
    """

    def __init__(self, path: str, mark_cycles: bool = False, rank: int = 0,
                 max_bytes: int = DEFAULT_MAX_BYTES, append: bool = False,
                 origin: Optional[float] = None, must_append: bool = False):
        self.path = path
        self.mark_cycles = mark_cycles
        self.max_bytes = check_max_bytes(max_bytes)
        self.truncated = False
        self.closed = False
        self._file = _reopen(path) if append else None
        if self._file is None and must_append:
            raise _NotATimeline(path)
        if self._file is None:
            # Not through a symbolic link planted in a shared folder, on the way or
            # at the file (see output_file).
            self._file = os.fdopen(open_output_file(path), "w", encoding="utf-8")
            self._file.write("[\n")
        self._written = self._file.tell()
        self._first = self._written <= 2
        self._origin = time.monotonic() if origin is None else origin
        self._rows: Dict[str, int] = {}
        self._lock = threading.Lock()
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="hvdlike-timeline",
                                        daemon=True)
        self._meta(0, "process_name", {"name": f"hvdlike rank {rank} cycles"})

    def start(self) -> None:
        """Start the writer thread (events recorded before it wait in the queue)."""
        if self._writer.ident is None:
            self._writer.start()

    # -- writing ---------------------------------------------------------------------

    def _emit(self, event: dict) -> None:
        if not self.truncated:  # once the file is full nothing more is written
            self._queue.put(event)

    def _meta(self, pid: int, name: str, args: dict) -> None:
        self._emit({"name": name, "ph": "M", "pid": pid, "tid": 0, "ts": 0, "args": args})

    def _write_loop(self) -> None:
        """The only writer of the file: events in order, then the closing bracket.

        Whenever the queue runs dry the closing bracket is written (and
        flushed) after the last event, and overwritten by the next one: the
        file is a complete JSON array between batches, so a rank killed by a
        signal (or ended by ``MPI_Abort``, which skips exit handlers) leaves a
        trace every tool can load, not only the lenient ones.
        """
        closed_at = None  # where the closing bracket on disk starts, if one is
        while True:
            event = self._queue.get()
            if event is None:
                break
            if self.truncated:
                continue  # drain the queue, write nothing more
            if closed_at is not None:
                self._file.seek(closed_at)
                closed_at = None
            text = json.dumps(event, separators=(",", ":"))
            if self._written + len(text) + 2 + _RESERVE > self.max_bytes:
                self.truncated = True
                text = json.dumps({"name": "TIMELINE_TRUNCATED", "ph": "i", "s": "g", "pid": 0,
                                   "tid": 0, "ts": event.get("ts", 0),
                                   "args": {"max_bytes": self.max_bytes}},
                                  separators=(",", ":"))
            text = text if self._first else ",\n" + text
            self._file.write(text)
            self._written += len(text)
            self._first = False
            if self._queue.empty():
                closed_at = self._file.tell()
                self._file.write(_CLOSING)
                self._file.flush()
        if closed_at is not None:
            self._file.seek(closed_at)
        self._file.write(_CLOSING)
        self._file.truncate()
        self._file.close()

    def close(self) -> None:
        """Write what is queued, end the JSON array and close the file."""
        self.closed = True
        self.start()
        self._queue.put(None)
        self._writer.join(30.0)

    def _us(self, t: float) -> float:
        """Microseconds since the file was opened; earlier times clamp to 0."""
        return max(0.0, round((t - self._origin) * 1e6, 1))

    def _row(self, name: str) -> int:
        with self._lock:
            pid = self._rows.get(name)
            if pid is None:
                if self.truncated:
                    # The file is full: no new row is written, so none is kept (a
                    # name per step would otherwise grow this table for good).
                    return 0
                pid = self._rows[name] = len(self._rows) + 1
                new = True
            else:
                new = False
        if new:
            self._meta(pid, "process_name", {"name": name})
            self._meta(pid, "process_sort_index", {"sort_index": pid})
        return pid

    def _span(self, pid: int, name: str, start: float, end: float, args=None) -> None:
        ts = self._us(start)
        event = {"name": name, "ph": "X", "pid": pid, "tid": 0, "ts": ts,
                 "dur": max(0.0, round(self._us(end) - ts, 1))}
        if args:
            event["args"] = args
        self._emit(event)

    # -- hooks -----------------------------------------------------------------------

    def cycle(self) -> None:
        """Start of a background cycle (only recorded with ``mark_cycles``)."""
        if self.mark_cycles:
            self._emit({"name": "CYCLE_START", "ph": "i", "s": "g", "pid": 0, "tid": 0,
                        "ts": self._us(time.monotonic())})

    def negotiated(self, state, result) -> None:
        """A cycle of process set ``state`` ended; ``result`` is its ``CycleResult``.

        Ends the NEGOTIATE span of every agreed entry (and starts its QUEUE).
        """
        work = result.work
        if not work:
            return
        now = time.monotonic()
        ranks = state.ranks
        coordinated = result.coordinated
        arrivals = {}
        if coordinated is not None and state.controller.coordinator is not None:
            arrivals = state.controller.coordinator.arrivals  # this cycle's releases
        cached_by = "learned order" if result.fast else "response cache"
        for index, (response, entry) in enumerate(work):
            if entry is None or not entry.enqueued_at:
                continue
            entry.negotiated_at = now
            start = entry.enqueued_at
            ticks = ()
            args = {"process_set": state.id}
            if coordinated is None or index < coordinated:
                args["agreed_by"] = cached_by
                args["ready"] = "every rank, at agreement (per-rank times not exchanged)"
            else:
                args["agreed_by"] = "coordinator"
                times = arrivals.get(response.name)
                if times:
                    ticks = sorted(times.items(), key=lambda item: (item[1], item[0]))
                    start = min(start, ticks[0][1])
                    args["ready_ranks"] = [ranks[r] for r, _ in ticks]
            if response.joined:
                args["joined_ranks"] = [ranks[r] for r in response.joined]
            if response.error:
                args["error"] = response.error.splitlines()[0]
            pid = self._row(response.name)
            self._span(pid, f"NEGOTIATE_{response.op.name}", start, now, args)
            for set_rank, seen in ticks:
                rank = ranks[set_rank]
                self._emit({"name": str(rank), "ph": "i", "s": "t", "pid": pid, "tid": 0,
                            "ts": self._us(seen), "args": {"ready_rank": rank}})

    def wrap(self, items, started: float, done, engine: str = "", phases=None):
        """Wrap a batch's completion callback so it records the batch's phases.

        Args:
            items: the batch's (response, entry) pairs.
            started: when the executor began launching the batch.
            done: the callback the completion thread runs after the transfer.
            engine: what moved the data ("MPI"); default GLOO, or NCCL for CUDA.
            phases: a list the transfer fills with ``(name, start, end)`` of its
                phases (a hierarchical collective's), shown inside the transfer.
        """
        issued = time.monotonic()
        started = started or issued  # recording began while the batch launched

        def timed():
            waited = time.monotonic()
            done()
            self._executed(items, started, issued, waited, time.monotonic(), engine, phases)

        return timed

    def _executed(self, items, started, issued, waited, finished, engine="",
                  phases=None) -> None:
        fused = len(items) > 1
        for response, entry in items:
            op = response.op.name
            backend = engine or ("NCCL" if response.device.startswith("cuda") else "GLOO")
            pid = self._row(response.name)
            if entry is not None and 0.0 < entry.negotiated_at <= started:
                self._span(pid, "QUEUE", entry.negotiated_at, started)
            self._span(pid, op, started, finished,
                       {"dtype": response.dtype, "shape": list(response.shape),
                        "fused_with": len(items) - 1})
            self._span(pid, "MEMCPY_IN_FUSION_BUFFER" if fused else "LAUNCH", started, issued)
            self._span(pid, f"{backend}_{op}", issued, waited)
            for name, begun, ended in phases or ():
                self._span(pid, name, begun, ended)
            self._span(pid, "MEMCPY_OUT_FUSION_BUFFER" if fused else "FINALIZE", waited,
                       finished)


_CLOSING = "\n]\n"


def _reopen(path: str):
    """``path`` opened to continue its JSON array (closing bracket removed), or
    None when it is not a complete timeline file."""
    try:
        f = os.fdopen(open_output_file(path, create=False, read=True), "r+", encoding="utf-8")
    except OSError:
        return None
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - 64))
    tail = f.read()
    end = tail.rstrip()
    if size < 2 or not end.endswith("]"):
        f.close()
        return None
    keep = size - len(tail.encode()) + len(end[:-1].rstrip().encode())
    f.seek(keep)
    f.truncate()
    return f


def _path_for(path: str, rank: int) -> Optional[str]:
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    return path if rank == 0 else None


class Recording:
    """A runtime's timeline slot: the Timeline recording now, or None.

    The runtime makes one and hands it to every executor and controller it
    builds; they read :attr:`timeline` at each hook, so starting or stopping
    a recording (``hvd.start_timeline``/``stop_timeline``) changes nothing
    but this slot.

    Args:
        rank: this process's global rank (names the file, picks who writes).
        default_max_bytes: the ``timeline_max_bytes`` knob.
    """

    def __init__(self, rank: int, default_max_bytes: int = DEFAULT_MAX_BYTES):
        self.rank = rank
        self.default_max_bytes = default_max_bytes
        self.timeline: Optional[Timeline] = None
        # What start_timeline (or the knob) asked for, on every rank (only some
        # write): an elastic re-form continues it in the next runtime.
        self.request: Optional[tuple] = None

    def recording(self) -> bool:
        return self.timeline is not None

    def open(self, file_path: str, mark_cycles: bool = False,
             max_bytes: Optional[int] = None) -> None:
        """Open a new file (closing the one open); its writer starts with :meth:`start`.

        Raises:
            ValueError: an empty path, a path that cannot be written, or a bad
                ``max_bytes`` (None: the knob).
        """
        if not isinstance(file_path, str) or not file_path:
            raise ValueError(f"start_timeline: file_path must be a non-empty str, "
                             f"got {file_path!r}")
        if max_bytes is None:
            max_bytes = self.default_max_bytes
        check_max_bytes(max_bytes, "start_timeline: max_bytes")
        if self.request is not None and self.request[0] == file_path:
            # The file being recorded (Horovod keeps writing it too): truncating
            # it would lose what was recorded; only the cycle marks follow the call.
            self.request = (file_path, bool(mark_cycles), self.request[2])
            if self.timeline is not None:
                self.timeline.mark_cycles = bool(mark_cycles)
            return
        self.close()
        self.request = (file_path, bool(mark_cycles), max_bytes)
        path = _path_for(file_path, self.rank)
        if path is None:
            return
        try:
            self.timeline = Timeline(path, bool(mark_cycles), self.rank, max_bytes)
        except OSError as exc:
            raise ValueError(f"start_timeline: cannot write {path!r}: {exc}") from None

    def start(self) -> None:
        if self.timeline is not None:
            self.timeline.start()

    def close(self) -> None:
        """Stop recording and close the file (a no-op when not recording)."""
        timeline, self.timeline = self.timeline, None
        self.request = None
        if timeline is not None:
            timeline.close()

    def detach(self) -> tuple:
        """``(request, timeline)``, leaving this slot empty without closing the file
        (the next runtime of an elastic job adopts them)."""
        taken = (self.request, self.timeline)
        self.request, self.timeline = None, None
        return taken

    def adopt(self, request: Optional[tuple], timeline: Optional[Timeline],
              generation: int = 0) -> None:
        """Continue the previous runtime's recording after an elastic re-form.

        A process that was writing a file goes on writing it (same writer, same
        clock), whatever its new rank. One that was not and now should (it
        became rank 0) continues the file from its end when it is complete,
        else -- its writer died mid-way -- starts ``<path>.gen<generation>``.
        """
        self.close()
        self.request = request
        if timeline is not None and not timeline.closed:
            self.timeline = timeline
            return
        path = _path_for(request[0], self.rank) if request else None
        if timeline is not None:  # closed by a re-form attempt that failed: reopen it
            path = timeline.path
        if path is None:
            return
        origin = timeline._origin if timeline is not None else None
        try:
            try:
                self.timeline = Timeline(path, request[1], self.rank, request[2], append=True,
                                         origin=origin, must_append=os.path.exists(path))
            except _NotATimeline:
                self.timeline = Timeline(f"{path}.gen{generation}", request[1], self.rank,
                                         request[2])
        except OSError as exc:
            from .log import logger

            logger.warning("timeline %s not continued after the re-form: %s", path, exc)
