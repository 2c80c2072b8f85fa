"""The timeline writer on its own: valid Chrome-trace JSON from several threads,
readiness marks from the coordinator, the phases of a batch and the size cap."""

import os
import threading
import time
from types import SimpleNamespace

import pytest

from hvdlike.core import config
from hvdlike.core.controller import Controller, CycleResult
from hvdlike.core.coordinator import Coordinator
from hvdlike.core.messages import OpType, Request, Response
from hvdlike.core.tensor_queue import Entry
from hvdlike.core.timeline import (DEFAULT_MAX_BYTES, MIN_MAX_BYTES, Timeline, _path_for,
                                   check_max_bytes)
from tests import chrome_trace
from tests.unit.fake_ranks import Exchange, FastControl, run_in_threads
from tests.unit.test_controller import _entry


def _work(name, op=OpType.ALLREDUCE):
    response = Response(name=name, op=op, dtype="float32", shape=(4,))
    entry = Entry(request=None, tensor=None, output=None, handle=None,
                  enqueued_at=time.monotonic() - 0.01)
    return response, entry


def _state(set_id=0, ranks=(0,), coordinator=None):
    return SimpleNamespace(id=set_id, ranks=list(ranks),
                           controller=SimpleNamespace(coordinator=coordinator))


def _result(work, coordinated=None, fast=False):
    result = CycleResult()
    result.work = list(work)
    result.coordinated = coordinated
    result.fast = fast
    return result


def test_events_from_several_threads_make_valid_json(tmp_path):
    path = tmp_path / "t.json"
    tl = Timeline(str(path), mark_cycles=True, rank=3)
    done = []

    def finisher(i):
        items = [_work(f"t{i}.a"), _work(f"t{i}.b")]
        tl.negotiated(_state(), _result(items))
        timed = tl.wrap(items, time.monotonic(), lambda: done.append(i))
        timed()

    threads = [threading.Thread(target=finisher, args=(i,)) for i in range(4)]
    tl.cycle()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tl.close()
    events = chrome_trace.load(path)
    assert sorted(done) == [0, 1, 2, 3]
    assert set(chrome_trace.rows(events)) == {"hvdlike rank 3 cycles"} | {
        f"t{i}.{x}" for i in range(4) for x in "ab"}
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 8 * 6  # negotiate, queue, op + three phases per tensor
    assert {e["name"] for e in spans} == {"NEGOTIATE_ALLREDUCE", "QUEUE", "ALLREDUCE",
                                          "MEMCPY_IN_FUSION_BUFFER", "GLOO_ALLREDUCE",
                                          "MEMCPY_OUT_FUSION_BUFFER"}
    assert [e["name"] for e in events if e["ph"] == "i"] == ["CYCLE_START"]


def test_a_row_reads_negotiate_queue_then_the_op_and_its_phases(tmp_path):
    path = tmp_path / "t.json"
    tl = Timeline(str(path))
    items = [_work("a"), _work("b")]
    tl.negotiated(_state(), _result(items))
    started = time.monotonic()
    tl.wrap(items, started, lambda: None)()
    tl.close()
    events = chrome_trace.load(path)
    row = chrome_trace.on_row(events, "a")
    names = [e["name"] for e in row]
    assert names == ["NEGOTIATE_ALLREDUCE", "QUEUE", "ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER",
                     "GLOO_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER"]
    negotiate, queue, op = row[:3]
    # QUEUE starts where NEGOTIATE ends (agreement) and ends where the op starts.
    assert queue["ts"] == pytest.approx(negotiate["ts"] + negotiate["dur"], abs=0.2)
    assert op["ts"] == pytest.approx(queue["ts"] + queue["dur"], abs=0.2)
    for phase in row[3:]:  # nested inside the op
        assert op["ts"] <= phase["ts"]
        assert phase["ts"] + phase["dur"] <= op["ts"] + op["dur"] + 0.2
    assert negotiate["args"]["agreed_by"] == "response cache"


