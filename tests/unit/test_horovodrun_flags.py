"""Every ``horovodrun`` flag is an ``hvdlike-run`` flag, and each does what it says."""

import logging
import re
import subprocess

import pytest

from hvdlike.core import autotune, config as core_config, log, mpi_plane
from hvdlike.core.errors import ConfigError
from hvdlike.core.runtime import affinity_core
from hvdlike.core.topology import Topology
from hvdlike.launcher import cli
from hvdlike.launcher.errors import LaunchError
from hvdlike.launcher.monitor import Output

# horovodrun's flags (horovod 0.28.1, `horovodrun --help`), long spellings.
HOROVODRUN_FLAGS = """
--autotune --autotune-bayes-opt-max-samples --autotune-gaussian-process-noise
--autotune-log-file --autotune-steps-per-sample --autotune-warmup-samples --binding-args
--blacklist-cooldown-range --cache-capacity --check-build --config-file --cycle-time-ms
--disable-cache --elastic-timeout --fusion-threshold-mb --gloo --gloo-timeout-seconds
--hierarchical-allgather --hierarchical-allreduce --host-discovery-script --hostfile --hosts
--jsrun --log-hide-timestamp --log-level --log-with-timestamp --log-without-timestamp --max-np
--max-num-proc --min-np --min-num-proc --mpi --mpi-args --mpi-threads-disable
--network-interface --network-interfaces --no-autotune --no-hierarchical-allgather
--no-hierarchical-allreduce --no-log-hide-timestamp --no-mpi-threads-disable --no-stall-check
--no-timeline-mark-cycles --no-torus-allreduce --num-nccl-streams --num-proc --output-filename
--prefix-output-with-timestamp --reset-limit --slots-per-host --ssh-identity-file --ssh-port
--stall-check --stall-check-shutdown-time-seconds --stall-check-warning-time-seconds
--start-timeout --tcp --thread-affinity --timeline-filename --timeline-mark-cycles
--torus-allreduce --verbose --version
""".split()


def _config(*argv):
    return cli.to_config(cli.build_parser().parse_args(list(argv)))


# horovodrun's other spellings (horovod/runner/launch.py), each with its long one.
HOROVODRUN_SHORT_FLAGS = {
    "-v": "--version", "-np": "--num-proc", "-cb": "--check-build", "-p": "--ssh-port",
    "-i": "--ssh-identity-file", "-prefix-timestamp": "--prefix-output-with-timestamp",
    "-H": "--hosts", "-hostfile": "--hostfile",
}


def test_every_horovodrun_flag_is_known():
    known = set(cli.build_parser()._option_string_actions)
    assert [f for f in HOROVODRUN_FLAGS if f not in known] == []


@pytest.mark.parametrize("short, long", sorted(HOROVODRUN_SHORT_FLAGS.items()))
def test_every_horovodrun_short_spelling_is_the_same_flag(short, long):
    actions = cli.build_parser()._option_string_actions
    assert short in actions and actions[short] is actions[long]


