"""Command-line parsing: flags to LaunchConfig, knob flags from the core's table."""

import os

import pytest

from hvdlike.core import config as core_config
from hvdlike.launcher import cli
from hvdlike.launcher.errors import LaunchError
from hvdlike.launcher.hosts import HostSlots


def _config(*argv):
    return cli.to_config(cli.build_parser().parse_args(list(argv)))


def test_defaults_to_localhost_np_slots():
    config = _config("-np", "3", "python", "train.py", "--lr", "0.1")
    assert config.hosts == [HostSlots("localhost", 3)]
    assert config.np == 3
    assert config.command == ["python", "train.py", "--lr", "0.1"]


def test_command_options_are_not_taken_by_the_launcher():
    config = _config("-np", "2", "python", "train.py", "-np", "9", "--verbose")
    assert config.np == 2 and not config.verbose
    assert config.command == ["python", "train.py", "-np", "9", "--verbose"]


def test_double_dash_separates_the_command():
    assert _config("-np", "1", "--", "python", "x.py").command == ["python", "x.py"]


def test_hosts_ssh_and_interface_flags():
    config = _config("-H", "a:2,b:2", "-p", "2222", "-i", "/k", "--ssh-option", "LogLevel=ERROR",
                     "--network-interface", "eth1", "--verbose", "python", "x.py")
    assert config.hosts == [HostSlots("a", 2), HostSlots("b", 2)]
    assert config.np is None
    assert (config.ssh.port, config.ssh.identity_file, config.ssh.options) == (
        2222, "/k", ["LogLevel=ERROR"])
    assert config.network_interface == "eth1" and config.verbose


def test_hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("h1 slots=2\nh2 slots=1\n")
    assert _config("--hostfile", str(path), "python").hosts == [HostSlots("h1", 2), HostSlots("h2", 1)]


@pytest.mark.parametrize("argv, needle", [
    (["-H", "a", "--hostfile", "f", "python"], "cannot be used together"),
    (["python"], "-np is required"),
    (["--hostfile", "/nonexistent/hosts", "python"], "cannot read hostfile"),
    (["-np", "2", "--ssh-option", "novalue", "python"], "KEY=VALUE"),
    (["-np", "2", "--fusion-threshold-mb", "lots", "python"], "--fusion-threshold-mb"),
    (["-np", "2", "--cycle-time-ms", "-1", "python"], "--cycle-time-ms"),
    # Python's int() and float() take '2_0' (20) and other scripts' digits
    (["-np", "1", "--fusion-threshold-mb", "1_0", "python"], "'1_0' is not valid"),
    # a timeout that rounds to 0 ms
    (["-np", "1", "--start-timeout", "1e-300", "python"], "at least 0.001"),
    # under one byte it would round to 0, i.e. fusion off
    (["-np", "2", "--fusion-threshold-mb", "1e-7", "python"], "'1e-7' is less than one byte"),
    (["-np", "2", "--log-level", "chatty", "python"], "--log-level"),
    (["-np", "2", "--mpi", "--gloo", "python"], "cannot be used together"),
])
def test_bad_values_raise_one_line(argv, needle):
    with pytest.raises(LaunchError, match=needle) as info:
        _config(*argv)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("argv, needle", [
    (["-np", "2_0", "python"], "argument -np/--num-proc: '2_0' is not an integer"),
    (["-np", "\u0662", "python"], "argument -np/--num-proc: '\u0662' is not an integer"),
    (["-np", "1", "--grace-period-seconds", "1_0", "python"],
     "argument --grace-period-seconds: '1_0' is not a number of seconds"),
])
def test_numbers_python_would_read_loosely_are_usage_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_every_knob_with_a_flag_is_a_launcher_flag():
    parser = cli.build_parser()
    flags = {opt for action in parser._actions for opt in action.option_strings}
    for knob in core_config.KNOBS:
        if knob.flag:
            assert knob.flag in flags


def test_knob_flags_become_variables():
    config = _config("-np", "2", "--fusion-threshold-mb", "64", "--cycle-time-ms", "2.5",
                     "--autotune", "--log-level", "info", "--timeline-filename", "/tmp/t.json",
                     "python")
    env = config.knob_env
    assert env["HVDLIKE_FUSION_THRESHOLD"] == str(64 * 1024 * 1024)
    assert env["HVDLIKE_CYCLE_TIME"] == "2.5"
    assert env["HVDLIKE_AUTOTUNE"] == "1"
    assert env["HVDLIKE_LOG_LEVEL"] == "info"
    assert env["HVDLIKE_TIMELINE"] == "/tmp/t.json"
    assert "HVDLIKE_CACHE_CAPACITY" not in env
    assert core_config.load(env).fusion_threshold == 64 * 1024 * 1024


