"""The timeline: a Chrome-trace JSON file of what every collective went through.

Open the file in ``chrome://tracing`` or https://ui.perfetto.dev. Each tensor
name gets a row; on it:

* ``NEGOTIATE_<OP>`` -- from submission until the ranks agreed to run it;
* ``<OP>`` (``ALLREDUCE``, ``BROADCAST``...) -- from launch until its handle
  completed, containing
  ``MEMCPY_IN_FUSION_BUFFER`` (or ``LAUNCH`` when not fused: staging and
  starting the transfer), ``GLOO_<OP>``/``NCCL_<OP>`` (the transfer itself) and
  ``MEMCPY_OUT_FUSION_BUFFER`` (or ``FINALIZE``: copying results out).

With ``mark_cycles`` every background cycle adds a ``CYCLE_START`` instant.

Recording is off unless ``HVDLIKE_TIMELINE=path`` (``HOROVOD_TIMELINE``) is set
or :func:`start` is called; when off, the runtime's hooks cost one attribute
check. As in Horovod, rank 0 writes the file; a path containing ``{rank}``
is formatted per rank and every rank writes its own. Events are queued and
written by a thread of their own, so recording never blocks a collective.
A file stops growing at ``max_bytes`` (1 GiB unless told otherwise): a
``TIMELINE_TRUNCATED`` instant marks the point, later events are dropped, and
the file is still closed as valid JSON -- a forgotten timeline never fills a disk.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from typing import Dict, Optional

DEFAULT_MAX_BYTES = 1 << 30


class Timeline:
    """An open timeline file; thread-safe (events come from several threads).

    Args:
        path: file to write (truncated).
        mark_cycles: also record an instant at the start of each cycle.
        rank: written into the trace metadata.
        max_bytes: stop recording once the file reaches this size.
    """

    def __init__(self, path: str, mark_cycles: bool = False, rank: int = 0,
                 max_bytes: int = DEFAULT_MAX_BYTES):
        self.path = path
        self.mark_cycles = mark_cycles
        self.max_bytes = max_bytes
        self._written = 0
        self.truncated = False
        self._file = open(path, "w", encoding="utf-8")
        self._file.write("[\n")
        self._first = True
        self._origin = time.monotonic()
        self._rows: Dict[str, int] = {}
        self._lock = threading.Lock()
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="hvdlike-timeline",
                                        daemon=True)
        self._writer.start()
        self._emit({"name": "process_name", "ph": "M", "pid": 0,
                    "args": {"name": f"hvdlike rank {rank} cycles"}})

    # -- writing ---------------------------------------------------------------------

    def _emit(self, event: dict) -> None:
        self._queue.put(event)

    def _write_loop(self) -> None:
        while True:
            event = self._queue.get()
            if event is None:
                return
            if self.truncated:
                continue  # drain the queue, write nothing more
            text = json.dumps(event, separators=(",", ":"))
            if self._written + len(text) + 2 > self.max_bytes:
                self.truncated = True
                text = json.dumps({"name": "TIMELINE_TRUNCATED", "ph": "i", "s": "g", "pid": 0,
                                   "tid": 0, "ts": event.get("ts", 0),
                                   "args": {"max_bytes": self.max_bytes}})
            self._file.write(text if self._first else ",\n" + text)
            self._written += len(text) + 2
            self._first = False

    def close(self) -> None:
        """Write what is queued, end the JSON array and close the file."""
        self._queue.put(None)
        self._writer.join(10.0)
        self._file.write("\n]\n")
        self._file.close()

    def _us(self, t: float) -> float:
        return round((t - self._origin) * 1e6, 1)

    def _row(self, name: str) -> int:
        with self._lock:
            pid = self._rows.get(name)
            if pid is None:
                pid = self._rows[name] = len(self._rows) + 1
                new = True
            else:
                new = False
        if new:
            self._emit({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
            self._emit({"name": "process_sort_index", "ph": "M", "pid": pid,
                        "args": {"sort_index": pid}})
        return pid

    def _span(self, pid: int, name: str, start: float, end: float, args=None) -> None:
        event = {"name": name, "ph": "X", "pid": pid, "tid": 0, "ts": self._us(start),
                 "dur": max(0.0, round((end - start) * 1e6, 1))}
        if args:
            event["args"] = args
        self._emit(event)

    # -- hooks -----------------------------------------------------------------------

    def cycle(self) -> None:
        """Start of a background cycle (only recorded with ``mark_cycles``)."""
        if self.mark_cycles:
            self._emit({"name": "CYCLE_START", "ph": "i", "s": "g", "pid": 0, "tid": 0,
                        "ts": self._us(time.monotonic())})

    def negotiated(self, set_id: int, work) -> None:
        """The controller returned ``work`` (response, entry) pairs: negotiation ended."""
        now = time.monotonic()
        for response, entry in work:
            if entry is None or not entry.enqueued_at:
                continue
            args = {"process_set": set_id}
            if response.error:
                args["error"] = response.error.splitlines()[0]
            self._span(self._row(response.name), f"NEGOTIATE_{response.op.name}",
                       entry.enqueued_at, now, args)

    def wrap(self, items, started: float, done):
        """Wrap a batch's completion callback so it records the batch's phases.

        Args:
            items: the batch's (response, entry) pairs.
            started: when the executor began launching the batch.
            done: the callback the completion thread runs after the transfer.
        """
        issued = time.monotonic()

        def timed():
            waited = time.monotonic()
            done()
            self._executed(items, started, issued, waited, time.monotonic())

        return timed

    def _executed(self, items, started, issued, waited, finished) -> None:
        fused = len(items) > 1
        for response, _ in items:
            op = response.op.name
            backend = "NCCL" if response.device.startswith("cuda") else "GLOO"
            pid = self._row(response.name)
            self._span(pid, op, started, finished,
                       {"dtype": response.dtype, "shape": list(response.shape),
                        "fused_with": len(items) - 1})
            self._span(pid, "MEMCPY_IN_FUSION_BUFFER" if fused else "LAUNCH", started, issued)
            self._span(pid, f"{backend}_{op}", issued, waited)
            self._span(pid, "MEMCPY_OUT_FUSION_BUFFER" if fused else "FINALIZE", waited,
                       finished)


def _path_for(path: str, rank: int) -> Optional[str]:
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    return path if rank == 0 else None


def start(runtime, file_path: str, mark_cycles: bool = False) -> None:
    """Start recording on ``runtime`` (replacing a timeline already running)."""
    if not isinstance(file_path, str) or not file_path:
        raise ValueError(f"start_timeline: file_path must be a non-empty str, got {file_path!r}")
    stop(runtime)
    path = _path_for(file_path, runtime.topology.rank)
    if path is None:
        return
    try:
        timeline = Timeline(path, bool(mark_cycles), runtime.topology.rank)
    except OSError as exc:
        raise ValueError(f"start_timeline: cannot write {path!r}: {exc}") from None
    attach(runtime, timeline)


def attach(runtime, timeline: Optional[Timeline]) -> None:
    runtime.timeline = timeline
    for state in list(runtime.process_sets.values()):
        state.executor.timeline = timeline


def stop(runtime) -> None:
    """Stop recording and close the file (a no-op when not recording)."""
    timeline = runtime.timeline
    if timeline is None:
        return
    attach(runtime, None)
    timeline.close()
