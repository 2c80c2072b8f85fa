"""Every bad input ends quickly with a one-line reason, a non-zero exit, no traceback.

The issue's list runs through the real ``hvdlike-run`` process; more cases run
in-process through ``cli.main`` (same code path after the interpreter starts).
"""

import os
import subprocess
import sys

import pytest

from hvdlike.launcher import cli

from .conftest import (
    ROOT, finish, launcher_argv, launcher_env, processes_mentioning, run, write_script,
)

REASONS = [
    (["-H", "a:x", "python"], "-H/--hosts entry 'a:x': slots 'x' must be a positive integer"),
    (["-np", "0", "python"], "-np 0 is not valid: expected at least 1 process"),
    (["-np", "3", "-H", "localhost:2", "python"], "-np 3 is more than the 2 slot(s) available"),
    (["--no-such-flag", "-np", "1", "python"], "unrecognized arguments: --no-such-flag"),
    (["-np", "1", "no-such-command-xyz"], "command not found: no-such-command-xyz"),
    (["-H", "no-such-host.invalid:1", "--start-timeout", "5", "true"], "host no-such-host.invalid"),
]

MORE_REASONS = [
    (["-H", "a,,b", "python"], "-H/--hosts entry '' is not valid"),
    (["-np", "two", "python"], "argument -np/--num-proc: 'two' is not an integer"),
    (["-np", "1", "./missing.py"], "command not found: ./missing.py"),
    (["-np", "1", "/tmp"], "the command /tmp is a directory"),
    (["-np", "1", "-H", "10.0.0.99:1", "-i", "/nonexistent/key", "python"],
     "-i/--ssh-identity-file /nonexistent/key: no such file"),
    (["-np", "1"], "no command given"),
    (["-np", "1", "--cycle-time-ms", "soon", "python"], "--cycle-time-ms 'soon' is not valid"),
    (["-np", "1", "--network-interface", "nosuchif0", "true"],
     "--network-interface 'nosuchif0' does not exist"),
    (["--hostfile", "/nonexistent/hostfile", "python"], "cannot read hostfile"),
    (["--mpi", "-np", "1", "no-such-command-xyz"], "command not found: no-such-command-xyz"),
    (["-np", "2", "--timeline-filename", "/nonexistent/dir/t.json", "python"],
     "--timeline-filename (HVDLIKE_TIMELINE) /nonexistent/dir/t.json: directory /nonexistent/dir "
     "does not exist"),
    (["-np", "1", "--timeline-filename", "/proc/t.json", "python"],
     "--timeline-filename (HVDLIKE_TIMELINE) /proc/t.json: "),  # cannot be created
    (["-np", "1", "--hostfile", "/dev/zero", "python"],
     "cannot read hostfile '/dev/zero': is a character device, not a regular file"),
    (["-np", "1", "-H", "a..b:1", "python"], "host name 'a..b' has an empty part between dots"),
    (["-np", "2", "--max-np", "1", "python"], "-np 2 is more than --max-np 1"),
    (["-np", "1", "-H", "localhost:\u00b2", "python"], "slots '\u00b2' must be a positive integer"),
    (["-np", "99999999999999999999", "python"], "is more than the limit of 65536"),
    (["-np", "1", "--start-timeout", "1e300", "python"], "--start-timeout '1e300' is not valid"),
    (["-np", "1", "--fusion-threshold-mb", "inf", "python"], "--fusion-threshold-mb 'inf'"),
    (["-np", "1", "--mpi-args", "'", "python"], "No closing quotation"),
    (["-np", "1", "--ssh-option", "=yes", "python"], "--ssh-option '=yes' is not valid"),
    (["-np", "1", "--ssh-option", "Batch Mode=yes", "python"], "is not valid: expected KEY=VALUE"),
]


def test_an_autotune_log_without_autotune_is_said_to_be_ignored(capsys, tmp_path):
    assert cli.main(["-np", "1", "--autotune-log-file", str(tmp_path / "a.csv"),
                     sys.executable, "-c", "pass"]) == 0
    assert "--autotune-log-file (HVDLIKE_AUTOTUNE_LOG) is ignored without --autotune" in \
        capsys.readouterr().err


