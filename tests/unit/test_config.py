import pytest

from hvdlike.core import config
from hvdlike.core.errors import ConfigError


def test_defaults():
    cfg = config.load({})
    assert cfg.fusion_threshold == 128 * 1024 * 1024
    assert cfg.cycle_time == 1.0
    assert cfg.cache_capacity == 1024
    assert cfg.log_level == "warning"


def test_hvdlike_wins_over_horovod_fallback():
    cfg = config.load({"HOROVOD_FUSION_THRESHOLD": "10", "HVDLIKE_FUSION_THRESHOLD": "20",
                       "HOROVOD_CYCLE_TIME": "0.5", "HOROVOD_LOG_LEVEL": "INFO"})
    assert cfg.fusion_threshold == 20
    assert cfg.cycle_time == 0.5
    assert cfg.log_level == "info"


@pytest.mark.parametrize("var,value,expected", [
    ("HVDLIKE_FUSION_THRESHOLD", "-1", "byte count"),
    ("HVDLIKE_FUSION_THRESHOLD", "1.5", "byte count"),
    ("HVDLIKE_CYCLE_TIME", "fast", "milliseconds"),
    ("HVDLIKE_CACHE_CAPACITY", "-3", "integer"),
    ("HVDLIKE_LOG_LEVEL", "loud", "one of trace"),
    ("HVDLIKE_AUTOTUNE", "maybe", "boolean"),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "0", "seconds > 0"),
    ("HVDLIKE_FUSION_THRESHOLD", "1_000", "byte count"),  # int() would take it as 1000
    ("HVDLIKE_CYCLE_TIME", "\u0665", "milliseconds"),     # and float() an Arabic-Indic 5
    ("HVDLIKE_START_TIMEOUT", "1e-300", "at least 0.001"),  # 0 ms once converted
])
def test_bad_values_name_variable_value_and_expectation(var, value, expected):
    with pytest.raises(ConfigError) as info:
        config.load({var: value})
    message = str(info.value)
    assert var in message and repr(value) in message and expected in message


def test_overrides_and_frozen():
    cfg = config.load({"HVDLIKE_CYCLE_TIME": "5"}, cycle_time=0.0)
    assert cfg.cycle_time == 0.0
    with pytest.raises(Exception):
        cfg.cycle_time = 3
    with pytest.raises(ConfigError, match="unknown setting"):
        config.load({}, no_such_knob=1)


def test_every_knob_has_config_field_and_unique_flag():
    fields = {f for f in config.Config.__dataclass_fields__}
    flags = [k.flag for k in config.KNOBS if k.flag]
    assert len(flags) == len(set(flags))
    for knob in config.KNOBS:
        assert knob.field in fields
        assert getattr(config.Config(), knob.field) == knob.default
    assert "HVDLIKE_FUSION_THRESHOLD" in config.load({}).describe()


def test_hierarchical_knobs_are_auto_unless_forced_under_either_name():
    assert config.load({}).hierarchical_allreduce is None
    cfg = config.load({"HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
                       "HVDLIKE_HIERARCHICAL_ALLGATHER": "off"})
    assert (cfg.hierarchical_allreduce, cfg.hierarchical_allgather) == (True, False)
    assert config.load({"HVDLIKE_HIERARCHICAL_ALLREDUCE": "auto"}).hierarchical_allreduce is None
    with pytest.raises(ConfigError, match="HVDLIKE_HIERARCHICAL_ALLGATHER='2x'.*auto or a boolean"):
        config.load({"HVDLIKE_HIERARCHICAL_ALLGATHER": "2x"})


def test_switches_read_numbers_as_horovod_does():
    # Horovod turns a switch on for any number above 0 (HOROVOD_TIMELINE_MARK_CYCLES=2).
    assert config.load({"HOROVOD_TIMELINE_MARK_CYCLES": "2"}).timeline_mark_cycles is True
    assert config.load({"HOROVOD_HIERARCHICAL_ALLREDUCE": "3"}).hierarchical_allreduce is True
    assert config.load({"HVDLIKE_AUTOTUNE": "-1"}).autotune is False
    with pytest.raises(ConfigError, match="HVDLIKE_AUTOTUNE='1.5'"):
        config.load({"HVDLIKE_AUTOTUNE": "1.5"})


def test_hierarchical_choice():
    from hvdlike.core.shm_hierarchy import wanted

    assert wanted(None, [[0, 1], [2, 3]]) and wanted(None, [[0, 2], [1]])
    assert not wanted(None, [[0], [1]])  # one member per host: nothing to share
    assert not wanted(None, [[0, 1]]) and not wanted(True, [[0, 1]])  # one host: flat shm
    assert wanted(True, [[0], [1]]) and not wanted(False, [[0, 1], [2, 3]])


@pytest.mark.parametrize("var,value", [
    ("HVDLIKE_CYCLE_TIME", "nan"),
    ("HVDLIKE_CYCLE_TIME", "inf"),
    ("HVDLIKE_CYCLE_TIME", "60001"),
    ("HVDLIKE_GLOO_TIMEOUT_SECONDS", "NaN"),
    ("HVDLIKE_GLOO_TIMEOUT_SECONDS", "1e10"),
    ("HVDLIKE_START_TIMEOUT", "inf"),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "Infinity"),
    ("HVDLIKE_STALL_SHUTDOWN_TIME_SECONDS", "1e300"),
    ("HVDLIKE_DEADLOCK_TIME_SECONDS", "nan"),
])
def test_durations_must_be_finite_and_representable(var, value):
    with pytest.raises(ConfigError, match=f"{var}={value!r} is not valid: expected .*at most"):
        config.load({var: value})


def test_largest_durations_are_accepted():
    cfg = config.load({"HVDLIKE_CYCLE_TIME": "60000", "HVDLIKE_GLOO_TIMEOUT_SECONDS": "1e8",
                       "HVDLIKE_START_TIMEOUT": "1e8", "HVDLIKE_DEADLOCK_TIME_SECONDS": "0",
                       "HVDLIKE_STALL_SHUTDOWN_TIME_SECONDS": "1e8"})
    assert (cfg.cycle_time, cfg.gloo_timeout_seconds, cfg.start_timeout) == (60000.0, 1e8, 1e8)
    assert cfg.deadlock_time_seconds == 0.0 and cfg.stall_shutdown_time_seconds == 1e8
