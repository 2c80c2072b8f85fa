"""hvdlike-run's output: long lines, progress bars, launcher streams that cannot be written."""

import os
import selectors
import subprocess
import sys
import time

import pytest

from .conftest import ROOT, finish, kill_session, launcher_argv, launcher_env, write_script

BIG = 10 * 1024 * 1024  # one line, no line end


def _read_until(proc, seen, found, timeout):
    """Read the launcher's stdout and stderr into ``seen`` until ``found(seen)`` or both end."""
    selector = selectors.DefaultSelector()
    for name in ("stdout", "stderr"):
        stream = getattr(proc, name)
        if not stream.closed:
            selector.register(stream.fileno(), selectors.EVENT_READ, name)
    deadline = time.monotonic() + timeout
    try:
        while selector.get_map() and not found(seen):
            if time.monotonic() > deadline:
                kill_session(proc.pid)
                proc.wait()
                pytest.fail(f"gave up after {timeout}s; stderr so far:\n{seen['stderr'][-2000:]!r}")
            for key, _ in selector.select(timeout=0.5):
                data = os.read(key.fd, 1 << 16)
                if data:
                    seen[key.data] += data
                else:
                    selector.unregister(key.fd)
    finally:
        selector.close()


def _run_watching(args, env, go_on, until, check_seen=lambda proc, seen: None):
    """Run ``hvdlike-run args`` and read its output until ``until(seen)``, while the
    rank still runs (it waits for ``go_on``); ``check_seen(proc, seen)`` then, before
    ``go_on`` is made and the rest is read. Returns (exit status, seen bytes)."""
    proc = subprocess.Popen(launcher_argv() + args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        seen = {"stdout": b"", "stderr": b""}
        _read_until(proc, seen, until, timeout=120)
        check_seen(proc, seen)
        go_on.touch()
        _read_until(proc, seen, lambda s: False, timeout=120)
        code = proc.wait(timeout=60)
    finally:
        kill_session(proc.pid)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    return code, seen


def test_a_long_line_and_a_progress_bar_are_forwarded_while_the_rank_runs(marker):
    go_on = marker / "go-on"
    script = write_script(marker, "progress.py", f"""
        import os, sys, time
        sys.stdout.write("x" * {BIG})
        sys.stdout.flush()
        sys.stderr.write("\\rstep 1")  # a progress bar's first update: no line end
        sys.stderr.flush()
        waited = time.monotonic()
        while not os.path.exists({str(go_on)!r}):  # created once the test saw "step 1"
            if time.monotonic() - waited > 120:
                sys.exit(3)
            time.sleep(0.05)
        sys.stderr.write("\\rstep 2\\n")
        print("\\nafter")
    """)
    logs = marker / "logs"

    def seen_first(proc, seen):
        assert proc.poll() is None  # the rank is still waiting: shown while it runs
        assert seen["stderr"].endswith(b"[0]<stderr>:step 1"), seen["stderr"][-200:]

    code, seen = _run_watching(["-np", "1", "--output-filename", str(logs), sys.executable,
                                script], launcher_env(), go_on,
                               lambda s: b"step 1" in s["stderr"], seen_first)
    out, err = seen["stdout"].decode(), seen["stderr"].decode()
    assert code == 0, err
    assert out.count("x") == BIG
    assert out == "[0]<stdout>:" + "x" * BIG + "\n[0]<stdout>:after\n"
    assert "[0]<stderr>:step 1\r[0]<stderr>:step 2\n" in err and "Traceback" not in err
    assert (logs / "rank.0" / "stdout").read_bytes() == b"x" * BIG + b"\nafter\n"
    assert (logs / "rank.0" / "stderr").read_bytes() == b"\rstep 1\rstep 2\n"


TALK = """
    import sys
    for n in range(3):
        print("out", n, flush=True)
        print("err", n, file=sys.stderr, flush=True)
"""


def _run_with_stderr(marker, stderr_how, timeout=60):
    """Run a one-rank job whose launcher's stderr is set up by ``stderr_how`` (a shell redirection)."""
    script = write_script(marker, "talk.py", TALK)
    logs = marker / "logs"
    argv = launcher_argv() + ["-np", "1", "--output-filename", str(logs), sys.executable, script]
    proc = subprocess.Popen(["sh", "-c", f'exec "$@" {stderr_how}', "sh"] + argv, cwd=ROOT,
                            env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    proc.stderr = None  # replaced by the redirection; finish() reads stdout only
    code, out, _ = finish(proc, timeout)
    return code, out, logs


@pytest.mark.parametrize("stderr_how, reason", [
    ("2>/dev/full", "No space left on device"),
    ("2>&-", None),  # closed at start: Python may see it as absent or as a bad descriptor
])
def test_a_launcher_stderr_that_cannot_be_written_does_not_stop_the_job(marker, stderr_how, reason):
    code, out, logs = _run_with_stderr(marker, stderr_how)
    assert code == 0, out
    notes = [line for line in out.splitlines() if line.startswith("hvdlike-run:")]
    assert len(notes) == 1, out
    assert notes[0].startswith("hvdlike-run: cannot write to stderr (")
    assert notes[0].endswith("); its lines are dropped from now on")
    if reason:
        assert f"({reason})" in notes[0]
    assert [line for line in out.splitlines() if line.startswith("[0]")] == [
        "[0]<stdout>:out 0", "[0]<stdout>:out 1", "[0]<stdout>:out 2"]
    assert (logs / "rank.0" / "stderr").read_text() == "err 0\nerr 1\nerr 2\n"


@pytest.mark.parametrize("own", [None, "0"], ids=["unset", "users_own"])
def test_print_without_flush_is_forwarded_while_the_rank_runs(marker, own):
    # horovodrun sets PYTHONUNBUFFERED=1 for every rank; a value of the user's stays.
    go_on = marker / "go-on"
    script = write_script(marker, "unflushed.py", f"""
        import os, sys, time
        print("unbuffered=" + repr(os.environ.get("PYTHONUNBUFFERED")))  # no flush
        waited = time.monotonic()
        while not os.path.exists({str(go_on)!r}):  # created once the test saw the line
            if time.monotonic() - waited > {20 if own is None else 2}:  # buffered: at exit
                print("the line was not forwarded while the rank ran")
                sys.exit(3)
            time.sleep(0.05)
    """)
    env = launcher_env()
    env.pop("PYTHONUNBUFFERED", None)
    if own is not None:
        env["PYTHONUNBUFFERED"] = own
    code, seen = _run_watching(["-np", "1", sys.executable, script], env, go_on,
                               lambda s: b"unbuffered=" in s["stdout"])
    out = seen["stdout"].decode()
    if own is None:
        assert out == "[0]<stdout>:unbuffered='1'\n", out
        assert code == 0, seen["stderr"].decode()
    else:  # the user asked for buffered output: it comes at the rank's exit
        assert out.startswith("[0]<stdout>:unbuffered='0'\n"), out
