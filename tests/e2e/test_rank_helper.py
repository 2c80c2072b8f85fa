"""The per-rank helper (launcher/remote.py) on its own: exit codes, stop on stdin EOF, no orphans."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil

from hvdlike.launcher.local_exec import helper_command


def _start(argv, cwd=None, grace=1.0, env=None):
    proc = subprocess.Popen(helper_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    spec = {"argv": argv, "cwd": cwd or os.getcwd(), "env": env or dict(os.environ), "grace": grace}
    proc.stdin.write(json.dumps(spec).encode() + b"\n")
    proc.stdin.flush()
    return proc


def _finish(proc, timeout=30):
    """Wait with stdin left open (closing it means "stop"); outputs are tiny."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if not stream.closed:
            stream.close()
    return proc.returncode, out, err


def test_exit_code_and_output_pass_through():
    code, out, err = _finish(_start(["sh", "-c", "echo out; echo err >&2; exit 7"]))
    assert (code, out, err) == (7, "out\n", "err\n")


def test_environment_and_directory_come_from_the_spec(tmp_path):
    code, out, _ = _finish(_start(["sh", "-c", 'echo "$ONLY_HERE $(pwd)"'], cwd=str(tmp_path),
                                  env={"ONLY_HERE": "yes", "PATH": os.environ["PATH"]}))
    assert (code, out) == (0, f"yes {tmp_path}\n")


def test_missing_command_and_directory():
    code, _, err = _finish(_start(["no-such-program-xyz"]))
    assert code == 127 and "command not found: no-such-program-xyz" in err
    code, _, err = _finish(_start(["true"], cwd="/no/such/dir"))
    assert code == 126 and "/no/such/dir does not exist" in err


def test_signal_death_is_reported_as_128_plus_signal():
    code, _, _ = _finish(_start(["sh", "-c", "kill -9 $$"]))
    assert code == 128 + 9


def test_closing_stdin_stops_the_rank_and_everything_it_started(tmp_path):
    pidfile = tmp_path / "pids"
    # The rank ignores SIGTERM and leaves a grandchild: both must be gone.
    script = (f"import os, signal, subprocess, sys, time\n"
              f"signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
              f"open({str(pidfile)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
              f"time.sleep(120)\n")
    proc = _start([sys.executable, "-c", script], grace=0.5)
    deadline = time.monotonic() + 30
    while not pidfile.exists() or len(pidfile.read_text().split()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pids = [int(p) for p in pidfile.read_text().split()]
    proc.stdin.close()
    code, _, _ = _finish(proc)
    assert code == 128 + signal.SIGKILL
    time.sleep(0.2)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def test_probe_reports_helper_path_and_command(tmp_path):
    proc = subprocess.Popen(helper_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    probe = {"probe": {"cwd": str(tmp_path), "command": "sh", "path": os.environ["PATH"]}}
    out, _ = proc.communicate(json.dumps(probe).encode() + b"\n", timeout=30)
    answer = json.loads(out)
    assert answer["cwd_ok"] and answer["command"].endswith("/sh")
    assert answer["helper"].endswith("remote.py")
