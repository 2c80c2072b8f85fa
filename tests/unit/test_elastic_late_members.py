"""Members of an elastic generation that never arrive: the driver's decision and the
waiting member's report, on an in-memory authenticated store without processes."""

import torch.distributed as dist

from hvdlike.core.elastic import protocol
from hvdlike.core.elastic.worker import WorkerContext
from hvdlike.core.job_secret import new_secret
from hvdlike.core.store_auth import AuthenticatedStore
from hvdlike.launcher.elastic.discovery import FixedDiscovery, LastGood
from hvdlike.launcher.elastic.driver import ElasticDriver
from hvdlike.launcher.elastic.settings import ElasticSettings
from hvdlike.launcher.hosts import HostSlots
from hvdlike.launcher.monitor import WorkerState


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class _Output:
    def __init__(self):
        self.notes = []

    def note(self, text):
        self.notes.append(text)


class _Store:
    def __init__(self):
        self.auth = AuthenticatedStore(dist.HashStore(), new_secret())

    def client(self):
        return self.auth


class _Job:
    def __init__(self):
        self.output = _Output()
        self.store = _Store()


class _Rank:
    """A rank process as far as the driver looks at it."""

    def __init__(self, placement):
        self.placement = placement
        self.state = WorkerState.RUNNING
        self.stop_requested_at = None
        self.exit_code = None

    @property
    def rank(self):
        return self.placement.rank

    @property
    def host(self):
        return self.placement.host

    def request_stop(self):
        self.stop_requested_at = 1.0


class _Driver(ElasticDriver):
    """The real decisions; ``_start`` records a rank instead of starting a process."""

    def _start(self, worker_id, placement, number):
        rank = _Rank(placement)
        self.workers[worker_id] = self.live[worker_id] = rank
        return rank


def _driver(hosts, np, min_np=1, max_np=8):
    settings = ElasticSettings(min_np=min_np, max_np=max_np, np=np)
    hosts = [HostSlots(h, n) for h, n in hosts]
    clock = _Clock()
    driver = _Driver(_Job(), settings, LastGood(FixedDiscovery(hosts), lambda text: None),
                     clock=clock)
    driver.table.update(hosts)
    driver._reform()
    return driver, clock


def _member(driver, worker, number=None):
    """``worker``'s context, as its process would have it (its secret, the job's store)."""
    number = number or driver.generation
    env = {protocol.ENV_WORKER: worker, protocol.ENV_GENERATION: str(number),
           protocol.ENV_TIMEOUT: "5", protocol.ENV_WORKER_SECRET: driver._secrets[worker],
           "HVDLIKE_START_TIMEOUT": "3"}
    return WorkerContext(env, connect=lambda: driver.store)


def _arrive(driver, worker, number=None):
    number = number or driver.generation
    _member(driver, worker, number).view(number).set(protocol.ready_key(number, worker), b"1")


def _report(driver, by, missing, number=None):
    number = number or driver.generation
    view = _member(driver, by, number).view(number)
    protocol.report_late(view, number, protocol.LateReport(by, missing, 3.0))


def _check(driver, clock, seconds=1.0):
    clock.now += seconds
    driver._check_arrivals()


def test_a_member_that_never_arrived_is_dropped_and_its_host_blacklisted():
    driver, clock = _driver([("a", 1), ("b", 1)], np=2)
    assert [m.worker for m in driver.members] == ["w0", "w1"]
    _arrive(driver, "w0")
    _report(driver, "w0", ["w1"])
    _check(driver, clock)
    assert driver.live["w1"].stop_requested_at is not None
    assert driver.live["w0"].stop_requested_at is None
    assert driver.table.blacklisted("b", clock.now) and not driver.table.blacklisted("a", clock.now)
    assert driver.output.notes[-1] == (
        "member w1 (rank 1) on b did not arrive for generation 1 within 3s (reported by w0); "
        "stopping it; host b blacklisted for the rest of the job; re-forming")
    assert [(x.rank, x.worker, x.host, x.reason) for x in driver.result.lost] == [
        (1, "w1", "b", "did not arrive for generation 1 within 3s")]
    _check(driver, clock)  # the same report read again: nothing more
    assert len(driver.result.lost) == 1
    driver._reform()
    assert driver.generation == 2 and [m.worker for m in driver.members] == ["w0"]
    # its end (SIGTERM, or exit 0 after all) is no further failure, nor the job's completion
    driver._exited("w1", 0)
    assert driver.workers["w1"].state is WorkerState.STOPPED and not driver._finishing
    assert len(driver.result.lost) == 1


def test_on_a_host_where_members_arrived_only_the_late_members_slot_is_dropped():
    driver, clock = _driver([("a", 3)], np=3)
    _arrive(driver, "w0")
    _arrive(driver, "w2")
    _report(driver, "w2", ["w1"])
    _check(driver, clock)
    assert not driver.table.blacklisted("a", clock.now)
    assert "its slot dropped (host a stays: members that arrived run there)" in \
        driver.output.notes[-1]
    driver._reform()
    # the slot is not given to a new process, now or when discovery runs again
    assert [m.worker for m in driver.members] == ["w0", "w2"]
    assert not driver._hosts_matter()


