"""Timeline files written on real ranks: start/stop from code and the environment knobs."""

import os

from tests import chrome_trace
from tests.multiproc.harness import run_ranks


def _record(path):
    import os

    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r = hvd.rank()
    hvd.allreduce(torch.ones(2), name="before")  # not recorded
    errors = []
    try:
        hvd.start_timeline(path, max_bytes=100)
    except ValueError as exc:
        errors.append(str(exc))
    hvd.start_timeline(path, mark_cycles=True)
    # Starting a timeline is local: without this barrier rank 1's request for
    # "solo" can reach the coordinator before rank 0 records arrivals.
    hvd.barrier()
    hvd.allreduce(torch.ones(3), name="solo")
    hvd.grouped_allreduce([torch.ones(2), torch.ones(4)], name="grp")
    hvd.broadcast(torch.ones(2), root_rank=1, name="bc")
    for _ in range(3):
        hvd.allreduce(torch.ones(2), name="rep")  # negotiated once, then cached
    hvd.stop_timeline()
    hvd.allreduce(torch.ones(2), name="after")  # not recorded
    try:
        hvd.start_timeline(os.path.join(path, "no", "such", "dir.json"))
    except ValueError as exc:
        errors.append(str(exc))
    hvd.barrier()
    hvd.shutdown()
    return r, os.path.exists(path), errors


def _spans(events, row):
    return {e["name"]: e for e in chrome_trace.on_row(events, row)}


def _inside(span, t):
    return span["ts"] <= t <= span["ts"] + span["dur"] + 1.0


def test_start_stop_timeline_two_ranks(tmp_path):
    path = str(tmp_path / "timeline.json")
    results = run_ranks(_record, np=2, args=(path,), timeout=90)
    assert results[0][1]
    for _, _, errors in results:  # a bad cap is refused on every rank alike
        assert "max_bytes must be an int >= 4096" in errors[0]
    # Only rank 0 writes a shared path, so only rank 0 notices it cannot.
    assert "cannot write" in results[0][2][1] and len(results[1][2]) == 1
    events = chrome_trace.load(path)
    rows = set(chrome_trace.rows(events))
    # Rows carry the names as negotiated: the collective's kind, then the caller's name.
    solo, grp, bc, rep = ("allreduce.solo", "grouped_allreduce.grp", "broadcast.bc",
                          "allreduce.rep")
    assert {solo, grp + ".0", grp + ".1", bc, rep} <= rows
    assert not rows & {"allreduce.before", "allreduce.after"}
    assert any(e["name"] == "CYCLE_START" and e["ph"] == "i" for e in events)

    spans = _spans(events, solo)
    assert {"NEGOTIATE_ALLREDUCE", "QUEUE", "ALLREDUCE", "LAUNCH", "SHM_ALLREDUCE",
            "FINALIZE"} <= set(spans)
    negotiate, queue, op = spans["NEGOTIATE_ALLREDUCE"], spans["QUEUE"], spans["ALLREDUCE"]
    assert negotiate["ts"] <= queue["ts"] <= op["ts"]
    for phase in ("LAUNCH", "SHM_ALLREDUCE", "FINALIZE"):  # nested inside the op
        assert op["ts"] <= spans[phase]["ts"]
        assert spans[phase]["ts"] + spans[phase]["dur"] <= op["ts"] + op["dur"] + 1.0
    assert op["args"] == {"dtype": "float32", "shape": [3], "fused_with": 0}

    # A new name went to the coordinator: rank 0's file marks when each rank was ready.
    assert negotiate["args"]["agreed_by"] == "coordinator"
    assert sorted(negotiate["args"]["ready_ranks"]) == [0, 1]
    ticks = chrome_trace.on_row(events, solo, ph="i")
    assert sorted(t["name"] for t in ticks) == ["0", "1"]
    assert all(_inside(negotiate, t["ts"]) for t in ticks)

    for member in (grp + ".0", grp + ".1"):
        fused = _spans(events, member)
        assert {"NEGOTIATE_ALLREDUCE", "QUEUE", "MEMCPY_IN_FUSION_BUFFER", "SHM_ALLREDUCE",
                "MEMCPY_OUT_FUSION_BUFFER"} <= set(fused)
        assert fused["ALLREDUCE"]["args"]["fused_with"] == 1
        assert fused["QUEUE"]["ts"] <= fused["ALLREDUCE"]["ts"] <= \
            fused["MEMCPY_IN_FUSION_BUFFER"]["ts"]
        assert len(chrome_trace.on_row(events, member, ph="i")) == 2
    assert {"NEGOTIATE_BROADCAST", "BROADCAST", "SHM_BROADCAST"} <= set(_spans(events, bc))

    # Repeats are agreed through the cache: annotated, without per-rank marks.
    reps = [e for e in chrome_trace.on_row(events, rep) if e["name"] == "NEGOTIATE_ALLREDUCE"]
    assert [e["args"]["agreed_by"] for e in reps][0] == "coordinator"
    assert {e["args"]["agreed_by"] for e in reps[1:]} <= {"response cache", "learned order"}
    assert len(reps) == 3 and all("ready_ranks" not in e["args"] for e in reps[1:])
    assert len(chrome_trace.on_row(events, rep, ph="i")) == 2  # the first one's only


