import csv
import logging

import pytest

from hvdlike.core import autotune, config
from hvdlike.core.autotune import (Autotuner, Candidate, CoordinateSearch, SampleLog,
                                   StepCounter, settings_lines, step_key)
from hvdlike.core.errors import ConfigError
from hvdlike.core.log import logger
from hvdlike.core.messages import OpType, Response

MIB = 1024 * 1024


def _ar(name, numel, dtype="float32", op=OpType.ALLREDUCE, error=""):
    return (Response(name=name, op=op, dtype=dtype, shape=(numel,), error=error), None)


def test_step_key_drops_automatic_counters_only():
    assert step_key("allreduce.noname.17") == "allreduce.noname"
    assert step_key("grouped_allreduce.noname.3.1") == "grouped_allreduce.noname.1"
    assert step_key("allreduce.ps2.noname.40") == "allreduce.ps2.noname"
    assert step_key("layer1.weight") == "layer1.weight"
    # The optimizer's stable names are left as they are (group and parameter index).
    assert step_key("DistributedOptimizer.noname.0.3") == "DistributedOptimizer.noname.0.3"
    assert step_key("opt1.DistributedOptimizer.noname.1.3") == \
        "opt1.DistributedOptimizer.noname.1.3"
    # with the kind in front, as every collective is now negotiated
    assert step_key("allreduce.DistributedOptimizer.noname.0.3") == \
        "allreduce.DistributedOptimizer.noname.0.3"
    assert step_key("broadcast.broadcast_object.noname.4.size") == \
        "broadcast.broadcast_object.noname.size"
    assert step_key("allgather.sparse_allreduce.ps1.noname.2.values") == \
        "allgather.sparse_allreduce.ps1.noname.values"


def test_step_counter_counts_recurring_names():
    counter = StepCounter()
    names = ["a", "b", "c", "a", "b", "c", "a", "b"]
    assert [counter.feed(n) for n in names] == [False, False, False, True, False, False,
                                                 True, False]
    unnamed = StepCounter()
    assert [unnamed.feed(f"allreduce.noname.{i}") for i in range(3)] == [False, True, True]


def test_search_tries_configured_values_first_then_grid():
    search = CoordinateSearch(Candidate(32 * MIB, 1.0), samples_per_candidate=1)
    tried = [search.current]
    while not search.done:
        tried.append(search.add(1.0))
    tried.pop()  # the winner, reported once done
    thresholds = [c.fusion_threshold for c in tried[:6]]
    assert thresholds == [32 * MIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 128 * MIB]
    assert all(c.cycle_time_ms == 1.0 for c in tried[:6])
    # Phase 2: the other cycle times at the best threshold (all tied: the first tried).
    assert tried[6:] == [Candidate(32 * MIB, c) for c in (0.5, 2.5, 5.0)]
    assert len(tried) == search.total_samples() == 9
    assert search.best() == Candidate(32 * MIB, 1.0)