def test_a_member_that_arrived_in_an_earlier_generation_is_waited_for():
    # A survivor takes until its next commit to reach a new generation: not "late to
    # start". The process started for the new generation, which never arrived, is.
    driver, clock = _driver([("a", 1), ("b", 1)], np=1)
    _arrive(driver, "w0")
    _check(driver, clock)
    driver.table.update([HostSlots("a", 1), HostSlots("b", 1), HostSlots("c", 1)])
    driver._reform()
    assert driver.generation == 2 and [m.worker for m in driver.members] == ["w0", "w1", "w2"]
    _arrive(driver, "w1")
    _report(driver, "w1", ["w0", "w2"])
    _check(driver, clock)
    assert driver.live["w0"].stop_requested_at is None
    assert driver.live["w2"].stop_requested_at is not None
    assert driver.table.blacklisted("c", clock.now) and not driver.table.blacklisted("a", clock.now)
    assert any("member w0 has not arrived for generation 2 within 3s; it took part in an "
               "earlier one" in n for n in driver.output.notes), driver.output.notes


def test_a_report_not_written_by_a_member_of_the_generation_changes_nothing():
    driver, clock = _driver([("a", 1), ("b", 1)], np=2)
    _arrive(driver, "w0")
    # signed with the job secret only (a process without the generation's key)
    driver.store.set(protocol.late_key(1), b'{"by": "w0", "missing": ["w1"], "seconds": 3}')
    _check(driver, clock)
    # a member that has not arrived itself cannot report either
    driver.store.delete_key(protocol.late_key(1))
    _report(driver, "w1", ["w0"])
    _check(driver, clock)
    # nor do forged ready marks count as arrivals
    driver.store.set(protocol.ready_key(1, "w1"), b"1")
    _report(driver, "w0", ["w1"])
    _check(driver, clock)
    assert driver.live["w0"].stop_requested_at is None
    assert driver.result.lost[-1].worker == "w1"  # the last report was a member's, and true
    assert len(driver.result.lost) == 1
    assert any("ignoring a record of generation 1" in n for n in driver.output.notes)


def test_the_report_of_an_earlier_generation_is_not_read_as_the_current_ones():
    driver, clock = _driver([("a", 1), ("b", 1), ("c", 1)], np=3)
    for w in ("w0", "w1", "w2"):
        _arrive(driver, w)
    protocol.report_late(_member(driver, "w0").view(1), 1,
                         protocol.LateReport("w0", ["w2"], 3.0))
    driver.table.update([HostSlots("a", 1), HostSlots("b", 1), HostSlots("d", 1)])
    driver._reform()
    assert driver.generation == 2 and [m.worker for m in driver.members] == ["w0", "w1", "w3"]
    _arrive(driver, "w0")
    # generation 1's signed report, written back under generation 2's key (no secret needed)
    raw, inner = driver.store, driver.store._inner
    inner.set(raw.prefix + protocol.late_key(2), inner.get(raw.prefix + protocol.late_key(1)))
    _check(driver, clock)
    assert all(w.stop_requested_at is None for w in driver.live.values())
    assert driver.result.lost == []
    assert any("ignoring a record of generation 2" in n for n in driver.output.notes)


def test_the_waiting_member_reports_after_the_start_timeout_and_moves_on():
    driver, clock = _driver([("a", 1), ("b", 1)], np=2)
    ctx = _member(driver, "w0")
    ticks = [0.0]

    def now():
        return ticks[0]

    def sleep(seconds):
        ticks[0] += 0.5
        _check(driver, clock, 0.5)
        if driver._reform_at is not None:
            driver._reform()

    ctx.enter(clock=now, sleep=sleep)
    assert ctx.generation == 2 and ctx.environ["HVDLIKE_SIZE"] == "1"
    assert 3.0 < ticks[0] < 5.0  # after the start timeout, well before the elastic wait
    assert driver.live["w1"].stop_requested_at is not None
    assert "(reported by w0)" in driver.output.notes[-2], driver.output.notes
    # generation 2 formed: its rank 0 deleted generation 1's keys, the report with them
    assert not driver.store.check([protocol.late_key(1)])
    assert not driver.store.check([protocol.roster_key(1)])


def test_a_start_timeout_given_to_init_bounds_the_wait_not_the_environments():
    driver, clock = _driver([("a", 1), ("b", 1)], np=2)
    ctx = _member(driver, "w0")  # its environment says 3 s
    ticks = [0.0]

    def sleep(seconds):
        ticks[0] += 0.5
        _check(driver, clock, 0.5)
        if driver._reform_at is not None:
            driver._reform()

    ctx.enter(clock=lambda: ticks[0], sleep=sleep, start_seconds=1.0)
    assert ctx.generation == 2
    assert 1.0 < ticks[0] < 3.0, ticks  # reported after init's 1 s, not the environment's 3 s
    assert ctx.start_seconds == 1.0  # kept for the re-forms that follow
    assert "(reported by w0)" in driver.output.notes[-2], driver.output.notes