def _from_env():
    import torch

    import hvdlike.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(2), name="env.x")
    # A set added while recording, coordinated by its first rank, global rank 1.
    only_1 = hvd.add_process_set([1])
    if hvd.rank() == 1:
        hvd.allreduce(torch.ones(2), name="sub.x", process_set=only_1)
    hvd.barrier()
    set_id = only_1.process_set_id
    hvd.shutdown()  # closes the file
    return set_id


def test_timeline_knob_every_rank_with_placeholder(tmp_path):
    pattern = str(tmp_path / "tl-{rank}.json")
    set_id = run_ranks(_from_env, np=2, timeout=90,
                       env={"HOROVOD_TIMELINE": pattern, "HVDLIKE_DYNAMIC_PROCESS_SETS": "1"})[0]
    files = [chrome_trace.load(pattern.replace("{rank}", str(rank))) for rank in (0, 1)]
    for rank, events in enumerate(files):
        names = {e["name"] for e in events}
        assert {"NEGOTIATE_ALLREDUCE", "QUEUE", "ALLREDUCE", "NEGOTIATE_BARRIER"} <= names
        assert "CYCLE_START" not in names  # marks are off unless asked for
        # Only the global set's coordinator (rank 0) marks its collectives.
        ticks = {e["name"] for e in chrome_trace.on_row(events, "allreduce.env.x", ph="i")}
        assert ticks == ({"0", "1"} if rank == 0 else set())
    assert "allreduce.sub.x" not in chrome_trace.rows(files[0])
    (negotiate,) = [e for e in chrome_trace.on_row(files[1], "allreduce.sub.x")
                    if e["name"] == "NEGOTIATE_ALLREDUCE"]
    assert negotiate["args"]["process_set"] == set_id
    assert negotiate["args"]["ready_ranks"] == [1]  # the set's rank 0 is global rank 1
    assert [e["name"] for e in chrome_trace.on_row(files[1], "allreduce.sub.x", ph="i")] == ["1"]
    assert not os.path.exists(str(tmp_path / "tl-{rank}.json"))


def _many(count):
    import torch

    import hvdlike.torch as hvd

    hvd.init()
    for i in range(count):
        hvd.allreduce(torch.ones(2), name=f"many.{i}")
    hvd.barrier()
    hvd.shutdown()


def test_cycle_marks_and_size_cap_from_the_environment(tmp_path):
    path = tmp_path / "capped.json"
    cap = 16384
    run_ranks(_many, np=2, args=(60,), timeout=90,
              env={"HVDLIKE_TIMELINE": str(path), "HVDLIKE_TIMELINE_MARK_CYCLES": "1",
                   "HVDLIKE_TIMELINE_MAX_BYTES": str(cap)})
    assert path.stat().st_size <= cap
    events = chrome_trace.load(path)  # still complete JSON
    names = [e["name"] for e in events]
    assert "CYCLE_START" in names and "NEGOTIATE_ALLREDUCE" in names
    assert names[-1] == "TIMELINE_TRUNCATED" and names.count("TIMELINE_TRUNCATED") == 1
    assert events[-1]["args"] == {"max_bytes": cap}
    rows = chrome_trace.rows(events)
    assert "allreduce.many.0" in rows and "allreduce.many.59" not in rows  # dropped past the cap
