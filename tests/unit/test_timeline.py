"""The timeline writer on its own: valid Chrome-trace JSON from several threads."""

import json
import threading
import time

from hvdlike.core.messages import OpType, Response
from hvdlike.core.tensor_queue import Entry
from hvdlike.core.timeline import Timeline, _path_for


def _work(name, op=OpType.ALLREDUCE):
    response = Response(name=name, op=op, dtype="float32", shape=(4,))
    entry = Entry(request=None, tensor=None, output=None, handle=None,
                  enqueued_at=time.monotonic() - 0.01)
    return response, entry


def test_events_from_several_threads_make_valid_json(tmp_path):
    path = tmp_path / "t.json"
    tl = Timeline(str(path), mark_cycles=True, rank=3)
    done = []

    def finisher(i):
        items = [_work(f"t{i}.a"), _work(f"t{i}.b")]
        tl.negotiated(0, items)
        timed = tl.wrap(items, time.monotonic(), lambda: done.append(i))
        timed()

    threads = [threading.Thread(target=finisher, args=(i,)) for i in range(4)]
    tl.cycle()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tl.close()
    events = json.loads(path.read_text())
    assert sorted(done) == [0, 1, 2, 3]
    rows = [e for e in events if e["name"] == "process_name"]
    assert {e["args"]["name"] for e in rows} == {"hvdlike rank 3 cycles"} | {
        f"t{i}.{x}" for i in range(4) for x in "ab"}
    assert len({e["pid"] for e in rows}) == len(rows)  # one row per tensor
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 8 * 5  # negotiate + op + three phases per tensor
    assert {e["name"] for e in spans} == {"NEGOTIATE_ALLREDUCE", "ALLREDUCE",
                                          "MEMCPY_IN_FUSION_BUFFER", "GLOO_ALLREDUCE",
                                          "MEMCPY_OUT_FUSION_BUFFER"}
    assert all(e["dur"] >= 0 for e in spans)
    assert [e["name"] for e in events if e["ph"] == "i"] == ["CYCLE_START"]


def test_cycles_not_marked_unless_asked(tmp_path):
    tl = Timeline(str(tmp_path / "t.json"))
    tl.cycle()
    tl.close()
    assert all(e["ph"] != "i" for e in json.loads((tmp_path / "t.json").read_text()))


def test_path_per_rank():
    assert _path_for("/x/tl.json", 0) == "/x/tl.json"
    assert _path_for("/x/tl.json", 1) is None
    assert _path_for("/x/tl-{rank}.json", 1) == "/x/tl-1.json"


def test_size_cap_truncates_but_keeps_valid_json(tmp_path):
    path = tmp_path / "t.json"
    tl = Timeline(str(path), max_bytes=2000)
    for i in range(100):
        tl.negotiated(0, [_work(f"tensor{i}")])
    tl.close()
    events = json.loads(path.read_text())
    assert tl.truncated and path.stat().st_size < 2400
    assert events[-1]["name"] == "TIMELINE_TRUNCATED"
    assert sum(e["name"] == "TIMELINE_TRUNCATED" for e in events) == 1
