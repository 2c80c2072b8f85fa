"""Knob values at the edges: too large for the fields they travel in, blank file
paths, special files, digits of other scripts, settings ranks must share, and
a stall shutdown time below the stall check time."""

import os
import threading
import time

import pytest

from hvdlike.core import agreement, autotune, config, health
from hvdlike.core.errors import ConfigError, StallError
from hvdlike.launcher import cli
from hvdlike.launcher.errors import LaunchError
from hvdlike.launcher.job import check_writable_file
from tests.local_store import client, host_store

TOO_BIG = str(2**63)


def _main(argv, capsys):
    """``hvdlike-run argv`` in-process: (exit status, stdout, stderr)."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def clean_env(monkeypatch):
    """No knob variable inherited from the environment running the tests."""
    for name in list(os.environ):
        if name.startswith(("HVDLIKE_", "HOROVOD_")):
            monkeypatch.delenv(name)
    return monkeypatch


# -- integers too large for 64 bits ---------------------------------------------------


def _integer_knobs():
    found = []
    for knob in config.KNOBS:
        try:
            value = knob.parse(str(2**20))
        except ValueError:
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            found.append(knob)
    return found


def test_every_integer_knob_stops_at_the_64_bit_limit():
    knobs = _integer_knobs()
    assert {k.field for k in knobs} == {
        "fusion_threshold", "cache_capacity", "timeline_max_bytes", "autotune_warmup_samples",
        "autotune_steps_per_sample", "autotune_bayes_opt_max_samples", "num_nccl_streams"}
    for knob in knobs:
        assert getattr(config.load({knob.env: str(2**63 - 1)}), knob.field) == 2**63 - 1
        for name in (knob.env, knob.fallback_env):
            with pytest.raises(ConfigError) as caught:
                config.load({name: TOO_BIG})
            text = str(caught.value)
            assert text.startswith(f"{name}={TOO_BIG!r} is not valid: expected ")
            assert "at most 9223372036854775807" in text and "\n" not in text


def test_the_largest_fusion_threshold_accepted_fits_the_autotuner_decision():
    env = {"HOROVOD_AUTOTUNE": "1", "HVDLIKE_FUSION_THRESHOLD": str(2**63 - 1),
           "HVDLIKE_CYCLE_TIME": str(config.MAX_CYCLE_TIME_MS)}
    cfg = config.load(env)
    candidate = autotune.Candidate(cfg.fusion_threshold, cfg.cycle_time)
    assert autotune.Candidate.decode(candidate.encode(True)) == (candidate, True)
    sent = []
    tuner = autotune.build(cfg, 0, lambda payload: sent.append(payload) or payload,
                           autotune.LiveSettings(cfg.fusion_threshold, cfg.cycle_time))
    tuner._end_sample(1024)  # rank 0's first decision, packed and broadcast
    assert len(sent) == 1
    # One more would not fit: refused by name before any rank trains.
    with pytest.raises(ConfigError, match=r"^HVDLIKE_FUSION_THRESHOLD='9223372036854775808' "):
        config.load({**env, "HVDLIKE_FUSION_THRESHOLD": TOO_BIG})


def test_init_arguments_get_the_same_bound():
    with pytest.raises(ConfigError, match=r"^init: fusion_threshold=9223372036854775808 is "
                                          r"not valid: expected a byte count >= 0"):
        config.load({}, fusion_threshold=2**63)
    with pytest.raises(ConfigError, match=r"^init: cache_capacity=-1 is not valid"):
        config.load({}, cache_capacity=-1)
    assert config.load({}, fusion_threshold=0, autotune=True).fusion_threshold == 0


@pytest.mark.parametrize("argv, needle", [
    (["--autotune", "--fusion-threshold-mb", "1e13"],
     "--fusion-threshold-mb '1e13' is not valid: expected a byte count >= 0 (0 disables "
     "fusion), at most 9223372036854775807"),
    (["--cache-capacity", TOO_BIG], f"--cache-capacity {TOO_BIG!r} is not valid"),
])
def test_the_launcher_refuses_a_flag_too_large_in_one_line(argv, needle, capsys, clean_env):
    code, _, err = _main(["-np", "2", *argv, "--dry-run", "true"], capsys)
    assert code == 2 and err.count("\n") == 1 and needle in err, err


def test_the_launcher_refuses_a_variable_too_large_in_one_line(capsys, clean_env):
    clean_env.setenv("HOROVOD_AUTOTUNE", "1")
    clean_env.setenv("HVDLIKE_FUSION_THRESHOLD", TOO_BIG)
    code, out, err = _main(["-np", "2", "--dry-run", "true"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"HVDLIKE_FUSION_THRESHOLD={TOO_BIG!r} is not valid" in err and out == ""


# -- file paths ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["HOROVOD_TIMELINE", "HVDLIKE_TIMELINE",
                                  "HVDLIKE_AUTOTUNE_LOG", "HOROVOD_AUTOTUNE_LOG"])
@pytest.mark.parametrize("blank", [" ", "\t", "  \n"])
def test_a_blank_file_path_is_refused_not_a_file_named_blank(name, blank):
    with pytest.raises(ConfigError) as caught:
        config.load({name: blank, "HOROVOD_AUTOTUNE": "1"})
    assert str(caught.value) == (f"{name}={blank!r} is not valid: expected a file path "
                                 "(empty for none), not only white space")


def test_a_blank_init_argument_path_is_refused_and_an_empty_one_means_none():
    with pytest.raises(ConfigError, match=r"^init: timeline=' ' is not valid"):
        config.load({}, timeline=" ")
    with pytest.raises(ConfigError, match=r"^init: autotune_log='\\t' is not valid"):
        config.load({}, autotune_log="\t")
    cfg = config.load({"HVDLIKE_TIMELINE": "", "HVDLIKE_AUTOTUNE_LOG": ""}, autotune_log="")
    assert cfg.timeline == "" and cfg.autotune_log == ""
    assert config.load({"HVDLIKE_TIMELINE": " tl.json"}).timeline == " tl.json"


def test_the_launcher_refuses_a_blank_path_variable(capsys, clean_env, tmp_path):
    clean_env.chdir(tmp_path)
    clean_env.setenv("HOROVOD_TIMELINE", " ")
    code, _, err = _main(["-np", "2", "--dry-run", "true"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "HOROVOD_TIMELINE=' ' is not valid: expected a file path" in err
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="no /dev/null here")
def test_a_character_device_is_refused_by_the_launcher(tmp_path):
    with pytest.raises(LaunchError) as caught:
        check_writable_file("/dev/null", str(tmp_path), "--timeline-filename (HOROVOD_TIMELINE)")
    assert str(caught.value) == ("--timeline-filename (HOROVOD_TIMELINE) /dev/null: is a "
                                 "character device, not a file")


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="no /dev/null here")
@pytest.mark.parametrize("variables, needle", [
    ({"HOROVOD_TIMELINE": "/dev/null"},
     "--timeline-filename (HOROVOD_TIMELINE) /dev/null: is a character device, not a file"),
    ({"HVDLIKE_AUTOTUNE": "1", "HVDLIKE_AUTOTUNE_LOG": "/dev/null"},
     "--autotune-log-file (HVDLIKE_AUTOTUNE_LOG) /dev/null: is a character device, not a file"),
])
def test_a_character_device_output_stops_the_launch_in_one_line(variables, needle, capsys,
                                                                clean_env):
    for name, value in variables.items():
        clean_env.setenv(name, value)
    for mpi in ([], ["--mpi"]):
        code, out, err = _main(["-np", "2", *mpi, "--dry-run", "true"], capsys)
        assert code == 2 and err.count("\n") == 1 and needle in err, err
        assert out == ""


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="no /dev/null here")
def test_a_rank_refuses_a_character_device_autotune_log_naming_the_variable_set(clean_env):
    clean_env.setenv("HOROVOD_AUTOTUNE_LOG", "/dev/null")
    with pytest.raises(ConfigError) as caught:
        autotune.SampleLog("/dev/null")
    assert str(caught.value) == ("HOROVOD_AUTOTUNE_LOG='/dev/null': cannot write the autotune "
                                 "log: is not a regular file")


def test_a_dry_run_checks_the_files_ranks_would_write(capsys, clean_env, tmp_path):
    folder = tmp_path / "timeline.json"
    folder.mkdir()
    code, out, err = _main(["-np", "2", "--timeline-filename", str(folder), "--dry-run", "true"],
                           capsys)
    assert code == 2 and err.count("\n") == 1 and out == "", err
    assert f"--timeline-filename (HVDLIKE_TIMELINE) {folder}: is a directory" in err
    code, out, err = _main(["-np", "2", "--timeline-filename", str(tmp_path / "t.json"),
                            "--dry-run", "true"], capsys)
    assert code == 0 and "rank 1 on localhost" in out, err
    assert sorted(os.listdir(tmp_path)) == ["timeline.json"]  # the probe left nothing


# -- thread affinity ---------------------------------------------------------------


def test_thread_affinity_takes_ascii_core_ids_only():
    for text in ("0,\uff11", "0,\u0663", "0,2_0", "\u0660", "1,\u00b2"):
        with pytest.raises(ConfigError) as caught:
            config.load({"HOROVOD_THREAD_AFFINITY": text})
        assert str(caught.value) == (f"HOROVOD_THREAD_AFFINITY={text!r} is not valid: expected "
                                     "comma-separated core ids >= 0, one per local rank")
    assert config.load({"HVDLIKE_THREAD_AFFINITY": " 0, +1 ,2"}).thread_affinity == "0,+1,2"
    assert config.load({"HVDLIKE_THREAD_AFFINITY": " "}).thread_affinity == ""


# -- MPI without threads must be alike on every rank -----------------------------------


def test_mpi_threads_disable_is_a_setting_every_rank_shares():
    assert "mpi_threads_disable" in agreement.SHARED
    mine = agreement.values(config.load({}))
    theirs = agreement.values(config.load({"HOROVOD_MPI_THREADS_DISABLE": "1"}))
    said = agreement.disagreements(mine, {1: theirs})
    assert said.splitlines()[1:] == [
        "  HVDLIKE_MPI_THREADS_DISABLE (or HOROVOD_MPI_THREADS_DISABLE): rank 0 False, "
        "rank 1 True"]


def test_rank_0_raises_a_disagreement_only_once_the_others_have_read_it():
    # Under mpirun rank 0 hosts the store: raising at once, it could take the
    # store away before a peer read why, and that peer would fail on a lost store.
    from hvdlike.core import store_wait

    host = host_store(timeout=5)
    configs = [config.load({}), config.load({"HOROVOD_MPI_THREADS_DISABLE": "1"})]
    errors = {}

    def rank(r):
        if r == 1:
            time.sleep(0.5)  # the slower rank
        try:
            agreement.check(client(host, timeout=5), "t/", r, 2, configs[r], 10,
                            store_wait.no_watch(), lambda: None)
        except ConfigError as exc:
            errors[r] = str(exc)
            if r == 0:
                errors["read when rank 0 raised"] = host.check(["t/agree/read/1"])

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors[0] == errors[1] and "HVDLIKE_MPI_THREADS_DISABLE" in errors[0]
    assert errors["read when rank 0 raised"]


# -- a stall shutdown time below the stall check time ----------------------------------


def test_a_shutdown_time_below_the_check_time_shuts_nothing_down(clean_env):
    env = {"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "1"}
    seconds, name, warning = health.shutdown_after(config.load(env), env)
    assert (seconds, name) == (0.0, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
    assert warning == ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=1 is less than "
                       "HVDLIKE_STALL_CHECK_TIME_SECONDS (60, its default), so a stall will be "
                       "reported but will not shut the job down; set it to at least 60 for that")
    env = {"HVDLIKE_STALL_SHUTDOWN_TIME_SECONDS": "5", "HOROVOD_STALL_CHECK_TIME_SECONDS": "10"}
    seconds, name, warning = health.shutdown_after(config.load(env), env)
    assert seconds == 0.0 and warning.startswith(
        "HVDLIKE_STALL_SHUTDOWN_TIME_SECONDS=5 is less than HOROVOD_STALL_CHECK_TIME_SECONDS=10,")


@pytest.mark.parametrize("env", [
    {"HVDLIKE_STALL_SHUTDOWN_TIME_SECONDS": "10", "HVDLIKE_STALL_CHECK_TIME_SECONDS": "10"},
    {"HVDLIKE_STALL_SHUTDOWN_TIME_SECONDS": "30", "HVDLIKE_STALL_CHECK_TIME_SECONDS": "10"},
    {"HVDLIKE_STALL_SHUTDOWN_TIME_SECONDS": "0", "HVDLIKE_STALL_CHECK_TIME_SECONDS": "10"},
    {"HVDLIKE_STALL_SHUTDOWN_TIME_SECONDS": "1", "HVDLIKE_STALL_CHECK_DISABLE": "1"},
])
def test_other_shutdown_times_are_used_as_set_without_a_warning(env):
    seconds, _, warning = health.shutdown_after(config.load(env), env)
    assert seconds == config.load(env).stall_shutdown_time_seconds and warning == ""


class _Rank:
    """One rank's Health on a shared store; ``waiting`` is what it waits on."""

    def __init__(self, store, rank, cfg, waiting):
        self.aborts = []
        self.got = threading.Event()
        self.health = health.Health(store, rank, 2, "host", cfg, lambda: waiting,
                                    self._abort)

    def _abort(self, exc):
        self.aborts.append(exc)
        self.got.set()


