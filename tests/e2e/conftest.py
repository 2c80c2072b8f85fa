"""Helpers for end-to-end tests of the real ``hvdlike-run``.

Every launcher runs in its own session with a hard timeout; every test gets a
``marker`` directory whose path appears on each rank's command line, so the
``no_leftovers`` check can find (and kill) anything a test left running.
"""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def launcher_argv():
    """The installed ``hvdlike-run``, or the module when it is not on PATH."""
    found = shutil.which("hvdlike-run")
    return [found] if found else [sys.executable, "-m", "hvdlike.launcher.cli"]


def launcher_env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.setdefault("HVDLIKE_GLOO_TIMEOUT_SECONDS", "20")
    env.update(extra)
    return env


def start(args, cwd=None, env=None):
    """Start ``hvdlike-run args`` in its own session; stdout/stderr captured."""
    return subprocess.Popen(launcher_argv() + list(args), cwd=cwd or ROOT, env=env or launcher_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(proc, timeout):
    """Wait for a launcher; kill its session and fail the test if it overruns."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"hvdlike-run did not finish within {timeout}s\nstdout:\n{out}\nstderr:\n{err}")
    return proc.returncode, out, err


def run(args, timeout=60, **kwargs):
    """Run ``hvdlike-run args``; return (exit status, stdout, stderr, seconds)."""
    began = time.monotonic()
    code, out, err = finish(start(args, **kwargs), timeout)
    return code, out, err, time.monotonic() - began


def kill_session(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def processes_mentioning(text):
    """Live processes whose command line contains ``text`` (not this one)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.info["pid"] != os.getpid() and any(text in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def wait_until_gone(text, timeout=10.0):
    """Wait for processes mentioning ``text`` to end; return the survivors."""
    deadline = time.monotonic() + timeout
    while True:
        left = processes_mentioning(text)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@pytest.fixture
def marker(tmp_path):
    """A per-test directory; fails the test (and kills them) if processes naming it survive."""
    yield tmp_path
    left = wait_until_gone(str(tmp_path), timeout=10.0)
    for proc in left:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    assert not left, f"processes left behind: {[p.pid for p in left]}"


def write_script(folder, name, body):
    """Write a rank script (dedented) into ``folder`` and return its path."""
    path = os.path.join(str(folder), name)
    with open(path, "w") as handle:
        handle.write(textwrap.dedent(body))
    return path


def wait_ready(marker, ranks, proc, timeout):
    """Wait until every rank wrote ``ready.<rank>`` into ``marker``; fail if the job ends first."""
    deadline = time.monotonic() + timeout
    while not all((marker / f"ready.{r}").exists() for r in range(ranks)):
        assert time.monotonic() < deadline, "ranks did not start"
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)


def wait_for_lines(proc_stdout_path, needle, count, timeout):
    """Poll a file until ``needle`` appears ``count`` times."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(proc_stdout_path) as handle:
                if handle.read().count(needle) >= count:
                    return True
        except FileNotFoundError:
            pass
        time.sleep(0.1)
    return False


@pytest.fixture(scope="session")
def netns_cluster():
    """Two hosts (network namespaces with sshd) for the whole session; torn down after.

    Skips with the reason when the machine cannot build it (not root, no sshd...).
    """
    from tests import netns

    reason = netns.why_unavailable()
    if reason:
        pytest.skip(f"multi-host test skipped: {reason}")
    try:
        cluster = netns.Cluster().setup()
    except Exception as exc:  # e.g. no CAP_NET_ADMIN inside a container
        pytest.skip(f"multi-host test skipped: cannot build network namespaces: {exc}")
    try:
        yield cluster
    finally:
        cluster.teardown()


# A rank script that loops over real collectives until told otherwise; each rank
# writes ready.<rank> (with its pid) beside the script once its first collective succeeded.
TRAINING = """
    import os, time
    import torch
    torch.set_num_threads(1)
    import hvdlike.torch as hvd

    hvd.init()
    here = os.path.dirname(os.path.abspath(__file__))
    step = 0
    while True:
        hvd.allreduce(torch.ones(4), name=f"step{step}")
        if step == 0:  # whole or absent: a reader never sees the file empty
            ready = os.path.join(here, f"ready.{hvd.rank()}")
            with open(ready + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(ready + ".tmp", ready)
        step += 1
        time.sleep(0.05)
"""
