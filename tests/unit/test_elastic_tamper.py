"""Deleted seats and replayed ``elastic/latest`` records, against the elastic logic alone.

The store is torch's in-memory ``HashStore`` behind the real authenticated view,
so MACs and sealed seats are the real ones. ``protocol.publish`` plays the
launcher; the attacker deletes keys and writes back raw values it read earlier
under the same key -- all that TCPStore lets anyone without the job secret do.
"""

import datetime
import time
import types

import pytest
import torch.distributed as dist

from hvdlike.core.elastic import ObjectState, protocol
from hvdlike.core.elastic.worker import WorkerContext, reset
from hvdlike.core.store_auth import AuthenticatedStore, StoreTamperedError
from hvdlike.launcher.elastic.assignment import Member, Slot
from hvdlike.launcher.elastic.driver import ElasticDriver
from hvdlike.launcher.elastic.settings import ElasticSettings

SECRETS = {f"w{n}": f"{n}" * 32 for n in range(4)}  # each process's own secret


def _store():
    """(the job's authenticated view, the raw store under it)."""
    raw = dist.HashStore()
    raw.set_timeout(datetime.timedelta(seconds=2))
    return AuthenticatedStore(raw, "the job secret"), raw


def _publish(store, number, workers):
    table = {w: {"rank": r, "size": len(workers), "local_rank": r, "local_size": len(workers),
                 "cross_rank": 0, "cross_size": 1, "hostname": "h"}
             for r, w in enumerate(workers)}
    protocol.publish(store, protocol.Generation(number, table), SECRETS)
    store.set(protocol.LATEST_KEY, str(number))


def _context(store, worker, generation, timeout="5"):
    env = {protocol.ENV_WORKER: worker, protocol.ENV_GENERATION: str(generation),
           protocol.ENV_TIMEOUT: timeout, protocol.ENV_WORKER_SECRET: SECRETS[worker]}
    return WorkerContext(env, connect=lambda: store)


def _recorded(store, raw, key):
    """What anyone reading the store sees under ``key``: the signed value, as stored."""
    return bytes(raw.get(store.prefix + key))


def _write_back(store, raw, key, value):
    raw.set(store.prefix + key, value)


# -- a deleted seat is not "left out" ----------------------------------------------------


def test_a_process_whose_seat_was_deleted_fails_instead_of_leaving_as_if_left_out():
    store, _ = _store()
    _publish(store, 1, ["w0", "w1"])
    store.delete_key(protocol.seat_key(1, "w1"))
    ctx = _context(store, "w1", 1)
    with pytest.raises(StoreTamperedError) as info:  # it left with status 0 before
        ctx.enter()
    assert info.value.key == "elastic/g1/seat/w1"
    assert ("the rendezvous store was tampered with: key 'elastic/g1/seat/w1' (this "
            "process's seat in generation 1) was deleted, though the generation's roster "
            "('elastic/g1/roster') lists this process as a member") in str(info.value)
    # It trusts the store no more: waiting to re-form raises the same at once.
    with pytest.raises(StoreTamperedError, match="seat in generation 1"):
        ctx.wait_for_newer()


def test_a_survivor_whose_seat_in_the_next_generation_was_deleted_fails():
    store, _ = _store()
    _publish(store, 1, ["w0", "w1"])
    ctx = _context(store, "w1", 1)
    assert "w1" in ctx.read(1).members  # a member of generation 1
    _publish(store, 2, ["w0", "w1"])
    store.delete_key(protocol.seat_key(2, "w1"))
    with pytest.raises(StoreTamperedError, match=r"key 'elastic/g2/seat/w1' \(this process's "
                                                 r"seat in generation 2\) was deleted"):
        reset(lambda: pytest.fail("there is no generation to initialize"), lambda: None, ctx)


def test_a_deleted_roster_and_seat_of_the_newest_generation_fail_naming_the_roster():
    store, _ = _store()
    _publish(store, 1, ["w0", "w1"])
    store.delete_key(protocol.roster_key(1))
    store.delete_key(protocol.seat_key(1, "w1"))
    ctx = _context(store, "w1", 1)
    with pytest.raises(StoreTamperedError) as info:
        ctx.enter()
    assert info.value.key == "elastic/g1/roster"
    assert ("key 'elastic/g1/roster' (generation 1's roster) was deleted while generation 1 "
            "is the newest one published, and this process's seat in it "
            "('elastic/g1/seat/w1') with it") in str(info.value)