def test_search_settles_on_best_median():
    def throughput(c):
        # Peaks at 16 MiB and 2.5 ms; one outlier per candidate must not decide.
        return 100 - abs(c.fusion_threshold // MIB - 16) - 10 * abs(c.cycle_time_ms - 2.5)

    search = CoordinateSearch(Candidate(128 * MIB, 1.0))
    assert search.total_samples() == (5 + 4 - 1) * 3
    n = 0
    while not search.done:
        c = search.current
        outlier = 1000 if (n % 3 == 1 and c.fusion_threshold == MIB) else 0
        search.add(throughput(c) + outlier)
        n += 1
    assert n == search.total_samples()
    assert search.current == search.best() == Candidate(16 * MIB, 2.5)
    assert search.median(Candidate(MIB, 1.0)) == throughput(Candidate(MIB, 1.0))
    with pytest.raises(RuntimeError, match="settled"):
        search.add(1.0)


def test_search_rejects_no_samples():
    with pytest.raises(ValueError, match="samples_per_candidate"):
        CoordinateSearch(Candidate(MIB, 1.0), samples_per_candidate=0)
    with pytest.raises(RuntimeError, match="no sample"):
        CoordinateSearch(Candidate(MIB, 1.0)).best()


def test_decision_round_trip_and_bad_payload():
    c = Candidate(64 * MIB, 2.5)
    assert Candidate.decode(c.encode(True)) == (c, True)
    assert Candidate.decode(c.encode(False)) == (c, False)
    with pytest.raises(ValueError, match="expected"):
        Candidate.decode(b"xx")


def test_settings_lines_are_valid_knob_values():
    lines = settings_lines(Candidate(4 * MIB, 0.5))
    assert lines == ["HVDLIKE_FUSION_THRESHOLD=4194304", "HVDLIKE_CYCLE_TIME=0.5"]
    cfg = config.load(dict(line.split("=", 1) for line in lines))
    assert (cfg.fusion_threshold, cfg.cycle_time) == (4 * MIB, 0.5)


def test_sample_log_bad_path_names_the_variable(tmp_path):
    with pytest.raises(ConfigError, match="HVDLIKE_AUTOTUNE_LOG=.*no/such"):
        SampleLog(str(tmp_path / "no" / "such" / "log.csv"))


def test_autotune_knobs():
    cfg = config.load({"HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "0",
                       "HVDLIKE_AUTOTUNE_STEPS_PER_SAMPLE": "4"})
    assert (cfg.autotune_warmup_samples, cfg.autotune_steps_per_sample) == (0, 4)
    assert config.load({}).autotune_steps_per_sample == 10
    with pytest.raises(ConfigError, match="HVDLIKE_AUTOTUNE_STEPS_PER_SAMPLE='0'"):
        config.load({"HVDLIKE_AUTOTUNE_STEPS_PER_SAMPLE": "0"})


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class _Wire:
    """Rank 0's broadcast stores the payload; other ranks' broadcasts read it."""

    def __init__(self):
        self.payloads = []
        self.calls = {0: 0, 1: 0}

    def broadcast(self, rank):
        def call(payload):
            self.calls[rank] += 1
            if rank == 0:
                self.payloads.append(payload)
                return payload
            assert payload == b""
            return self.payloads[self.calls[rank] - 1]
        return call


def _tuners(tmp_path, warmup=2, steps=2, clock=None):
    wire = _Wire()
    applied = {0: [], 1: []}
    start = Candidate(128 * MIB, 1.0)
    tuners = [Autotuner(rank, wire.broadcast(rank), applied[rank].append, start, warmup, steps,
                        log_path=str(tmp_path / "tune.csv") if rank == 0 else "",
                        clock=clock or _Clock())
              for rank in (0, 1)]
    return tuners, wire, applied


def _rows(tmp_path):
    with open(tmp_path / "tune.csv") as f:
        return list(csv.DictReader(f))


def test_two_ranks_switch_in_the_same_cycle_and_settle_alike(tmp_path):
    clock = _Clock()
    tuners, wire, applied = _tuners(tmp_path, clock=clock)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        cycles = 0
        step = [_ar("w", 1000), _ar("b", 24)]  # 4096 bytes per step (float32)
        while tuners[0].settled is None:
            current = tuners[0].current
            # A step takes less time with 16 MiB fusion and 2.5 ms cycles.
            clock.now += (1.0 + abs(current.fusion_threshold // MIB - 16) / 100
                          + abs(current.cycle_time_ms - 2.5) / 10)
            done = [t.cycle(step) for t in tuners]
            assert done[0] == done[1]
            assert tuners[0].current == tuners[1].current
            cycles += 1
            assert cycles < 1000
        assert tuners[1].settled == tuners[0].settled == Candidate(16 * MIB, 2.5)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert applied[0] == applied[1] and applied[0][-1] == Candidate(16 * MIB, 2.5)
    total = 2 + tuners[0].search.total_samples()
    assert wire.calls == {0: total, 1: total}
    rows = _rows(tmp_path)
    assert [r["kind"] for r in rows] == ["warmup"] * 2 + ["sample"] * (total - 2) + ["chosen"]
    assert [r["sample"] for r in rows[:-1]] == [str(i) for i in range(1, total + 1)]
    assert {int(r["fusion_threshold_bytes"]) for r in rows} == set(autotune.FUSION_GRID)
    assert {float(r["cycle_time_ms"]) for r in rows} == set(autotune.CYCLE_GRID_MS)
    assert all(int(r["bytes"]) == 2 * 4096 for r in rows[:-1])
    assert rows[-1]["fusion_threshold_bytes"] == str(16 * MIB)
    assert rows[-1]["cycle_time_ms"] == "2.5"
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "HVDLIKE_FUSION_THRESHOLD=16777216\nHVDLIKE_CYCLE_TIME=2.5" in warnings[0]
    assert sum(r.levelno == logging.INFO for r in records) == total


def test_sample_boundary_splits_a_cycle_and_skips_idle_cycles(tmp_path):
    clock = _Clock()
    tuners, wire, _ = _tuners(tmp_path, warmup=0, steps=1, clock=clock)
    rank0 = tuners[0]
    for _ in range(5):  # idle cycles and other ops: no sample, no broadcast
        clock.now += 50
        assert not rank0.cycle([])
        assert not rank0.cycle([_ar("bc", 10, op=OpType.BROADCAST), _ar("bad", 10, error="x")])
    assert wire.calls[0] == 0
    clock.now = 1000.0
    rank0.cycle([_ar("a", 10), _ar("b", 20, dtype="float64")])  # first traffic: window opens
    clock.now = 1002.0
    rank0.cycle([_ar("c", 5), _ar("a", 10), _ar("b", 20, dtype="float64")])  # "a" recurs
    assert wire.calls[0] == 1
    clock.now = 1003.0
    rank0.cycle([_ar("a", 10)])
    rows = _rows(tmp_path)
    # First sample: a, b, c (40 + 160 + 20 bytes) over 2 s; the recurring "a" and "b"
    # of the splitting cycle and nothing else before the next "a" form the second.
    assert [(r["bytes"], r["seconds"]) for r in rows] == [("220", "2.000000"),
                                                         ("200", "1.000000")]
    assert float(rows[0]["score_bytes_per_second"]) == 110.0


def test_an_autotune_log_that_is_a_planted_symbolic_link_is_refused(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    link = tmp_path / "autotune.csv"
    link.symlink_to(victim)
    with pytest.raises(ConfigError, match="is a symbolic link; refusing to follow it"):
        SampleLog(str(link))
    assert victim.read_text() == "precious\n"