def test_timeline_cap_flag_in_mib_is_checked_by_the_core():
    env = _config("-np", "2", "--timeline-max-mb", "2", "python").knob_env
    assert env["HVDLIKE_TIMELINE_MAX_BYTES"] == str(2 * 1024 * 1024)
    assert core_config.load(env).timeline_max_bytes == 2 * 1024 * 1024
    with pytest.raises(LaunchError, match="--timeline-max-mb .* byte count >= 4096"):
        _config("-np", "2", "--timeline-max-mb", "0.001", "python")


def test_start_timeout_flag_drives_the_launcher_too():
    config = _config("-np", "1", "--start-timeout", "7", "python")
    assert config.start_timeout == 7.0
    assert config.ssh.connect_timeout == 7.0
    assert config.knob_env["HVDLIKE_START_TIMEOUT"] == "7"


def test_bad_knob_in_environment_is_reported_by_name(monkeypatch):
    monkeypatch.setenv("HVDLIKE_CYCLE_TIME", "fast")
    with pytest.raises(LaunchError, match="HVDLIKE_CYCLE_TIME"):
        _config("-np", "1", "python")


@pytest.mark.parametrize("argv,needle", [
    (["--controller", "mpi", "-np", "2", "python"],
     r"HVDLIKE_CONTROLLER=mpi .*\(hvdlike-run --mpi\)"),
    (["--cpu-operations", "MPI", "-np", "2", "python"],
     r"HVDLIKE_CPU_OPERATIONS=mpi .*\(hvdlike-run --mpi\)"),
])
def test_mpi_planes_without_mpirun_are_refused_before_launch(argv, needle):
    with pytest.raises(LaunchError, match=needle):
        _config(*argv)
    assert _config("--mpi", *argv).knob_env  # with --mpi the same flags are accepted


@pytest.mark.parametrize("argv", [["--bogus", "-np", "2", "python"], ["-np", "two", "python"]])
def test_parser_errors_are_one_line_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hvdlike-run: error:" in err


def test_main_reports_launch_errors_in_one_line(capsys):
    assert cli.main(["-np", "0", "python"]) == 2
    err = capsys.readouterr().err
    assert err == "hvdlike-run: error: -np 0 is not valid: expected at least 1 process\n"