def test_a_variable_horovod_named_is_named_in_the_error(capsys, monkeypatch):
    monkeypatch.setenv("HOROVOD_TIMELINE", "/nonexistent/dir/t.json")
    assert cli.main(["-np", "1", "python"]) == 2
    assert "--timeline-filename (HOROVOD_TIMELINE) /nonexistent/dir/t.json" in \
        capsys.readouterr().err


@pytest.mark.parametrize("args, reason", MORE_REASONS)
def test_bad_input_in_process(args, reason, capsys):
    try:
        code = cli.main(args)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("hvdlike-run: error: ") and reason in err


@pytest.mark.parametrize("args, reason", REASONS)
def test_bad_input(args, reason, marker):
    code, out, err, _ = run(args, timeout=60)  # a hang fails the test
    assert code != 0
    assert "Traceback" not in err + out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("hvdlike-run: error: ")
    assert reason in lines[0]


def test_malformed_hostfile_line_is_named(marker):
    hostfile = marker / "hosts"
    hostfile.write_text("# two hosts\nlocalhost slots=1\nlocalhost2 slots=many\n")
    code, out, err, _ = run(["--hostfile", str(hostfile), "true"])
    assert code != 0
    assert err.strip().splitlines() == [
        f"hvdlike-run: error: hostfile '{hostfile}' line 3 ('localhost2 slots=many'): "
        "slots 'many' must be a positive integer"]


def test_closing_the_launchers_stdout_stops_every_rank(marker):
    """``hvdlike-run ... | head -3``: the job stops as a pipeline would (status 141), no hang."""
    script = write_script(marker, "talk.py", """
        import itertools, time
        for n in itertools.count():
            print("line", n, flush=True)
            time.sleep(0.01)
    """)
    proc = subprocess.Popen(launcher_argv() + ["-np", "2", sys.executable, script], cwd=ROOT,
                            env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    for _ in range(3):
        if not proc.stdout.readline():  # the launcher ended first: say why
            proc.stdout = None
            code, _, err = finish(proc, timeout=60)
            pytest.fail(f"the launcher's output ended before 3 lines (exit {code}): "
                        f"{err.decode()}")
    proc.stdout.close()
    proc.stdout = None  # finish() now reads stderr only
    code, _, err = finish(proc, timeout=60)
    err = err.decode()
    assert code == 141, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "hvdlike-run: job interrupted (the launcher's stdout was closed); every rank was stopped")


def test_a_process_that_left_the_ranks_session_ends_with_the_rank(marker):
    script = write_script(marker, "detach.py", """
        import os, subprocess, sys
        here = os.path.dirname(os.path.abspath(__file__))
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)",
                          os.path.join(here, "detached")],
                         start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print("rank done", flush=True)
    """)
    code, out, err, _ = run(["-np", "1", sys.executable, script], timeout=60)
    assert code == 0, err
    assert "[0]<stdout>:rank done" in out
    assert processes_mentioning(str(marker / "detached")) == []


def test_output_file_that_stops_accepting_writes_loses_no_forwarded_output(marker):
    import resource

    script = write_script(marker, "chatty.py", """
        for n in range(300):
            print("x" * 1000, flush=True)
        print("the end", flush=True)
    """)

    def small_files():  # the launcher's files stop growing at 100 kB: writes fail (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    proc = subprocess.Popen(
        launcher_argv() + ["-np", "1", "--output-filename", str(marker / "logs"),
                           sys.executable, script],
        cwd=ROOT, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True, preexec_fn=small_files)
    code, out, err = finish(proc, timeout=60)
    assert code == 0, err
    assert out.count("[0]<stdout>:" + "x" * 1000) == 300 and "[0]<stdout>:the end" in out
    assert "Traceback" not in err
    assert f"cannot write {marker}/logs/rank.0/stdout: File too large" in err