def test_coordinator_marks_when_each_rank_was_ready(tmp_path):
    coordinator = Coordinator(3, record_arrivals=lambda: True)
    path = tmp_path / "t.json"
    tl = Timeline(str(path))
    time.sleep(0.01)  # the made-up times below lie between opening and now
    t0 = tl._origin
    req = dict(op=OpType.ALLREDUCE, dtype="float32", shape=(4,))
    coordinator.add([Request(name="w", rank=2, **req)], now=t0)
    coordinator.add([Request(name="w", rank=0, **req)], now=t0 + 0.002)
    coordinator.add([Request(name="w", rank=1, **req), Request(name="v", rank=1, **req)],
                    now=t0 + 0.005)
    responses = coordinator.ready()
    assert [r.name for r in responses] == ["w"]
    assert coordinator.arrivals == {"w": {2: t0, 0: t0 + 0.002, 1: t0 + 0.005}}

    entry = Entry(request=None, tensor=None, output=None, handle=None, enqueued_at=t0 + 0.001)
    # A subset with global ranks 4, 6, 7: the marks name global ranks.
    tl.negotiated(_state(set_id=2, ranks=(4, 6, 7), coordinator=coordinator),
                  _result([(responses[0], entry)], coordinated=0))
    tl.close()
    events = chrome_trace.load(path)
    (negotiate,) = chrome_trace.on_row(events, "w")
    ticks = chrome_trace.on_row(events, "w", ph="i")
    assert [t["name"] for t in ticks] == ["7", "4", "6"]  # in arrival order
    assert [t["args"]["ready_rank"] for t in ticks] == [7, 4, 6]
    assert all(t["s"] == "t" for t in ticks)
    assert negotiate["args"] == {"process_set": 2, "agreed_by": "coordinator",
                                 "ready_ranks": [7, 4, 6]}
    # The span starts with the first rank ready (before this rank submitted)
    # and contains every mark.
    assert negotiate["ts"] == ticks[0]["ts"]
    assert ticks[1]["ts"] - ticks[0]["ts"] == pytest.approx(2000, abs=1)
    for tick in ticks:
        assert negotiate["ts"] <= tick["ts"] <= negotiate["ts"] + negotiate["dur"]

    # Released names are forgotten; the pending one is kept until it completes.
    coordinator.add([Request(name="v", rank=r, **req) for r in (0, 2)], now=t0 + 0.01)
    assert [r.name for r in coordinator.ready()] == ["v"]
    assert set(coordinator.arrivals) == {"v"} and not coordinator._arrived
    assert coordinator.ready() == [] and coordinator.arrivals == {}


def test_coordinator_records_nothing_unless_asked():
    coordinator = Coordinator(2)
    req = dict(op=OpType.ALLREDUCE, dtype="float32", shape=(4,))
    coordinator.add([Request(name="w", rank=r, **req) for r in (0, 1)])
    assert [r.name for r in coordinator.ready()] == ["w"]
    assert coordinator.arrivals == {} and coordinator._arrived == {}


def test_cached_agreement_is_annotated_not_marked(tmp_path):
    path = tmp_path / "t.json"
    tl = Timeline(str(path))
    coordinator = Coordinator(2)
    coordinator.arrivals = {"c": {0: time.monotonic()}}  # stale: not this cycle's
    tl.negotiated(_state(ranks=(0, 1), coordinator=coordinator),
                  _result([_work("c"), _work("n")], coordinated=1))
    tl.negotiated(_state(ranks=(0, 1)), _result([_work("f")], fast=True))
    tl.close()
    events = chrome_trace.load(path)
    assert not [e for e in events if e["ph"] == "i"]
    by = {row: chrome_trace.on_row(events, row)[0]["args"]["agreed_by"] for row in "cnf"}
    assert by == {"c": "response cache", "n": "coordinator", "f": "learned order"}
    assert "ready_ranks" not in chrome_trace.on_row(events, "n")[0]["args"]


def test_controller_reports_how_each_response_was_agreed(tmp_path):
    """Two ranks on threads: negotiated, then cached, then on the learned order."""

    size, cycles = 2, 12
    ex = Exchange(size)
    paths = [tmp_path / f"tl-{r}.json" for r in range(size)]
    step = threading.Barrier(size, timeout=10)

    def body(rank):
        ctl = Controller(FastControl(ex, rank), 16, record_arrivals=lambda: True)
        state = SimpleNamespace(id=0, ranks=[0, 1], controller=ctl)
        tl = Timeline(str(paths[rank]), rank=rank)
        for c in range(cycles):
            # Rank 1 asks for "w" in cycle 0, rank 0 only in cycle 1; then both
            # submit it every other cycle.
            submit = (c == 1) if rank == 0 else (c == 0)
            submit = submit or (c >= 3 and c % 2 == 1)
            entries = [_entry("w", rank)] if submit else []
            for entry in entries:
                entry.enqueued_at = time.monotonic()
            step.wait()
            result = ctl.cycle(entries)
            tl.negotiated(state, result)
            time.sleep(0.002)  # cycles apart on the clock
        tl.close()

    run_in_threads(size, body)

    coordinator_file = chrome_trace.load(paths[0])
    spans = chrome_trace.on_row(coordinator_file, "w")
    agreed_by = [s["args"]["agreed_by"] for s in spans]
    assert len(agreed_by) == 6  # cycle 1, then cycles 3, 5, 7, 9, 11
    assert agreed_by[:2] == ["coordinator", "response cache"]
    assert agreed_by[-1] == "learned order"
    assert set(agreed_by[2:]) <= {"response cache", "learned order"}
    assert spans[0]["args"]["ready_ranks"] == [1, 0]  # rank 1 was ready a cycle earlier
    ticks = chrome_trace.on_row(coordinator_file, "w", ph="i")
    assert [t["name"] for t in ticks] == ["1", "0"]
    assert spans[0]["ts"] == ticks[0]["ts"] < ticks[1]["ts"]

    other = chrome_trace.on_row(chrome_trace.load(paths[1]), "w")
    assert [s["args"]["agreed_by"] for s in other] == [s["args"]["agreed_by"] for s in spans]
    assert "ready_ranks" not in other[0]["args"]  # only the coordinator saw the requests
    assert not [e for e in chrome_trace.load(paths[1]) if e["ph"] == "i"]