def _stall(monkeypatch, variables, seconds):
    """Rank 1 waits on a tensor rank 0 never submits, for ``seconds`` on rank 0's
    watch; returns (rank 0's aborts, rank 0's warnings)."""
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    warnings = []
    monkeypatch.setattr(health.logger, "warning",
                        lambda fmt, *args: warnings.append(fmt % args))
    cfg = config.load(os.environ)
    host = host_store(timeout=5)
    since = time.monotonic() - 3.0  # rank 1 has waited 3 s already
    r0 = _Rank(client(host, timeout=5), 0, cfg, {})
    r1 = _Rank(client(host, timeout=5), 1, cfg, {(0, "grad.0"): since})
    try:
        r0.got.wait(seconds)
        return r0.aborts, warnings
    finally:
        r1.health.close(clean=False)
        r0.health.close(clean=False)


def test_a_stall_past_a_shutdown_time_below_the_check_time_is_not_a_shutdown(clean_env):
    aborts, warnings = _stall(clean_env, {"HOROVOD_STALL_CHECK_TIME_SECONDS": "2",
                                          "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "1"}, 2.5)
    assert aborts == []
    assert warnings[0] == ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=1 is less than "
                           "HOROVOD_STALL_CHECK_TIME_SECONDS=2, so a stall will be reported but "
                           "will not shut the job down; set it to at least 2 for that")
    assert any(w.startswith("stall: some ranks submitted collectives") and "'grad.0'" in w
               for w in warnings[1:])  # still reported


def test_a_stall_shutdown_names_the_variable_as_set(clean_env):
    aborts, _ = _stall(clean_env, {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1",
                                   "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "2"}, 10)
    assert len(aborts) == 1 and isinstance(aborts[0], StallError)
    assert "(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=2); shutting down every rank" in str(aborts[0])