def test_a_script_whose_interpreter_is_missing_is_named_not_called_missing(marker):
    script = marker / "job"
    script.write_text("#!/nonexistent/bin/interp -u\nprint('never')\n")
    script.chmod(0o755)
    code, out, err, _ = run(["-np", "1", str(script)])
    assert code == 2
    assert err.strip().splitlines() == [
        f"hvdlike-run: error: cannot run {script}: its interpreter /nonexistent/bin/interp "
        "(the '#!' line) does not exist"]


def test_a_script_with_windows_line_endings_is_named_so(marker):
    # The kernel takes the carriage return as part of the interpreter's name: the
    # check used to strip it, pass, and leave every rank failing "command not found".
    script = marker / "job.py"
    script.write_bytes(f"#!{sys.executable}\r\nprint('never')\r\n".encode())
    script.chmod(0o755)
    code, out, err, _ = run(["-np", "2", str(script)])
    assert code == 2, err
    assert err.strip().splitlines() == [
        f"hvdlike-run: error: cannot run {script}: its interpreter {sys.executable}\\r "
        "(the '#!' line) does not exist; the file has Windows line endings (convert it, e.g. "
        "with dos2unix)"]


def test_the_rank_helper_names_a_missing_interpreter_too(tmp_path):
    # On a remote host the helper starts the command; the launcher's early check ran
    # on another machine, where the interpreter may have existed. (In a process of its
    # own: the helper installs signal handlers and adopts orphans.)
    script = tmp_path / "job"
    script.write_text("#!/nonexistent/bin/interp\n")
    script.chmod(0o755)
    code = ("import os, sys; from hvdlike.launcher import remote; "
            f"sys.exit(remote.run({{'argv': [{str(script)!r}], 'env': dict(os.environ), "
            f"'cwd': {str(tmp_path)!r}, 'grace': 1}}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 126, done.stderr
    assert (f"cannot run {script}: its interpreter /nonexistent/bin/interp (the '#!' line) "
            "does not exist on this host") in done.stderr


def test_output_files_planted_in_a_shared_folder_are_refused_by_name(marker):
    # A FIFO blocked the launcher before any rank started; a symbolic link made it
    # overwrite the file it points to.
    (marker / "hi.py").write_text("print('hi')\n")
    fifo_dir = marker / "fifo" / "rank.0"
    fifo_dir.mkdir(parents=True)
    os.mkfifo(fifo_dir / "stdout")
    code, out, err, _ = run(["-np", "2", "--output-filename", str(marker / "fifo"), "python",
                             str(marker / "hi.py")], timeout=60)
    assert code == 2, err
    assert f"is a FIFO, not a regular file ({fifo_dir / 'stdout'})" in err
    victim = marker / "victim.txt"
    victim.write_text("precious\n")
    link_dir = marker / "link" / "rank.0"
    link_dir.mkdir(parents=True)
    (link_dir / "stderr").symlink_to(victim)
    code, out, err, _ = run(["-np", "1", "--output-filename", str(marker / "link"), "python",
                             str(marker / "hi.py")], timeout=60)
    assert code == 2, err
    assert "is a symbolic link; refusing to follow it" in err
    assert victim.read_text() == "precious\n"
    os.mkfifo(marker / "timeline.fifo")
    code, out, err, _ = run(["-np", "2", "--timeline-filename", str(marker / "timeline.fifo"),
                             "python", str(marker / "hi.py")], timeout=60)
    assert code == 2, err
    assert "timeline.fifo: is a FIFO, socket or block device, not a file" in err
    (marker / "timeline.json").symlink_to(victim)
    code, out, err, _ = run(["-np", "2", "--timeline-filename", str(marker / "timeline.json"),
                             "python", str(marker / "hi.py")], timeout=60)
    assert code == 2, err
    assert "timeline.json: is a symbolic link; refusing to follow it" in err
    assert victim.read_text() == "precious\n"


def test_a_job_refused_by_a_later_check_leaves_no_output_folders(marker):
    (marker / "hi.py").write_text("print('hi')\n")
    code, out, err, _ = run(["-np", "2", "--output-filename", str(marker / "out"),
                             "--timeline-filename", "/nonexistent/t.json", "python",
                             str(marker / "hi.py")], timeout=60)
    assert code == 2, err
    assert "directory /nonexistent does not exist" in err
    assert not (marker / "out").exists()