def test_a_process_the_launcher_left_out_still_leaves_with_status_0():
    store, _ = _store()
    _publish(store, 1, ["w0", "w1"])
    ctx = _context(store, "w1", 1)
    ctx.read(1)
    _publish(store, 2, ["w0"])
    with pytest.raises(SystemExit) as info:
        reset(lambda: pytest.fail("not a member"), lambda: None, ctx)
    assert info.value.code == 0


class _Hooked:
    """The job's view, with ``before_check(keys)`` called before each ``check``."""

    def __init__(self, store, before_check):
        self._store, self._before_check = store, before_check

    def check(self, keys):
        self._before_check(keys)
        return self._store.check(keys)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_generation_forgotten_while_a_process_looked_at_it_sends_it_to_the_newest():
    # w2, started for generation 1, is slow; its host is removed. Between its reading
    # elastic/latest (1) and its seat, generation 2 (w0, w1) is published, forms, and
    # its rank 0 forgets generation 1 -- roster and seats. Gone with its roster, the
    # seat says nothing: w2 looks at generation 2, whose roster leaves it out.
    store, _ = _store()
    _publish(store, 1, ["w0", "w1", "w2"])
    w0 = _context(store, "w0", 1)
    w0.read(1)

    superseded = []

    def supersede(keys):
        if keys == [protocol.seat_key(1, "w2")] and not superseded:
            superseded.append(2)
            _publish(store, 2, ["w0", "w1"])
            assert protocol.forget_generation(store, 1, w0.view(1))

    ctx = WorkerContext(_context(store, "w2", 1).environ, connect=lambda: _Hooked(store, supersede))
    with pytest.raises(SystemExit) as info:
        ctx.enter()
    assert info.value.code == 0
    assert ctx.generation == 2 and ctx.tampered is None  # it left from generation 2


def test_the_roster_is_published_with_the_generation_and_forgotten_before_the_seats():
    store, raw = _store()
    _publish(store, 1, ["w1", "w0"])
    assert protocol.read_roster(store, 1) == ["w0", "w1"]
    deleted = []
    recording = types.SimpleNamespace(check=store.check,
                                      delete_key=lambda key: deleted.append(key) or
                                      store.delete_key(key))
    view = _context(store, "w0", 1).view(1)
    assert protocol.forget_generation(recording, 1, view)
    assert deleted[0] == "elastic/g1/roster"
    assert protocol.read_roster(store, 1) is None
    _write_back(store, raw, protocol.roster_key(1), b"w0 w1 w2")  # not signed
    with pytest.raises(StoreTamperedError, match="elastic/g1/roster"):
        protocol.read_roster(store, 1)


# -- elastic/latest never goes backwards ---------------------------------------------------


def test_latest_going_backwards_is_refused_and_every_later_look_refuses_too():
    store, raw = _store()
    _publish(store, 1, ["w0"])
    old = _recorded(store, raw, protocol.LATEST_KEY)
    _publish(store, 2, ["w0"])
    new = _recorded(store, raw, protocol.LATEST_KEY)
    ctx = _context(store, "w0", 1)
    assert ctx.latest() == 2
    _write_back(store, raw, protocol.LATEST_KEY, old)  # signed, but generation 1's
    with pytest.raises(StoreTamperedError) as info:
        ctx.latest()
    assert info.value.key == "elastic/latest"
    assert ("key 'elastic/latest' went back from generation 2 to 1: an old record was "
            "written back by a process without the job's secret") in str(info.value)
    _write_back(store, raw, protocol.LATEST_KEY, new)  # put back (by the launcher)
    for look in (ctx.latest, ctx.wait_for_newer):
        with pytest.raises(StoreTamperedError, match="went back from generation 2 to 1"):
            look()


def test_a_process_started_for_a_generation_refuses_an_older_latest():
    store, raw = _store()
    _publish(store, 1, ["w0"])
    old = _recorded(store, raw, protocol.LATEST_KEY)
    _publish(store, 2, ["w0", "w1"])  # the launcher announces 2 before it starts w1
    _write_back(store, raw, protocol.LATEST_KEY, old)
    with pytest.raises(StoreTamperedError, match="went back from generation 2 to 1"):
        _context(store, "w1", 2, timeout="1").enter()


def test_a_member_refuses_the_old_record_at_its_commit_and_does_not_wait_to_re_form():
    store, raw = _store()
    _publish(store, 1, ["w0", "w1"])
    old = _recorded(store, raw, protocol.LATEST_KEY)
    _publish(store, 2, ["w0"])
    ctx = _context(store, "w0", 2, timeout="60")
    state = ObjectState(lambda obj, root_rank=0: obj, lambda: 0, lambda obj: [obj], step=0)
    object.__setattr__(state, "_worker", ctx)
    state.commit()
    _write_back(store, raw, protocol.LATEST_KEY, old)
    with pytest.raises(StoreTamperedError, match="went back from generation 2 to 1"):
        state.commit()  # it trained on before, taking the replay for the truth
    began = time.monotonic()
    with pytest.raises(StoreTamperedError, match="went back from generation 2 to 1"):
        reset(lambda: pytest.fail("no generation to join"), lambda: None, ctx)
    assert time.monotonic() - began < 5  # not after its 60 s wait


