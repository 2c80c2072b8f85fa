"""The framework-neutral elastic core and the torch sampler, without processes."""

import logging

import pytest

from hvdlike.core.elastic import ObjectState, run_fn
from hvdlike.core.elastic import protocol
from hvdlike.core.elastic.worker import WorkerContext, reset
from hvdlike.core.errors import HorovodInternalError, HostsUpdatedInterrupt, MismatchError


class FakeStore:
    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value if isinstance(value, bytes) else value.encode()

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


def _publish(store, number, members, removed_only=False):
    table = {w: {"rank": r, "size": len(members), "local_rank": r, "local_size": len(members),
                 "cross_rank": 0, "cross_size": 1, "hostname": "h"}
             for r, w in enumerate(members)}
    store.set(protocol.generation_key(number),
              protocol.Generation(number, table, removed_only).encode())
    store.set(protocol.LATEST_KEY, str(number))


def _context(store, worker="w1", generation=1):
    env = {protocol.ENV_WORKER: worker, protocol.ENV_GENERATION: str(generation),
           protocol.ENV_TIMEOUT: "5"}
    return WorkerContext(env, connect=lambda: store), env


def _state(ctx, **kwargs):
    state = ObjectState(lambda obj, root_rank=0: obj, lambda: 0, lambda obj: [obj], **kwargs)
    object.__setattr__(state, "_worker", ctx)
    return state


def test_object_state_commit_restore():
    ctx, _ = _context(FakeStore())
    state = _state(ctx, epoch=0, items=[1])
    state.epoch = 3
    state.items.append(2)
    state.commit()
    state.epoch = 4
    state.items.append(3)
    state.restore()
    assert (state.epoch, state.items) == (3, [1, 2])
    state.late = "x"  # attributes added later are tracked too
    state.save()
    state.late = "y"
    state.restore()
    assert state.late == "x"


def test_commit_raises_hosts_updated_once_a_newer_generation_is_published():
    store = FakeStore()
    _publish(store, 1, ["w0", "w1"])
    ctx, _ = _context(store)
    state = _state(ctx, step=0)
    state.commit()  # nothing new
    _publish(store, 2, ["w0"], removed_only=True)
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.commit()
    assert info.value.skip_sync is True


def test_an_addition_followed_by_a_removal_within_one_commit_interval_still_syncs():
    # Generation 2 added w2, generation 3 removed w1 before the survivors' next
    # commit: 3's own flag says "removed only", but w2 never synced with them and
    # waits in the sync; skipping it deadlocked the job.
    store = FakeStore()
    _publish(store, 1, ["w0", "w1"])
    ctx, _ = _context(store, worker="w0")
    state = _state(ctx, step=0)
    _publish(store, 2, ["w0", "w1", "w2"], removed_only=False)
    _publish(store, 3, ["w0", "w2"], removed_only=True)
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.commit()
    assert info.value.skip_sync is False
    # Removals only since this rank's generation: the sync is skipped.
    store = FakeStore()
    _publish(store, 1, ["w0", "w1", "w2"])
    ctx, _ = _context(store, worker="w0")
    state = _state(ctx, step=0)
    _publish(store, 2, ["w0", "w1"], removed_only=True)
    _publish(store, 3, ["w0"], removed_only=True)
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.commit()
    assert info.value.skip_sync is True


def test_commit_agrees_on_the_newest_generation_through_the_front_ends_allreduce():
    # The front ends' states agree by an allreduce (Max), which a joined rank takes
    # part in; it wins over the allgather given to the state.
    from hvdlike.core.elastic.state import use_allreduce

    store = FakeStore()
    _publish(store, 1, ["w0", "w1"])
    _publish(store, 2, ["w1"], removed_only=True)
    ctx, _ = _context(store)
    state = _state(ctx, step=0)
    seen = []
    object.__setattr__(state, "_allgather_object", lambda obj: pytest.fail("allgather used"))
    use_allreduce(state)
    object.__setattr__(state, "_newest", lambda latest: seen.append(latest) or 1)
    state.commit()  # this rank saw 2; the agreement (another rank's view) says 1
    object.__setattr__(state, "_newest", lambda latest: seen.append(latest) or latest)
    with pytest.raises(HostsUpdatedInterrupt):
        state.commit()
    assert seen == [2, 2]
    assert "newest" not in state._saved  # not a user attribute


def test_reset_joins_the_next_generation_and_sets_the_topology():
    store = FakeStore()
    _publish(store, 1, ["w0", "w1", "w2"])
    _publish(store, 2, ["w0", "w1"])
    ctx, env = _context(store)
    calls = []
    reset(lambda: calls.append("init"), lambda: calls.append("shutdown"), ctx)
    assert calls == ["shutdown", "init"]
    assert env["HVDLIKE_RANK"] == "1" and env["HVDLIKE_SIZE"] == "2"
    assert env[protocol.ENV_GENERATION] == "2" and ctx.generation == 2


