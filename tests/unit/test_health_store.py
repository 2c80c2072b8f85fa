"""The health watcher against a store whose host goes away, or that stops
answering without an error as over a silently cut link (no ranks)."""

import threading
import time

from hvdlike.core import config, health
from hvdlike.core.errors import HvdlikeInternalError, StallError
from tests.local_store import client, host_store


class Watcher:
    """One rank's Health with what it reported collected."""

    def __init__(self, store, rank, size, stall_check=1):
        self.aborts, self.lost = [], []
        self.got = threading.Event()
        cfg = config.load({}, stall_check_time_seconds=stall_check)
        self.health = health.Health(store, rank, size, "host", cfg, lambda: {},
                                    self._abort, store_lost=self._lost)

    def _abort(self, exc):
        self.aborts.append(exc)
        self.got.set()

    def _lost(self, exc):
        self.lost.append(exc)
        self.got.set()


def test_a_store_that_goes_away_is_reported_once_and_the_watcher_stops(monkeypatch):
    monkeypatch.setattr(health, "STORE_LOST_SECONDS", 1.0)
    host = host_store(timeout=5)
    w = Watcher(client(host, timeout=5), rank=1, size=2)
    try:
        time.sleep(0.6)
        assert host.add("health/hb/1", 0) >= 1  # it beats while the store is up
        assert not w.got.is_set()
        del host  # the store's host dies
        assert w.got.wait(20), "the lost store was never reported"
        w.health._thread.join(5)
        assert not w.health._thread.is_alive()  # reported once, then the watcher stops
        assert w.aborts == [] and len(w.lost) == 1
        assert isinstance(w.lost[0], HvdlikeInternalError)
        text = str(w.lost[0])
        assert text.startswith("rank 1: the rendezvous store has been unreachable for ")
        assert "rank 0 if it hosted the store, is gone" in text
    finally:
        w.health.close(clean=False)


def test_a_short_outage_is_not_a_lost_store(monkeypatch):
    monkeypatch.setattr(health, "STORE_LOST_SECONDS", 30.0)
    host = host_store(timeout=5)
    w = Watcher(client(host, timeout=5), rank=1, size=2)
    try:
        del host
        time.sleep(1.5)  # several failed ticks, well inside the limit
        assert w.lost == [] and w.health._thread.is_alive()
    finally:
        w.health.close(clean=False)


def test_rank0_keeps_the_store_until_a_slow_peer_has_seen_the_abort():
    host = host_store(timeout=5)
    r0 = Watcher(client(host, timeout=5), rank=0, size=2, stall_check=1)   # looks every 0.25 s
    r1 = Watcher(client(host, timeout=5), rank=1, size=2, stall_check=8)   # looks every 1 s
    try:
        host.set("health/abort", "stalled for 2s; shutting down every rank.")
        assert r0.got.wait(10)
        assert isinstance(r0.aborts[0], StallError)
        r0.health.close(clean=False)  # rank 0's teardown: waits for rank 1 to look
        assert host.check(["health/abort_seen/1"]), "rank 0 closed before rank 1 saw the abort"
        assert r1.got.is_set() and isinstance(r1.aborts[0], StallError)
        assert not host.check(["health/abort_seen/0"])  # rank 0 posted it: no receipt
    finally:
        r1.health.close(clean=False)
        r0.health.close(clean=False)


def test_rank0_does_not_wait_for_a_dead_peer():
    host = host_store(timeout=5)
    r0 = Watcher(client(host, timeout=5), rank=0, size=3, stall_check=1)
    r2 = Watcher(client(host, timeout=5), rank=2, size=3, stall_check=1)  # alive; rank 1 never beats
    try:
        host.set("health/abort", "stalled for 2s; shutting down every rank.")
        assert r0.got.wait(10)
        started = time.monotonic()
        r0.health.close(clean=False)
        waited = time.monotonic() - started
        assert host.check(["health/abort_seen/2"])
        assert not host.check(["health/abort_seen/1"])
        # rank 1's heartbeat never moved: given up after the quiet limit, not the 15 s cap
        assert waited < 12, f"rank 0 waited {waited:.1f}s for a dead peer"
    finally:
        r2.health.close(clean=False)
        r0.health.close(clean=False)