def test_a_deleted_latest_is_no_news_not_a_rollback():
    store, _ = _store()
    _publish(store, 1, ["w0"])
    _publish(store, 2, ["w0"])
    ctx = _context(store, "w0", 1)
    assert ctx.latest() == 2
    store.delete_key(protocol.LATEST_KEY)
    assert ctx.latest() == 2 and ctx.tampered is None


def test_a_generation_failing_to_form_over_a_tampered_record_is_not_waited_out():
    # The launcher publishes no other generation for it (no process ended): waiting
    # would last the whole elastic timeout.
    store, _ = _store()
    _publish(store, 1, ["w0", "w1"])
    ctx = _context(store, "w1", 1, timeout="1")
    ctx.read(1)
    _publish(store, 2, ["w0", "w1"])
    shutdowns = []

    def init():
        raise StoreTamperedError("elastic2/gloo/0", "holds a value hvdlike did not write")

    with pytest.raises(StoreTamperedError, match="elastic2/gloo/0"):
        reset(init, lambda: shutdowns.append(1), ctx)
    assert shutdowns == [1, 1]


# -- the launcher --------------------------------------------------------------------------


class _Notes:
    def __init__(self):
        self.lines = []

    def note(self, text):
        self.lines.append(text)


def _driver(store, clock):
    job = types.SimpleNamespace(output=_Notes(), store=types.SimpleNamespace(client=lambda: store))
    settings = ElasticSettings(min_np=1, max_np=4, np=2)
    driver = ElasticDriver(job, settings, discovery=None, clock=clock)
    driver._ids = iter(f"w{n}" for n in range(4))
    started = []

    def start(worker, placement, number):  # what a process would find at its start
        started.append((worker, number, store.get(protocol.LATEST_KEY).decode()
                        if store.check([protocol.LATEST_KEY]) else None))
        return types.SimpleNamespace(rank=placement.rank)

    driver._start = start
    return driver, started


def _members(*workers):
    return [Member(w, Slot("h", n), True) for n, w in enumerate(workers)]


def test_the_launcher_announces_a_generation_before_it_starts_the_generations_processes():
    store, _ = _store()
    driver, started = _driver(store, time.monotonic)
    driver._publish(_members("w0", "w1"), removed_only=False)
    driver._publish(_members("w2"), removed_only=False)
    assert started == [("w0", 1, "1"), ("w1", 1, "1"), ("w2", 2, "2")]
    assert protocol.read_roster(store, 2) == ["w2"]


def test_the_launcher_puts_back_a_replayed_or_deleted_latest_and_says_so():
    store, raw = _store()
    now = [100.0]
    driver, _ = _driver(store, lambda: now[0])
    driver._publish(_members("w0", "w1"), removed_only=False)
    old = _recorded(store, raw, protocol.LATEST_KEY)
    driver._publish(_members("w0"), removed_only=False)
    notes = driver.output.lines
    driver._guard_latest()
    assert len(notes) == 2  # the two generations' notes: nothing was wrong

    _write_back(store, raw, protocol.LATEST_KEY, old)
    now[0] += 0.1
    driver._guard_latest()  # checked at most every 0.2 s
    assert _recorded(store, raw, protocol.LATEST_KEY) == old
    now[0] += 0.2
    driver._guard_latest()
    assert store.get(protocol.LATEST_KEY) == b"2"
    assert notes[2] == ("elastic/latest in the job's store said generation 1 instead of 2: "
                        "an old record was written back by a process without the job's "
                        "secret; restored it")

    store.delete_key(protocol.LATEST_KEY)
    now[0] += 0.2
    driver._guard_latest()
    assert store.get(protocol.LATEST_KEY) == b"2"
    assert len(notes) == 3  # said once; an attacker that keeps at it gets a line every 50
    for _ in range(48):
        _write_back(store, raw, protocol.LATEST_KEY, b"garbage")
        now[0] += 0.2
        driver._guard_latest()
    assert store.get(protocol.LATEST_KEY) == b"2"
    assert notes[3:] == ["elastic/latest in the job's store held a value hvdlike did not sign "
                         "instead of generation 2 by a process without the job's secret; "
                         "restored it (50 times so far)"]