def test_reset_skips_a_generation_that_fails_to_form():
    store = FakeStore()
    _publish(store, 2, ["w1"])
    ctx, env = _context(store)
    attempts = []

    def init():
        attempts.append(env[protocol.ENV_GENERATION])
        if len(attempts) == 1:
            _publish(store, 3, ["w1"])
            raise HorovodInternalError("a member died while forming")

    reset(init, lambda: None, ctx)
    assert attempts == ["2", "3"]


def test_a_process_left_out_exits_cleanly():
    store = FakeStore()
    _publish(store, 2, ["w0"])
    ctx, _ = _context(store, worker="w1")
    with pytest.raises(SystemExit) as info:
        reset(lambda: None, lambda: None, ctx)
    assert info.value.code == 0


def test_a_process_waiting_when_another_rank_completed_the_job_leaves_cleanly(caplog):
    # A runtime initialized earlier in this process (another test file) stops the
    # "hvdlike" logger's propagation to the root: listen on that logger itself.
    from hvdlike.core.log import logger

    logger.addHandler(caplog.handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        _finishing_job_is_left_cleanly(caplog)
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(level)


def _finishing_job_is_left_cleanly(caplog):
    store = FakeStore()
    _publish(store, 1, ["w0", "w1"])
    ctx, _ = _context(store, worker="w1")
    ticks, shut = [], []

    def sleep(seconds):
        ticks.append(seconds)
        if len(ticks) == 2:
            store.set(protocol.finished_key(1), b"w0")  # the launcher: w0 exited 0

    assert ctx.finished() is None
    assert ctx.wait_for_newer(sleep=sleep) is None and len(ticks) == 2
    with pytest.raises(SystemExit) as info:
        reset(lambda: pytest.fail("no generation to join"), lambda: shut.append(1), ctx)
    assert info.value.code == 0 and shut == [1]
    assert "the job is finishing (worker w0 completed it)" in caplog.text


def test_enter_waits_for_every_member_then_returns():
    store = FakeStore()
    _publish(store, 1, ["w0", "w1"])
    ctx, _ = _context(store, worker="w1")
    ticks = []

    def sleep(seconds):
        ticks.append(seconds)
        if len(ticks) == 3:
            store.set(protocol.ready_key(1, "w0"), b"1")  # the slow member arrives

    ctx.enter(sleep=sleep)
    assert len(ticks) == 3 and store.check([protocol.ready_key(1, "w1")])


def test_enter_moves_on_when_the_generation_is_superseded():
    store = FakeStore()
    _publish(store, 1, ["w0", "w1"])
    ctx, env = _context(store, worker="w1")

    def sleep(seconds):  # w0 never arrives; the launcher publishes generation 2
        _publish(store, 2, ["w1"])

    ctx.enter(sleep=sleep)
    assert ctx.generation == 2 and env["HVDLIKE_SIZE"] == "1" and env["HVDLIKE_RANK"] == "0"


def test_enter_times_out_naming_the_missing_members():
    store = FakeStore()
    _publish(store, 1, ["w0", "w1"])
    ctx, _ = _context(store, worker="w1")
    ctx.wait_seconds = 0.1
    with pytest.raises(HorovodInternalError, match="generation 1 members w0 did not arrive"):
        ctx.enter()


def test_enter_reports_members_missing_after_the_start_timeout_and_keeps_waiting():
    # The start timeout (HVDLIKE_START_TIMEOUT, --start-timeout), not the elastic wait,
    # bounds the wait for a member that never arrives; the waiting member reports it
    # and moves on to the generation the launcher publishes without it.
    store = FakeStore()
    _publish(store, 1, ["w0", "w1"])
    env = {protocol.ENV_WORKER: "w1", protocol.ENV_GENERATION: "1", protocol.ENV_TIMEOUT: "600",
           "HVDLIKE_START_TIMEOUT": "2"}
    ctx = WorkerContext(env, connect=lambda: store)
    assert ctx.start_seconds == 2.0
    now, reports = [0.0], []

    def sleep(seconds):
        now[0] += 0.25
        if store.check([protocol.late_key(1)]) and not reports:
            reports.append((now[0], protocol.read_late(store, 1)))
            _publish(store, 2, ["w1"])  # the launcher drops w0

    ctx.enter(clock=lambda: now[0], sleep=sleep)
    assert ctx.generation == 2 and env["HVDLIKE_SIZE"] == "1"
    assert reports and 2.0 < reports[0][0] < 3.0, reports
    assert reports[0][1] == protocol.LateReport("w1", ["w0"], 2.0)


def test_waiting_for_a_generation_times_out_with_a_clear_error():
    ctx, _ = _context(FakeStore())
    ctx.wait_seconds = 0.2
    with pytest.raises(HorovodInternalError, match="no new generation after generation 1"):
        ctx.wait_for_newer()


def test_run_loop_restores_after_internal_error_and_keeps_state_on_hosts_updated():
    ctx, _ = _context(FakeStore())
    state = _state(ctx, step=0)
    events = []
    outcomes = [HorovodInternalError("peer lost"), HostsUpdatedInterrupt(skip_sync=True), None]

    def train(state):
        state.step += 1
        if state.step == 2:
            state.commit = None  # never reached: commits are explicit below
        outcome = outcomes.pop(0)
        events.append(("call", state.step))
        if outcome is not None:
            raise outcome
        return state.step

    state.register_reset_callbacks([lambda: events.append("reset")])
    wrapped = run_fn(train, reset=lambda: events.append("reform"), is_elastic=lambda: True)
    assert wrapped(state) == 2  # restored to 0 after the error, kept at 1 after the update
    assert events == [("call", 1), "reform", "reset", ("call", 1), "reform", "reset",
                      ("call", 2)]


def test_run_loop_lets_user_errors_and_non_elastic_errors_through():
    ctx, _ = _context(FakeStore())
    state = _state(ctx, step=0)

    def bad(state):
        raise ValueError("user bug")

    with pytest.raises(ValueError):
        run_fn(bad, reset=lambda: None, is_elastic=lambda: True)(state)

    def disagree(state):  # a HorovodInternalError a re-form cannot cure
        raise MismatchError("ranks disagree on the shape of collective 'w'")

    with pytest.raises(MismatchError):
        run_fn(disagree, reset=lambda: pytest.fail("re-formed"), is_elastic=lambda: True)(state)

    def lost(state):
        raise HorovodInternalError("peer lost")

    with pytest.raises(HorovodInternalError):
        run_fn(lost, reset=lambda: None, is_elastic=lambda: False)(state)


def test_store_prefix_uses_the_launcher_generation():
    assert protocol.store_prefix({protocol.ENV_GENERATION: "7"}, 3) == "elastic7/"
    assert protocol.store_prefix({}, 3) == "gen3/"


# -- ElasticSampler ----------------------------------------------------------------------


def _sampler(monkeypatch, size, rank, n=20):
    from hvdlike.core import api
    from hvdlike.torch.elastic import ElasticSampler

    monkeypatch.setattr(api, "is_initialized", lambda: True)
    monkeypatch.setattr(api, "size", lambda: size)
    monkeypatch.setattr(api, "rank", lambda: rank)
    return ElasticSampler(list(range(n)), shuffle=True, seed=3)


def test_sampler_partitions_and_records_every_ranks_batch(monkeypatch):
    samplers = [_sampler(monkeypatch, 4, r) for r in range(4)]
    parts = [list(s) for s in samplers]
    assert sorted(sum(parts, [])) == list(range(20)) and all(len(p) == 5 for p in parts)
    for s in samplers:
        s.record_batch(0, 2)
    # every rank knows what every rank processed: a lost rank takes nothing with it
    assert samplers[0].processed_indices == samplers[3].processed_indices
    assert samplers[0].processed_indices == {i for p in parts for i in p[:2]}


def test_sampler_after_shrink_deals_only_unprocessed_indices(monkeypatch):
    before = _sampler(monkeypatch, 4, 0)
    before.record_batch(0, 2)
    before.record_batch(1, 2)
    processed = set(before.processed_indices)
    state = before.state_dict()
    after, rest = [], []
    for r in range(2):  # the rank a sampler deals for is read at each reset
        s = _sampler(monkeypatch, 2, r)
        s.load_state_dict(state)
        after.append(s)
        rest += list(s)
    rest.sort()
    assert set(rest) == set(range(20)) - processed and len(rest) == 4
    after[0].set_epoch(1)
    assert after[0].processed_indices == set() and len(after[0]) == 10


def test_elastic_run_under_a_restarting_torchrun_says_commits_do_not_carry_over(
        caplog, monkeypatch):
    from hvdlike.core.elastic import loop
    from hvdlike.core.log import logger

    class _State:
        def sync(self):
            pass

        restore = on_reset = sync

    logger.addHandler(caplog.handler)
    monkeypatch.setattr(logger, "propagate", False)  # one copy of each record in caplog
    monkeypatch.setattr(loop, "_WARNED_RESTARTS", [])
    try:
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
        assert loop.run_fn(lambda s: 1, lambda: None, lambda: False)(_State()) == 1
        assert "torchrun" not in caplog.text  # no restarts: nothing to say
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
        assert loop.run_fn(lambda s: 2, lambda: None, lambda: True)(_State()) == 2
        assert "torchrun" not in caplog.text  # a re-forming job keeps its commits
        for _ in range(2):
            assert loop.run_fn(lambda s: 3, lambda: None, lambda: False)(_State()) == 3
        assert caplog.text.count("commits (state.commit()) do not carry over") == 1
    finally:
        logger.removeHandler(caplog.handler)