class HangingStore:
    """An in-memory store whose requests can be made to block, as on a cut link
    (no reset: the request neither answers nor fails)."""

    def __init__(self):
        self.data = {}
        self.lock = threading.Lock()
        self.hanging = False   # requests from now on block ...
        self.once = False      # ... only the next one (then answers resume)
        self.released = threading.Event()  # ... until this is set
        self.entered = threading.Event()   # a request is blocked now
        self.blocked = 0       # requests that reached the store while it hangs

    def hang(self, once=False):
        self.hanging, self.once = True, once

    def _request(self):
        with self.lock:
            if not self.hanging:
                return
            self.blocked += 1
            if self.once:
                self.hanging = False
        self.entered.set()
        self.released.wait()

    def set(self, key, value):
        self._request()
        with self.lock:
            self.data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key):
        self._request()
        with self.lock:
            return self.data[key]

    def check(self, keys):
        self._request()
        with self.lock:
            return all(k in self.data for k in keys)

    def add(self, key, amount):
        self._request()
        with self.lock:
            value = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(value).encode()
            return value


def returns_within(seconds, fn):
    """``fn()``'s result, called on a thread; fails the test if it has not returned in time."""
    box = []
    thread = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert box, f"did not return within {seconds}s"
    return box[0]


def test_a_store_that_stops_answering_is_a_lost_store_and_diagnosis_still_returns(monkeypatch):
    monkeypatch.setattr(health, "STORE_LOST_SECONDS", 1.0)
    monkeypatch.setattr(health, "STORE_ANSWER_SECONDS", 0.5)
    store = HangingStore()
    w = Watcher(store, rank=1, size=2)
    try:
        store.hang()  # for good: the link is cut and stays cut
        assert store.entered.wait(20), "the watcher never reached the store"
        # The watcher is blocked in its heartbeat. A collective failing now (the
        # background loop and the executor both explain it) must still be told,
        # with what can be said without the store.
        texts = [returns_within(20, w.health.diagnose) for _ in range(2)]
        for text in texts:
            assert text.startswith("the rendezvous store is unreachable ("), text
            assert text.endswith("; the launcher, or rank 0 if it hosted the store, is gone")
        assert returns_within(20, lambda: w.health.host(0)) == "unknown host"
        returns_within(20, lambda: w.health.announce("going away"))
        assert w.got.wait(20), "the hung store was never reported lost"
        w.health._thread.join(20)
        assert not w.health._thread.is_alive()
        assert w.aborts == [] and len(w.lost) == 1
        assert isinstance(w.lost[0], HvdlikeInternalError)
        text = str(w.lost[0])
        assert text.startswith("rank 1: the rendezvous store has been unreachable for "), text
        assert "did not answer" in text or "has not answered" in text, text
        assert "rank 0 if it hosted the store, is gone" in text
        # Nothing queued up behind the hung request: only it ever reached the store.
        assert store.blocked == 1
        returns_within(20, lambda: w.health.close(clean=True))
    finally:
        store.released.set()
        w.health.close(clean=False)


