"""Timeline files written on real ranks: start/stop from code and the environment knob."""

import json
import os

from tests.multiproc.harness import run_ranks


def _record(path):
    import os

    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r = hvd.rank()
    hvd.allreduce(torch.ones(2), name="before")  # not recorded
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(torch.ones(3), name="solo")
    hvd.grouped_allreduce([torch.ones(2), torch.ones(4)], name="grp")
    hvd.broadcast(torch.ones(2), root_rank=1, name="bc")
    hvd.stop_timeline()
    hvd.allreduce(torch.ones(2), name="after")  # not recorded
    errors = []
    try:
        hvd.start_timeline(os.path.join(path, "no", "such", "dir.json"))
    except ValueError as exc:
        errors.append(str(exc))
    hvd.barrier()
    hvd.shutdown()
    return r, os.path.exists(path), errors


def _load(path):
    with open(path) as f:
        return json.load(f)  # complete JSON: the array is closed


def _spans(events, row):
    pids = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"
            and e["args"]["name"] == row}
    assert len(pids) == 1, row
    pid = pids.pop()
    return {e["name"]: e for e in events if e["pid"] == pid and e["ph"] == "X"}


def test_start_stop_timeline_two_ranks(tmp_path):
    path = str(tmp_path / "timeline.json")
    results = run_ranks(_record, np=2, args=(path,), timeout=90)
    assert results[0][1]
    # Only rank 0 writes a shared path, so only rank 0 notices it cannot.
    assert "cannot write" in results[0][2][0] and results[1][2] == []
    events = _load(path)
    rows = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert {"solo", "grp.0", "grp.1", "bc"} <= rows
    assert not rows & {"before", "after"}
    assert any(e["name"] == "CYCLE_START" and e["ph"] == "i" for e in events)

    solo = _spans(events, "solo")
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "LAUNCH", "GLOO_ALLREDUCE", "FINALIZE"} <= set(solo)
    op = solo["ALLREDUCE"]
    assert solo["NEGOTIATE_ALLREDUCE"]["ts"] <= op["ts"]
    for phase in ("LAUNCH", "GLOO_ALLREDUCE", "FINALIZE"):  # nested inside the op
        assert op["ts"] <= solo[phase]["ts"]
        assert solo[phase]["ts"] + solo[phase]["dur"] <= op["ts"] + op["dur"] + 1.0
    assert op["args"] == {"dtype": "float32", "shape": [3], "fused_with": 0}

    for member in ("grp.0", "grp.1"):
        fused = _spans(events, member)
        assert {"MEMCPY_IN_FUSION_BUFFER", "GLOO_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER"} <= \
            set(fused)
        assert fused["ALLREDUCE"]["args"]["fused_with"] == 1
    assert {"NEGOTIATE_BROADCAST", "BROADCAST", "GLOO_BROADCAST"} <= set(_spans(events, "bc"))


def _from_env():
    import torch

    import hvdlike.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(2), name="env.x")
    hvd.barrier()
    hvd.shutdown()  # closes the file


def test_timeline_knob_every_rank_with_placeholder(tmp_path):
    pattern = str(tmp_path / "tl-{rank}.json")
    run_ranks(_from_env, np=2, env={"HOROVOD_TIMELINE": pattern}, timeout=90)
    for rank in (0, 1):
        events = _load(pattern.replace("{rank}", str(rank)))
        names = {e["name"] for e in events}
        assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "NEGOTIATE_BARRIER"} <= names
        assert "CYCLE_START" not in names  # marks are off unless asked for
    assert not os.path.exists(str(tmp_path / "tl-{rank}.json"))
