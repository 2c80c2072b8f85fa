"""Waits while a process set is built: they end on the job's failure, a gone member, or time."""

import datetime
import re
import threading
import time

import pytest

from hvdlike.core import config, health, store_wait
from hvdlike.core.errors import HvdlikeInternalError
from hvdlike.core.transport import _arrive
from tests.local_store import host_store


def test_returns_once_every_key_is_written():
    store = host_store()
    store.set("host/0", "a")
    threading.Timer(0.2, lambda: store.set("host/2", "b")).start()
    store_wait.await_keys(store, ["host/0", "host/2"], [0, 2], 30, lambda: None,
                          lambda ranks: "", "the plane")
    assert store.get("host/2") == b"b"


def test_gives_up_when_the_job_fails():
    store = host_store()
    failed = []
    threading.Timer(0.2, lambda: failed.append(RuntimeError("rank 3 died"))).start()
    with pytest.raises(HvdlikeInternalError) as err:
        store_wait.await_keys(store, ["host/3"], [3], 60, lambda: failed[0] if failed else None,
                              lambda ranks: "", "the shared-memory plane of ranks [0, 3]")
    assert str(err.value) == ("gave up setting up the shared-memory plane of ranks [0, 3], "
                              "the job has failed: rank 3 died")


def test_asks_about_the_missing_ranks_only_and_stops_when_one_is_gone():
    store = host_store()
    store.set("k/1", "here")
    asked = []

    def gone(ranks):
        asked.append(list(ranks))
        return "rank 5 on h2 died or stopped responding" if len(asked) >= 2 else ""

    with pytest.raises(HvdlikeInternalError) as err:
        store_wait.await_keys(store, ["k/1", "k/2"], [4, 5], 60, lambda: None, gone, "the set")
    assert asked[0] == [5] and len(asked) == 2  # rank 4 wrote its key: never asked about
    assert str(err.value) == "could not set up the set: rank 5 on h2 died or stopped responding"


def test_names_the_ranks_still_missing_at_the_timeout():
    store = host_store()
    with pytest.raises(HvdlikeInternalError) as err:
        store_wait.await_keys(store, ["a", "b"], [1, 7], 0.3, lambda: None, lambda ranks: "",
                              "shared memory for ranks [0, 1, 7]")
    assert str(err.value) == ("could not set up shared memory for ranks [0, 1, 7]: rank(s) "
                              "[1, 7] did not take part within 0.3s")


def test_group_arrival_names_a_gone_member_by_its_global_rank():
    store = host_store()
    with pytest.raises(HvdlikeInternalError) as err:
        _arrive(store, 0, 2, datetime.timedelta(seconds=60), lambda: None, "control",
                members=[3, 8], gone=lambda ranks: f"rank(s) {list(ranks)} stopped beating")
    assert str(err.value) == "could not create the control group: rank(s) [8] stopped beating"


def test_the_health_probe_names_a_silent_rank_and_one_that_said_goodbye(monkeypatch):
    monkeypatch.setattr(health, "PEER_QUIET_SECONDS", 0.3)
    store = host_store()
    cfg = config.load({}, stall_check_time_seconds=0.2)  # heartbeat every 0.05 s
    watcher = health.Health(store, 0, 4, "h0", cfg, lambda: {}, lambda exc: None)
    try:
        store.set("health/host/1", "h1 (pid 11)")
        store.set("health/host/2", "h2 (pid 12)")
        store.set("health/host/3", "h3 (pid 13)")
        beating = threading.Event()

        def beat():  # rank 3 is alive
            while not beating.is_set():
                store.add("health/hb/3", 1)
                time.sleep(0.02)

        threading.Thread(target=beat, daemon=True).start()
        probe = watcher.watch()
        assert probe([1, 3]) == ""  # nothing known yet: rank 1 has not been silent long
        store.set("health/bye/2", "1")
        assert probe([2]) == "rank 2 on h2 (pid 12) shut down"
        time.sleep(0.5)
        named = probe([1, 3])  # rank 1 never beat; rank 3 did meanwhile
        assert re.fullmatch(r"rank 1 on h1 \(pid 11\) died or stopped responding \(no "
                            r"heartbeat for \d+s\)", named), named
        beating.set()
    finally:
        watcher.close(clean=False)


def test_before_the_watcher_starts_the_probe_reads_what_ranks_or_the_launcher_left():
    store = host_store()
    probe = health.words_probe(store)
    assert probe([1, 2, 3]) == ""
    store.set("health/shutdown/2", "was killed by signal 9 (SIGKILL) (seen by hvdlike-run)")
    store.set("health/bye/3", "1")
    assert probe([1, 2, 3]) == ("rank 2 was killed by signal 9 (SIGKILL) (seen by hvdlike-run)"
                                "; rank 3 shut down")