def test_help_is_the_manual(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--fusion-threshold-mb" in out and "HVDLIKE_FUSION_THRESHOLD" in out


def test_hierarchical_flags_force_either_way():
    assert "HVDLIKE_HIERARCHICAL_ALLREDUCE" not in _config("-np", "2", "python").knob_env
    env = _config("-np", "2", "--hierarchical-allreduce", "--no-hierarchical-allgather",
                  "python").knob_env
    assert env["HVDLIKE_HIERARCHICAL_ALLREDUCE"] == "1"
    assert env["HVDLIKE_HIERARCHICAL_ALLGATHER"] == "0"
    cfg = core_config.load(env)
    assert (cfg.hierarchical_allreduce, cfg.hierarchical_allgather) == (True, False)


def _main_error(argv, capsys):
    """Run ``hvdlike-run argv`` in-process; return (exit status, stderr)."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["-np", "99999999999999999999", "true"], "is more than the limit of 65536"),
    (["-np", "100000000", "true"], "is more than the limit of 65536"),
    (["-H", "localhost:100000", "true"], "slots '100000' is more than the limit of 65536"),
    (["-H", "localhost:\u00b2", "true"], "slots '\u00b2' must be a positive integer"),
    (["-H", "localhost:\u0663", "true"], "slots '\u0663' must be a positive integer"),
    (["-np", "1", "--min-np", "1", "--max-np", "70000", "true"], "is more than the limit"),
    (["-p", "0", "-np", "1", "true"], "'0' is not a TCP port"),
    (["-p", "-1", "-np", "1", "true"], "'-1' is not a TCP port"),
    (["-p", "65536", "-np", "1", "true"], "'65536' is not a TCP port"),
    (["-np", "1", "--grace-period-seconds", "nan", "true"], "'nan' is not a number of seconds"),
    (["-np", "1", "--grace-period-seconds", "inf", "true"], "'inf' is not a number of seconds"),
    (["-np", "1", "--grace-period-seconds", "1e9", "true"], "must be at most 1e+08"),
    (["--min-np", "1", "--elastic-timeout", "nan", "true"], "'nan' is not a number of seconds"),
    (["--min-np", "1", "--blacklist-cooldown-range", "1", "inf", "true"], "'inf' is not a number"),
    (["-np", "1", "--fusion-threshold-mb", "nan", "true"], "--fusion-threshold-mb 'nan' is not valid"),
    (["-np", "1", "--fusion-threshold-mb", "inf", "true"], "--fusion-threshold-mb 'inf' is not valid"),
    (["-np", "1", "--fusion-threshold-mb", "-0.0000001", "true"], "byte count >= 0"),
    (["-np", "1", "--timeline-max-mb", "inf", "true"], "--timeline-max-mb 'inf' is not valid"),
    (["-np", "1", "--start-timeout", "1e10", "true"], "--start-timeout '1e10' is not valid"),
    (["-np", "1", "--gloo-timeout-seconds", "NaN", "true"], "--gloo-timeout-seconds 'NaN'"),
    (["-np", "1", "--cycle-time-ms", "inf", "true"], "--cycle-time-ms 'inf' is not valid"),
    (["-np", "1", "--mpi-args", '"', "true"], "--mpi-args '\"' is not valid: No closing quotation"),
    (["-np", "1", "--hostfile", "", "true"], "--hostfile is empty"),
    (["-np", "1", "--output-filename", "", "true"], "--output-filename is empty"),
    (["-np", "1", "--network-interface", "", "true"], "--network-interface is empty"),
    (["-np", "1", "-i", "", "true"], "-i/--ssh-identity-file is empty"),
    (["-np", "1", "--remote-python", "", "true"], "--remote-python is empty"),
    (["-np", "1", "--timeline-filename", "", "true"], "--timeline-filename is empty"),
    (["-np", "1", "--autotune-log-file", " ", "true"], "--autotune-log-file is empty"),
    (["-np", "1", ""], "the command is an empty string"),
])
def test_nonsense_values_are_one_line_errors(argv, needle, capsys):
    code, err = _main_error(argv, capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("hvdlike-run: error: "), err
    assert needle in err


@pytest.mark.parametrize("line, needle", [
    ("localhost slots=2 slots=3", "gives slots twice"),
    ("localhost:2 slots=3", "gives slots twice"),
    ("localhost slots=2 max_slots=4 max-slots=4", "gives max_slots twice"),
    ("localhost max_slots=", "slots '' must be a positive integer"),
    ("localhost max_slots=lots", "slots 'lots' must be a positive integer"),
])
def test_hostfile_lines_that_contradict_themselves_are_refused(tmp_path, line, needle):
    path = tmp_path / "hosts"
    path.write_text(line + "\n")
    with pytest.raises(LaunchError, match=needle):
        _config("--hostfile", str(path), "python")
    path.write_text("localhost slots=2 max_slots=4\n")
    assert _config("--hostfile", str(path), "python").hosts == [HostSlots("localhost", 2)]


def test_largest_counts_and_durations_are_still_accepted():
    config = _config("-np", "65536", "-p", "65535", "--grace-period-seconds", "1e8",
                     "--start-timeout", "1e8", "--cycle-time-ms", "60000", "python")
    assert config.np == 65536 and config.ssh.port == 65535 and config.grace_seconds == 1e8
    assert core_config.load(config.knob_env).start_timeout == 1e8


def test_a_closed_output_stream_is_reported_once_and_never_raises():
    import io

    from hvdlike.launcher.monitor import Output

    class Gone(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    err = io.StringIO()
    output = Output(stdout=Gone(), stderr=err)
    closed = []
    output.on_closed = closed.append
    for n in range(3):
        output.line(0, "stdout", f"line {n}")  # must not raise
    output.line(1, "stderr", "still here")
    output.note("a note")
    assert closed == ["stdout"]
    assert err.getvalue() == "[1]<stderr>:still here\nhvdlike-run: a note\n"


def test_summary_drops_a_traceback_whose_first_line_scrolled_out():
    from hvdlike.launcher.monitor import without_traceback_frames

    tail = ['  File "/x/train.py", line 3, in <module>', "    hvd.init()",
            '  File "/x/api.py", line 9, in init', "    start()", "           ^^^^^^^",
            "ValueError: cannot write 't.json'"]
    assert without_traceback_frames(tail) == ["ValueError: cannot write 't.json'"]
    plain = ["    indented output of the script", "RuntimeError: boom"]
    assert without_traceback_frames(plain) == plain


def _job(tmp_path, *argv):
    from hvdlike.launcher.job import Job

    config = _config(*argv)
    config.cwd = str(tmp_path)
    return Job(config)


def test_output_files_that_cannot_be_written_are_refused_before_any_rank_starts(tmp_path):
    (tmp_path / "logs" / "rank.1" / "stderr").mkdir(parents=True)
    job = _job(tmp_path, "-np", "2", "--output-filename", str(tmp_path / "logs"), "true")
    with pytest.raises(LaunchError, match=r"--output-filename .*Is a directory .*rank\.1/stderr"):
        job.check()


@pytest.mark.parametrize("argv, needle", [
    (["--timeline-filename", "missing/t.json"], "directory .*missing does not exist"),
    (["--timeline-filename", "."], "is a directory"),
    (["--timeline-filename", "t{rank}/x.json"], r"t1/x\.json: directory .*t1 does not exist"),
    (["--autotune", "--autotune-log-file", "missing/a.csv"], "--autotune-log-file .*does not exist"),
])
def test_rank_files_on_this_machine_are_checked_before_any_rank_starts(tmp_path, argv, needle):
    (tmp_path / "t0").mkdir()
    job = _job(tmp_path, "-np", "2", *argv, "true")
    with pytest.raises(LaunchError, match=needle):
        job.check()
    _job(tmp_path, "-np", "2", "--timeline-filename", "t{rank}.json", "true").check()


def test_output_folders_are_zero_padded_like_horovodruns_so_they_sort(tmp_path):
    from hvdlike.launcher.monitor import rank_folder

    assert [rank_folder(r, 11) for r in (0, 1, 10)] == ["rank.00", "rank.01", "rank.10"]
    assert [rank_folder(r, 10) for r in (0, 9)] == ["rank.0", "rank.9"]
    assert rank_folder(0, 1) == "rank.0" and rank_folder(100, 101) == "rank.100"
    # the check before any rank starts makes the folders the ranks will write
    logs = tmp_path / "logs"
    _job(tmp_path, "-np", "11", "--output-filename", str(logs), "true").check()
    names = sorted(p.name for p in logs.iterdir())
    assert names == [f"rank.{r:02d}" for r in range(11)]
    assert all(sorted(p.name for p in (logs / n).iterdir()) == ["stderr", "stdout"]
               for n in names)


def test_worker_output_files_take_the_padded_folder(tmp_path):
    from hvdlike.launcher.hosts import assign_ranks
    from hvdlike.launcher.monitor import Output, Worker

    placement = assign_ranks([HostSlots("localhost", 11)], 11)[3]
    worker = Worker(placement, ["true"], {}, remote=False, output=Output(),
                    log_dir=str(tmp_path))
    read, write = os.pipe()
    os.write(write, b"hello\n")
    os.close(write)
    with open(read, "rb", buffering=0) as source:
        worker._proc = type("P", (), {"stdout": source})()
        worker._pump("stdout")
    assert (tmp_path / "rank.03" / "stdout").read_bytes() == b"hello\n"


@pytest.mark.parametrize("argv, needle", [
    (["-np", "1", "hvdlike-no-such-command"], "command not found: hvdlike-no-such-command"),
    (["-np", "1", "--network-interface", "hvdlike-nosuch0", "true"],
     "--network-interface 'hvdlike-nosuch0' does not exist here"),
    (["-np", "1", "--network-interface", "lo,hvdlike-nosuch0", "true"],
     "--network-interface 'hvdlike-nosuch0' does not exist here"),
    (["--mpi", "-np", "1", "hvdlike-no-such-command"],
     "command not found: hvdlike-no-such-command"),
    (["-np", "1", "--min-np", "1", "-H", "localhost:1", "hvdlike-no-such-command"],
     "command not found: hvdlike-no-such-command"),  # elastic
])
def test_a_dry_run_refuses_what_a_real_run_refuses_before_starting(argv, needle, capsys):
    assert cli.main(["--dry-run", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hvdlike-run: error: ") and needle in err and err.count("\n") == 1, err


def test_a_dry_run_of_a_good_job_prints_it(capsys):
    assert cli.main(["--dry-run", "-np", "2", "--network-interface", "lo", "true"]) == 0
    out = capsys.readouterr().out
    assert "rank 1 on localhost" in out and "HVDLIKE_GLOO_IFACE=lo" in out


@pytest.mark.parametrize("launch", [[], ["--mpi"], ["--min-np", "1", "-H", "localhost:2"]],
                         ids=["gloo", "mpi", "elastic"])
def test_a_dry_run_checks_the_output_folder_without_making_it(launch, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "out" / "rank.1").mkdir(parents=True)
    os.symlink("/etc/passwd", tmp_path / "out" / "rank.1" / "stderr")
    for given, needle in [(tmp_path / "file" / "logs", "Not a directory"),
                          (tmp_path / "out", "is a symbolic link; refusing to follow it")]:
        argv = ["--dry-run", *launch, "-np", "2", "--output-filename", str(given), "true"]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"hvdlike-run: error: --output-filename {given}: ") and needle in err
    fresh = tmp_path / "new" / "logs"
    assert cli.main(["--dry-run", *launch, "-np", "2", "--output-filename", str(fresh),
                     "true"]) == 0
    assert not (tmp_path / "new").exists()  # a dry run creates nothing


def test_a_discovery_script_that_is_a_directory_is_named_as_one(tmp_path):
    with pytest.raises(LaunchError, match=r"^--host-discovery-script .*: is a directory, not an "
                                          r"executable script$"):
        _config("-np", "1", "--host-discovery-script", str(tmp_path), "true")