def test_cycles_not_marked_unless_asked(tmp_path):
    tl = Timeline(str(tmp_path / "t.json"))
    tl.cycle()
    tl.close()
    assert all(e["ph"] != "i" for e in chrome_trace.load(tmp_path / "t.json"))


def test_path_per_rank():
    assert _path_for("/x/tl.json", 0) == "/x/tl.json"
    assert _path_for("/x/tl.json", 1) is None
    assert _path_for("/x/tl-{rank}.json", 1) == "/x/tl-1.json"


def test_size_cap_truncates_but_keeps_valid_json(tmp_path):
    path = tmp_path / "t.json"
    tl = Timeline(str(path), max_bytes=MIN_MAX_BYTES)
    for i in range(100):
        items = [_work(f"tensor{i}")]
        tl.negotiated(_state(), _result(items))
        tl.wrap(items, time.monotonic(), lambda: None)()
    tl.close()
    events = chrome_trace.load(path)
    assert tl.truncated and path.stat().st_size <= MIN_MAX_BYTES
    assert events[-1]["name"] == "TIMELINE_TRUNCATED"
    assert events[-1]["args"] == {"max_bytes": MIN_MAX_BYTES}
    assert sum(e["name"] == "TIMELINE_TRUNCATED" for e in events) == 1
    assert len(events) > 10


def test_size_cap_is_checked():
    assert check_max_bytes(MIN_MAX_BYTES) == MIN_MAX_BYTES
    for bad in (MIN_MAX_BYTES - 1, 0, -5, 4096.0, "4096", True, None):
        with pytest.raises(ValueError, match="max_bytes must be an int >= 4096"):
            check_max_bytes(bad)
    knob = config.KNOBS_BY_FIELD["timeline_max_bytes"]
    assert knob.default == DEFAULT_MAX_BYTES
    assert knob.parse(str(MIN_MAX_BYTES)) == MIN_MAX_BYTES
    with pytest.raises(ValueError):
        knob.parse(str(MIN_MAX_BYTES - 1))


def test_an_unwritable_timeline_setting_names_the_variable_at_init(tmp_path):
    from hvdlike.core.errors import ConfigError
    from hvdlike.core.runtime import Runtime

    target = str(tmp_path / "missing" / "t.json")
    with pytest.raises(ConfigError) as caught:
        Runtime.build(environ={"HVDLIKE_TIMELINE": target})
    text = str(caught.value)
    assert text.startswith(f"HVDLIKE_TIMELINE={target!r}") and "cannot write" in text
    assert "start_timeline" not in text


def test_a_timeline_path_that_is_a_planted_symbolic_link_is_refused(tmp_path):
    # In a shared folder (/tmp) another user's link would make the job overwrite
    # the file it points to.
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    link = tmp_path / "timeline.json"
    link.symlink_to(victim)
    with pytest.raises(OSError, match="is a symbolic link; refusing to follow it"):
        Timeline(str(link))
    fifo = tmp_path / "timeline.fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="is a FIFO, not a regular file"):
        Timeline(str(fifo))  # and does not block
    assert victim.read_text() == "precious\n"


def test_the_file_is_complete_json_between_batches_not_only_after_close(tmp_path):
    # A rank killed by a signal, or ended by MPI_Abort, never closes its timeline:
    # what it recorded must still load as JSON (strict tools refuse an open array).
    import json

    path = tmp_path / "t.json"
    tl = Timeline(str(path))
    tl.start()
    seen = []
    for i in range(3):
        items = [_work(f"batch{i}")]
        tl.negotiated(_state(), _result(items))
        tl.wrap(items, time.monotonic(), lambda: None)()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                events = json.loads(path.read_text())
            except ValueError:
                time.sleep(0.01)  # the writer is between an event and the bracket
                continue
            if f"batch{i}" in set(chrome_trace.rows(events)):
                break
            time.sleep(0.01)
        else:
            raise AssertionError(f"batch {i} never showed in a complete file: "
                                 f"{path.read_text()[-300:]!r}")
        seen.append(len(events))
    tl.close()
    final = json.loads(path.read_text())
    assert seen == sorted(seen) and len(final) >= seen[-1]
    assert path.read_text().endswith("}\n]\n")


def test_starting_the_timeline_being_recorded_again_keeps_what_it_holds(tmp_path):
    from hvdlike.core.timeline import Recording

    path = str(tmp_path / "t.json")
    recording = Recording(rank=0)
    recording.open(path)
    recording.start()
    first = recording.timeline
    items = [_work("before")]
    first.negotiated(_state(), _result(items))
    first.wrap(items, time.monotonic(), lambda: None)()
    recording.open(path, mark_cycles=True)  # Horovod: the same file goes on
    assert recording.timeline is first and first.mark_cycles
    items = [_work("after")]
    first.negotiated(_state(), _result(items))
    first.wrap(items, time.monotonic(), lambda: None)()
    recording.close()
    assert {"before", "after"} <= set(chrome_trace.rows(chrome_trace.load(tmp_path / "t.json")))
    recording.open(str(tmp_path / "other.json"))  # another path: a new file
    assert recording.timeline is not first
    recording.close()
