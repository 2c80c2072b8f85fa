"""What a runtime keeps per name or per process set stays bounded (no processes)."""

import json
import time

from hvdlike.core import generation_keys
from hvdlike.core.timeline import Timeline
from tests.local_store import DictStore


def test_a_removed_sets_keys_are_deleted_by_its_last_member_and_forgotten():
    store = DictStore()
    logs = [generation_keys.KeyLog(store, "gen1/") for _ in range(2)]
    for member, log in enumerate(logs):
        log.set(f"ps3/control/arrived/{member}", "1")
        log.set(f"ps30/control/arrived/{member}", "1")  # another set: stays
        log.set(f"health/hb/{member}", "1")
    assert not generation_keys.forget_part(logs[1], "ps3/", rank=1, size=2)
    assert "gen1/ps3/control/arrived/0" in store.data  # member 0 may still use them
    assert generation_keys.forget_part(logs[0], "ps3/", rank=0, size=2)
    assert sorted(store.data) == ["gen1/health/hb/0", "gen1/health/hb/1",
                                  "gen1/ps30/control/arrived/0", "gen1/ps30/control/arrived/1"]
    for member, log in enumerate(logs):  # the generation's own end deletes only the rest
        assert log.written() == [f"gen1/health/hb/{member}", f"gen1/ps30/control/arrived/{member}"]


def test_a_published_key_list_drops_a_removed_sets_keys():
    store = DictStore()
    log = generation_keys.KeyLog(store, "elastic4/", publish="keys/0.0")
    log.set("ps2/verdict", "go")
    log.set("health/hb/0", "1")
    assert generation_keys.forget_part(log, "ps2/", rank=0, size=1)
    assert json.loads(store.data["elastic4/keys/0.0"]) == ["elastic4/health/hb/0",
                                                           "elastic4/keys/0.0"]


def test_a_full_timeline_keeps_no_row_per_new_name(tmp_path):
    """A collective named afresh every step, recorded past the file's limit: the
    table of rows stopped growing with the file (it grew by one entry a step)."""
    path = tmp_path / "timeline.json"
    timeline = Timeline(str(path), max_bytes=4096)
    timeline.start()
    step = 0
    deadline = time.monotonic() + 60
    while not timeline.truncated:  # the writer thread marks the file full
        assert time.monotonic() < deadline, "the timeline never reached its limit"
        timeline._span(timeline._row(f"allreduce.grad.{step}"), "ALLREDUCE", 0.0, 1.0)
        step += 1
        if step % 50 == 0:
            time.sleep(0.01)
    rows = len(timeline._rows)
    for later in range(step, step + 5000):
        timeline._span(timeline._row(f"allreduce.grad.{later}"), "ALLREDUCE", 0.0, 1.0)
    assert len(timeline._rows) == rows
    timeline.close()
    events = json.loads(path.read_text())  # still a complete trace
    assert events[-1]["name"] == "TIMELINE_TRUNCATED"
