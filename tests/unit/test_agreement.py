"""Settings every rank must share: the comparison rank 0 makes at init()."""

from hvdlike.core import agreement, config


def _values(**changed):
    values = agreement.values(config.load({}))
    values.update(changed)
    return values


def test_alike_ranks_pass():
    assert agreement.disagreements(_values(), {1: _values(), 2: _values()}) == ""


def test_each_differing_setting_is_named_with_every_differing_rank():
    said = agreement.disagreements(
        _values(fusion_threshold=0),
        {1: _values(), 2: _values(fusion_threshold=0, shm=False), 3: _values(shm=False)})
    lines = said.splitlines()
    assert lines[0].startswith("init: the ranks disagree on settings every rank of a job "
                               "must share")
    assert lines[1:] == [
        "  HVDLIKE_FUSION_THRESHOLD (or HOROVOD_FUSION_THRESHOLD): rank 0 0, "
        "rank 1 134217728, rank 3 134217728",
        "  HVDLIKE_SHM (or HOROVOD_SHM): rank 0 True, rank 2 False, rank 3 False"]


def test_many_differing_ranks_are_counted_past_the_first_few():
    theirs = {r: _values(cache_capacity=0) for r in range(1, 21)}
    said = agreement.disagreements(_values(), theirs)
    assert "rank 8 0, and 12 more rank(s)" in said and "rank 9 " not in said


def test_a_rank_s_own_settings_are_not_shared_ones():
    # Log level, timeline, stall and wait times may differ from rank to rank.
    for field in ("log_level", "timeline", "stall_check_time_seconds", "cycle_time",
                  "deadlock_time_seconds", "gloo_timeout_seconds", "thread_affinity"):
        assert field not in agreement.SHARED
    assert set(agreement.SHARED) <= set(config.KNOBS_BY_FIELD)