def test_short_spellings_parse_as_horovodrun_parses_them(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    args = cli.build_parser().parse_args(["-np", "2", "-hostfile", str(hostfile),
                                          "-prefix-timestamp", "-cb", "python", "x.py"])
    assert (args.np, args.hostfile, args.prefix_output_with_timestamp, args.check_build) == (
        2, str(hostfile), True, True)
    assert args.command == ["python", "x.py"]
    config = _config("-np", "1", "-hostfile", str(hostfile), "python", "x.py")
    assert [(h.host, h.slots) for h in config.hosts] == [("localhost", 2)]
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(["-v"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("hvdlike-run ")


@pytest.mark.parametrize("flag, variable, value", [
    ("--no-autotune", "HVDLIKE_AUTOTUNE", "0"),
    ("--no-timeline-mark-cycles", "HVDLIKE_TIMELINE_MARK_CYCLES", "0"),
    ("--stall-check", "HVDLIKE_STALL_CHECK_DISABLE", "0"),
    ("--log-hide-timestamp", "HVDLIKE_LOG_HIDE_TIME", "1"),
    ("--log-without-timestamp", "HVDLIKE_LOG_HIDE_TIME", "1"),
    ("--log-with-timestamp", "HVDLIKE_LOG_HIDE_TIME", "0"),
    ("--no-log-hide-timestamp", "HVDLIKE_LOG_HIDE_TIME", "0"),
    ("--mpi-threads-disable", "HVDLIKE_MPI_THREADS_DISABLE", "1"),
    ("--no-mpi-threads-disable", "HVDLIKE_MPI_THREADS_DISABLE", "0"),
    ("--torus-allreduce", "HVDLIKE_TORUS_ALLREDUCE", "1"),
    ("--no-torus-allreduce", "HVDLIKE_TORUS_ALLREDUCE", "0"),
])
def test_switches_set_their_variables(flag, variable, value):
    assert _config("-np", "1", flag, "python", "x.py").knob_env == {variable: value}


@pytest.mark.parametrize("argv, variable, value", [
    (["--thread-affinity", "1, 0"], "HVDLIKE_THREAD_AFFINITY", "1, 0"),
    (["--num-nccl-streams", "2"], "HVDLIKE_NUM_NCCL_STREAMS", "2"),
    (["--autotune-bayes-opt-max-samples", "7"], "HVDLIKE_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "7"),
    (["--autotune-gaussian-process-noise", "0.5"],
     "HVDLIKE_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "0.5"),
])
def test_valued_flags_set_their_variables(argv, variable, value):
    assert _config("-np", "1", *argv, "python", "x.py").knob_env == {variable: value}


@pytest.mark.parametrize("argv, needle", [
    (["--thread-affinity", "0,x"], "--thread-affinity '0,x' is not valid"),
    (["--thread-affinity", "-1"], "core ids >= 0"),
    (["--num-nccl-streams", "0"], "--num-nccl-streams '0' is not valid"),
    (["--autotune-bayes-opt-max-samples", "0"], "an integer > 0"),
    (["--autotune-gaussian-process-noise", "nan"], "a number from 0 to 1"),
    (["--autotune-gaussian-process-noise", "1.5"],
     "--autotune-gaussian-process-noise '1.5' is not valid: expected a number from 0 to 1"),
    (["--autotune-gaussian-process-noise", "-0.1"], "a number from 0 to 1"),
    (["--jsrun"], "--jsrun (IBM Spectrum LSF) is not supported"),
    (["--network-interfaces", " , "], "--network-interfaces is empty"),
    (["--network-interface", ","], "--network-interface is empty"),
    (["-H", "", "--hostfile", "f"], "-H/--hosts is empty"),
    (["-H", " "], "-H/--hosts is empty"),
    (["--mpi", "--binding-args", "'--bind-to"], "--binding-args"),
])
def test_bad_values_are_refused_naming_the_flag(argv, needle):
    with pytest.raises(LaunchError, match=re.escape(needle)):
        _config("-np", "1", *argv, "python", "x.py")


def test_aliases_and_list_spellings():
    config = _config("--network-interfaces", "eth1,eth0", "-np", "1", "python", "x.py")
    assert config.network_interface == "eth1"
    assert config.network_interfaces == ["eth1", "eth0"]
    elastic = _config("-np", "2", "--min-num-proc", "1", "--max-num-proc", "3", "python", "x.py")
    assert (elastic.elastic.min_np, elastic.elastic.max_np) == (1, 3)
    assert _config("-np", "1", "--tcp", "python", "x.py").knob_env == {}


def test_interfaces_from_commas_and_repeated_flags_are_their_union_in_order():
    config = _config("--network-interface", "lo,eth0", "--network-interfaces", "eth1",
                     "--network-interface", "eth0", "-np", "1", "python", "x.py")
    assert config.network_interfaces == ["lo", "eth0", "eth1"]
    assert config.network_interface == "lo"  # the store's and Gloo's (HVDLIKE_GLOO_IFACE)


def test_disable_cache_is_accepted_and_sets_nothing_for_the_ranks():
    # horovodrun's --disable-cache only skips its launcher's cache of host checks
    config = _config("-np", "1", "--disable-cache", "python", "x.py")
    assert config.knob_env == {}
    assert _config("-np", "1", "--cache-capacity", "0", "python", "x.py").knob_env == {
        "HVDLIKE_CACHE_CAPACITY": "0"}


def _rank_env(*argv, environ=None):
    from hvdlike.launcher.job import Job

    config = _config("-np", "1", *argv, "python", "x.py")
    if environ is not None:
        config.environ = environ
    job = Job(config)
    return job.rank_spec(job.placements[0], "127.0.0.1", 1)["env"]


def test_tcp_and_interfaces_set_nccls_variables_unless_the_user_did():
    env = _rank_env("--tcp", "--network-interface", "lo,eth0", environ={"PATH": "/bin"})
    assert env["NCCL_IB_DISABLE"] == "1"
    assert env["NCCL_SOCKET_IFNAME"] == "lo,eth0"
    assert env["HVDLIKE_GLOO_IFACE"] == "lo"
    plain = _rank_env(environ={"PATH": "/bin"})
    assert "NCCL_IB_DISABLE" not in plain and "NCCL_SOCKET_IFNAME" not in plain
    own = _rank_env("--tcp", "--network-interface", "lo",
                    environ={"NCCL_IB_DISABLE": "0", "NCCL_SOCKET_IFNAME": "=ib0"})
    assert (own["NCCL_IB_DISABLE"], own["NCCL_SOCKET_IFNAME"]) == ("0", "=ib0")


def test_every_rank_is_unbuffered_unless_the_user_chose():
    assert _rank_env(environ={"PATH": "/bin"})["PYTHONUNBUFFERED"] == "1"
    assert _rank_env(environ={"PYTHONUNBUFFERED": ""})["PYTHONUNBUFFERED"] == ""


def test_mpirun_gets_nccls_variables_and_no_outer_job_variables():
    from hvdlike.launcher.mpi_exec import mpi_environment

    config = _config("--mpi", "-np", "1", "--tcp", "--network-interfaces", "lo,eth0",
                     "python", "x.py")
    config.environ = {"PATH": "/bin", "HVDLIKE_ELASTIC_WORKER": "w9"}
    env = mpi_environment(config)
    assert (env["NCCL_IB_DISABLE"], env["NCCL_SOCKET_IFNAME"]) == ("1", "lo,eth0")
    # mpirun forwards the output; unbuffered pieces would each get Hydra's prefix
    assert "PYTHONUNBUFFERED" not in env and "HVDLIKE_ELASTIC_WORKER" not in env


def test_binding_args_go_to_mpirun_and_are_reported_as_ignored_without_it(capsys):
    config = _config("--mpi", "-np", "2", "--mpi-args=-v", "--binding-args", "--bind-to core",
                     "python", "x.py")
    assert config.mpi_args == ["-v", "--bind-to", "core"]
    config = _config("-np", "2", "--binding-args", "--bind-to core", "python", "x.py")
    assert config.mpi_args == []
    assert "--binding-args applies to --mpi launches only" in capsys.readouterr().err


def test_output_lines_start_with_the_time_when_asked(tmp_path):
    out_file, err_file = open(tmp_path / "o", "w+"), open(tmp_path / "e", "w+")
    Output(out_file, err_file, timestamps=True).line(3, "stdout", "hello")
    Output(out_file, err_file).line(3, "stdout", "plain")
    out_file.seek(0)
    stamped, plain = out_file.read().splitlines()
    assert re.fullmatch(r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}\[3\]<stdout>:hello", stamped)
    assert plain == "[3]<stdout>:plain"
    assert _config("-np", "1", "--prefix-output-with-timestamp", "python", "x.py").timestamps


def test_log_lines_carry_the_time_unless_hidden(capsys):
    record = logging.LogRecord("hvdlike", logging.WARNING, __file__, 1, "careful", (), None)
    log.configure(logging.WARNING, 2)
    with_time = log._handler.format(record)
    log.configure(logging.WARNING, 2, hide_time=True)
    without = log._handler.format(record)
    log.configure(logging.WARNING, 0)
    assert re.fullmatch(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}\] \[hvdlike rank 2\] "
                        r"WARNING: careful", with_time), with_time
    assert without == "[hvdlike rank 2] WARNING: careful"


def test_the_autotune_budget_settles_on_the_best_so_far():
    start = autotune.Candidate(64 * 2 ** 20, 1.0)
    search = autotune.CoordinateSearch(start, max_samples=4)
    assert search.total_samples() == 4
    for score in (5.0, 5.0, 5.0, 9.0):
        assert not search.done
        search.add(score)
    assert search.done and search.current == start  # the second candidate has one sample
    whole = autotune.CoordinateSearch(start)
    assert whole.total_samples() == 24 and whole.max_samples is None
    cfg = core_config.load({"HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "6"})
    built = autotune.build(cfg, 0, lambda b: b, autotune.LiveSettings(1, 1.0, False))
    assert built.search.max_samples == 6


def test_thread_affinity_names_one_core_per_local_rank():
    topo = Topology(rank=1, size=2, local_rank=1, local_size=2)
    allowed = sorted(__import__("os").sched_getaffinity(0))
    assert affinity_core("", topo) is None
    assert affinity_core(f"{allowed[0]},{allowed[-1]}", topo) == allowed[-1]
    with pytest.raises(ConfigError, match="core 4096 .* not available"):
        affinity_core("0,4096", topo)


@pytest.mark.parametrize("local_rank", [0, 1])
def test_too_few_affinity_cores_log_an_error_and_pin_nothing(local_rank, monkeypatch):
    # As Horovod: an error in the log, the job runs unpinned (rank 0 too, though
    # the list names a core for it).
    from hvdlike.core import runtime

    logged = []
    monkeypatch.setattr(runtime.logger, "error", lambda text, *args: logged.append(text % args))
    topo = Topology(rank=local_rank, size=2, local_rank=local_rank, local_size=2)
    allowed = sorted(__import__("os").sched_getaffinity(0))
    assert affinity_core(str(allowed[0]), topo) is None
    assert logged == [
        f"HVDLIKE_THREAD_AFFINITY='{allowed[0]}' names 1 core(s) for 2 local ranks (one per "
        f"local rank is needed): the background thread is not pinned"]


def test_the_launcher_says_once_when_affinity_names_too_few_cores(capsys):
    from hvdlike.launcher.job import Job

    def notes(*argv):
        config = _config(*argv, "python", "x.py")
        config.environ = {"PATH": "/bin"}
        Job(config).note_thread_affinity()
        return [line for line in capsys.readouterr().err.splitlines() if line]

    assert notes("-H", "a:1,b:3", "--thread-affinity", "0,1") == [
        "hvdlike-run: --thread-affinity (HVDLIKE_THREAD_AFFINITY) '0,1' names 2 core(s), but "
        "host b runs 3 ranks: no background thread there is pinned (give one core per "
        "local rank)"]
    assert notes("-H", "a:1,b:3", "--thread-affinity", "0,1,2") == []
    assert notes("-np", "2") == []


def test_mpi_without_threads_keeps_the_engines_on_gloo():
    pytest.importorskip("mpi4py", reason="needs mpi4py (pip install 'hvdlike[mpi]')")
    environ = {"PMI_RANK": "0"}
    assert mpi_plane.choose("auto", "auto", "mpirun (MPICH)", 0, 2, environ,
                            threads_disabled=True) == ("gloo", "gloo")
    with pytest.raises(ConfigError, match="HVDLIKE_MPI_THREADS_DISABLE=1"):
        mpi_plane.choose("mpi", "auto", "mpirun (MPICH)", 0, 2, environ, threads_disabled=True)


def test_torus_allreduce_selects_the_hierarchical_allreduce():
    from hvdlike.core import shm_plane
    from hvdlike.core.topology import Rendezvous

    rdzv = Rendezvous(launcher="x", secret="s")
    topo = Topology(size=2, local_size=2, hostname="h")
    torus = shm_plane.settings(core_config.load({"HOROVOD_TORUS_ALLREDUCE": "1"}), topo, rdzv)
    assert torus.hierarchical_allreduce is True
    off = shm_plane.settings(core_config.load({"HOROVOD_TORUS_ALLREDUCE": "1",
                                               "HVDLIKE_HIERARCHICAL_ALLREDUCE": "0"}),
                             topo, rdzv)
    assert off.hierarchical_allreduce is False
    assert shm_plane.settings(core_config.load({}), topo, rdzv).hierarchical_allreduce is None


def test_help_lists_the_new_flags():
    text = subprocess.run(["hvdlike-run", "--help"], capture_output=True, text=True).stdout
    for flag in ("--thread-affinity", "--config-file", "--disable-cache", "--log-with-timestamp"):
        assert flag in text


def test_a_config_file_sets_flags_and_the_command_line_wins(tmp_path, monkeypatch):
    path = tmp_path / "horovod.yaml"
    path.write_text("controller: mpi\nparams:\n  fusion_threshold_mb: 32\n  cycle_time_ms: 2\n"
                    "autotune:\n  enabled: false\nlogging:\n  hide_timestamp: true\n")
    seen = {}
    monkeypatch.setattr(cli, "execute", lambda config: seen.setdefault("config", config) and 0)
    assert cli.main(["-np", "1", "--gloo", "--config-file", str(path), "--cycle-time-ms", "5",
                     "python", "x.py"]) == 0
    config = seen["config"]
    assert not config.use_mpi  # --gloo on the command line: the file's controller yields
    assert config.knob_env == {"HVDLIKE_FUSION_THRESHOLD": str(32 * 2 ** 20),
                               "HVDLIKE_CYCLE_TIME": "5", "HVDLIKE_AUTOTUNE": "0",
                               "HVDLIKE_LOG_HIDE_TIME": "1"}


def test_a_bad_config_file_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("params:\n  fusion_treshold_mb: 32\n")
    assert cli.main(["-np", "1", "--config-file", str(path), "python", "x.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fusion_treshold_mb" in err and "bad.yaml" in err
    assert cli.main(["-np", "1", "--config-file", "", "python", "x.py"]) == 2
    assert "--config-file is empty" in capsys.readouterr().err


def test_mpi_args_without_mpi_are_reported_as_ignored(capsys):
    _config("-np", "2", "--mpi-args=-v", "python", "x.py")
    assert "--mpi-args applies to --mpi launches only; ignored" in capsys.readouterr().err
    _config("--mpi", "-np", "2", "--mpi-args=-v", "python", "x.py")
    assert "applies to --mpi launches only" not in capsys.readouterr().err