def test_a_store_that_hangs_once_and_answers_again_keeps_being_used(monkeypatch):
    monkeypatch.setattr(health, "STORE_LOST_SECONDS", 30.0)
    monkeypatch.setattr(health, "STORE_ANSWER_SECONDS", 0.5)
    store = HangingStore()
    w = Watcher(store, rank=1, size=2)
    try:
        store.set("health/host/0", "host0 (pid 10)")
        store.hang(once=True)
        assert store.entered.wait(20), "the watcher never reached the store"
        # Given up on, the request is still in flight: more requests fail at once.
        assert returns_within(20, w.health.diagnose).startswith(
            "the rendezvous store is unreachable (")
        store.released.set()  # the link is back: the late answer arrives
        beats = store.add("health/hb/1", 0)
        deadline = time.monotonic() + 20
        while store.add("health/hb/1", 0) < beats + 3:  # heartbeats resume
            assert time.monotonic() < deadline, "the watcher did not beat again"
            time.sleep(0.1)
        assert w.health.host(0) == "host0 (pid 10)"
        assert w.lost == [] and w.aborts == [] and w.health._thread.is_alive()
    finally:
        store.released.set()
        w.health.close(clean=False)


def test_after_close_the_store_can_still_be_read_for_a_late_error(monkeypatch):
    # A call made after a negotiated shutdown names the ranks that went away
    # and their hosts (Runtime._shutdown_reason): those reads come after the
    # watcher closed, and must still reach the store. (Given time to answer on a
    # busy machine: what is checked is that the read is made, not how fast.)
    monkeypatch.setattr(health, "STORE_ANSWER_SECONDS", 30.0)
    host = host_store(timeout=5)
    w = Watcher(client(host, timeout=5), rank=1, size=2)
    host.set("health/host/0", "host0 (pid 10)")
    w.health.close(clean=True)
    w.health._io._thread.join(5)
    assert not w.health._io._thread.is_alive()  # the watcher's own thread ended
    assert w.health.host(0) == "host0 (pid 10)"
    w.health.announce("went away")
    assert w.health.announcements() == {1: "went away"}


def test_removed_heartbeat_records_are_named_and_no_rank_reports_itself_silent(monkeypatch):
    host = host_store(timeout=5)
    w = Watcher(client(host, timeout=5), rank=0, size=3, stall_check=600)
    try:
        warned = []
        monkeypatch.setattr(health.logger, "warning",
                            lambda fmt, *args: warned.append(fmt % args))
        clock = [1000.0]
        monkeypatch.setattr(health.time, "monotonic", lambda: clock[0])
        host.add("health/hb/1", 7)
        host.add("health/hb/2", 7)
        w.health._inspect()
        # rank 1's record deleted by a client that is not the job's; rank 2 silent
        host.delete_key("health/hb/1")
        host.add("health/hb/1", 1)
        clock[0] += 60
        w.health._inspect()
        assert any("heartbeat record of rank 1 went back from 7 to 1" in m for m in warned)
        assert any("rank 2 on" in m and "signs of life" in m for m in warned), warned
        # rank 0 beats on its own thread (not running here): never reported by itself
        assert not any("rank 0 on" in m or "rank 1 on" in m for m in warned), warned
    finally:
        w.health.close(clean=True)


def test_a_stall_report_adds_only_names_no_rank_reports_waiting_on():
    host = host_store(timeout=5)
    held = {(0, "x"): (5.0, [1]), (0, "y"): (5.0, [0]), (0, "young"): (0.1, [0])}
    cfg = config.load({}, stall_check_time_seconds=2)
    h = health.Health(client(host, timeout=5), 0, 2, "host", cfg, lambda: {},
                      lambda exc: None, coordinated=lambda: held)
    try:
        # Both ranks say they wait on 'x' (a rank holding a grouped member back
        # says so too): the coordinator's missing request for it adds no line.
        records = {0: {"waiting": [[0, "x", 5.0]]}, 1: {"waiting": [[0, "x", 5.0]]}}
        longest, text = h.stall_report(records)
        lines = text.splitlines()[1:]
        assert len(lines) == 1 and lines[0].startswith("  'y': waited 5s; missing rank(s) 0 ("), text
        assert lines[0].endswith("(requested by rank(s) 1, which report no wait on that name)")
        assert longest >= 5.0
        held.clear()
        assert h.stall_report(records) is None  # the coordinator released it
    finally:
        h.close(clean=True)
