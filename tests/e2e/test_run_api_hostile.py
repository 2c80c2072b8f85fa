"""hvdlike.run with hostile results, import paths and host lists.

Every case runs its caller in a child process of its own session under a hard
timeout; the caller and its ranks carry a per-test tag in their environment, and
the ``tagged`` fixture fails the test (and kills them) if any of them outlives it.
"""

import ast
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid

import psutil
import pytest

from .conftest import ROOT, kill_session, launcher_env

TAG = "HVDLIKE_RUN_API_HOSTILE_TAG"


def _tagged_processes(tag):
    found = []
    for proc in psutil.process_iter(["pid"]):
        if proc.info["pid"] == os.getpid():
            continue
        try:
            if proc.environ().get(TAG) == tag:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            pass
    return found


@pytest.fixture
def tagged(tmp_path):
    """``(folder, environment)`` for one test; no process carrying its tag may survive it."""
    tag = uuid.uuid4().hex
    yield tmp_path, launcher_env(**{TAG: tag})
    deadline = time.monotonic() + 15.0  # grace for ranks still exiting, not a timing check
    left = _tagged_processes(tag)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _tagged_processes(tag)
    for proc in left:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    assert not left, f"processes left behind: {[p.pid for p in left]}"


def _run_caller(path, cwd, env, timeout=180):
    """Run ``python path`` in its own session; (exit status, stdout, stderr)."""
    proc = subprocess.Popen([sys.executable, str(path)], cwd=str(cwd), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"the hvdlike.run caller did not finish within {timeout}s\n"
                    f"stdout:\n{out}\nstderr:\n{err}")
    finally:
        kill_session(proc.pid)
    return proc.returncode, out, err


def _reports(out, err):
    """``{scenario: report}`` from the caller's ``REPORT <scenario> <json>`` lines."""
    reports = {}
    for line in out.splitlines():
        if line.startswith("REPORT "):
            name, _, text = line[len("REPORT "):].partition(" ")
            assert name not in reports, f"two reports for {name}\nstdout:\n{out}\nstderr:\n{err}"
            reports[name] = json.loads(text)
    return reports


# Hostile functions, defined at the top level of the calling script as a user's
# would be; their names differ so that one caller runs them all in turn.
EXCEPTION_WITHOUT_ITS_ARGS = """
    class NeedsTwo(Exception):
        def __init__(self, what, code):
            super().__init__(what)
            self.code = code

    def fails_needing_two():
        raise NeedsTwo("boom on the rank", 2)
"""

EXCEPTION_ONLY_THE_RANKS_REBUILD = """
    def rebuild(text):
        if "HVDLIKE_RANK" not in os.environ:
            raise RuntimeError("this exception cannot be rebuilt outside a rank")
        return Picky(text)

    class Picky(Exception):
        def __reduce__(self):
            return rebuild, (self.args[0],)

    def fails_picky():
        raise Picky("disk full on the rank")
"""

VALUE_THAT_DOES_NOT_UNPICKLE = """
    class Bad:
        def __reduce__(self):
            return int, ("x",)

    def returns_bad():
        return Bad()
"""

VALUE_THAT_EXITS_WHEN_UNPICKLED = """
    class Quits:
        def __reduce__(self):
            return sys.exit, (5,)

    def returns_quits():
        return Quits()
"""

EXITS_WITH_THREE = """
    def exits_three():
        if os.environ["HVDLIKE_RANK"] == "1":
            os._exit(3)
        return "ok"
"""

BAD_HOSTS = """
    def touch():
        open(os.path.join(FOLDER, "a-rank-ran"), "w").close()
        return 1

    BAD_HOST_CASES = {
        "negative slots": [HostSlots("localhost", -5)],
        "slots as text": [HostSlots("localhost", "2")],
        "slots as bool": [HostSlots("localhost", True)],
        "too many slots": [HostSlots("localhost", 10 ** 6)],
        "host twice": [HostSlots("localhost", 1), HostSlots("localhost", 1)],
        "host like an option": [HostSlots("-oProxyCommand=touch", 2)],
        "user like an option": [HostSlots("-x@localhost", 2)],
        "slots in the name": [HostSlots("localhost:2", 2)],
        "host not a str": [HostSlots(None, 2)],
        "newline in the name": [HostSlots("localhost\\n", 2)],
    }
"""

# One caller runs every scenario in turn and prints one REPORT line for each:
# ``REPORT <scenario> <json of what hvdlike.run gave>``. The value whose
# unpickling would end the caller comes last: if it ever did, only its own
# report would be missing.
CALLER = """
    import json, os, sys
    import hvdlike
    from hvdlike.launcher.api import RankError
    from hvdlike.launcher.errors import LaunchError
    from hvdlike.launcher.hosts import HostSlots

    FOLDER = {folder!r}

    {bodies}

    def report(name, fn, **how):
        try:
            outcome = {{"result": repr(hvdlike.run(fn, **how))}}
        except RankError as exc:
            outcome = {{"error": "RankError", "message": str(exc), "rank": exc.rank,
                       "host": exc.host, "remote_traceback": exc.remote_traceback,
                       "cause": None if exc.__cause__ is None else
                                [type(exc.__cause__).__name__, str(exc.__cause__)]}}
        except LaunchError as exc:
            outcome = {{"error": "LaunchError", "message": str(exc)}}
        except BaseException as exc:
            outcome = {{"error": type(exc).__name__, "message": str(exc)}}
        print("REPORT " + name + " " + json.dumps(outcome), flush=True)

    if __name__ == "__main__":
        for case, hosts in BAD_HOST_CASES.items():
            report("hosts:" + case.replace(" ", "_"), touch, np=2, hosts=hosts)
        report("good_hosts", lambda: 3, hosts=[HostSlots("localhost", 2)])
        report("exits_three", exits_three, np=2)
        report("needs_two", fails_needing_two, np=1)
        report("picky", fails_picky, np=1)
        report("bad", returns_bad, np=1)
        report("quits", returns_quits, np=1)
"""

# hvdlike.run calls in CALLER that start ranks: each gets the margin one call had.
CALLER_JOBS = 6


def _check_needs_two(report):
    # An exception that pickles on the rank but does not unpickle comes back as text.
    assert report["error"] == "RankError", report
    assert report["rank"] in (0, 1) and report["host"] == "localhost", report
    assert report["message"].startswith(
        f"rank {report['rank']} (host localhost) raised NeedsTwo: boom on the rank\n"), report
    assert "in fails_needing_two" in report["remote_traceback"], report
    assert "boom on the rank" in report["remote_traceback"], report
    assert report["remote_traceback"].rstrip() in report["message"], report
    assert report["cause"] is None, report  # not rebuilt: no half-made exception


def _check_picky(report):
    # An exception the caller cannot rebuild still names the rank and the error.
    assert report["error"] == "RankError", report
    assert report["message"].startswith(
        f"rank {report['rank']} (host localhost) raised Picky: disk full on the rank\n"), report
    assert "in fails_picky" in report["remote_traceback"], report
    assert report["cause"] is None, report


def _check_bad(report):
    # A return value that does not unpickle is a RankError saying why.
    assert report["error"] == "RankError", report
    assert report["rank"] == 0 and report["host"] == "localhost", report
    assert report["message"] == (
        "rank 0 (host localhost) returned a value that could not be unpickled on the "
        "caller's side (ValueError: invalid literal for int() with base 10: 'x')"), report
    assert report["cause"] == ["ValueError", "invalid literal for int() with base 10: 'x'"], report


def _check_quits(report):
    # A return value that exits when unpickled does not end the caller.
    assert report["error"] == "RankError", report
    assert report["message"].startswith(
        "rank 0 (host localhost) returned a value that could not be unpickled on the "
        "caller's side (SystemExit: 5)"), report


def _check_exits_three(report):
    # 3 is also the status of a rank that refuses its payload; only the refusal's
    # own record in the store makes the caller say so.
    assert report["error"] == "RankError", report
    assert report["message"] == "rank 1 (host localhost) exited with code 3 without a result", \
        report


def _check_good_hosts(report):
    # A valid HostSlots list still runs, one rank per slot.
    assert report == {"result": "[3, 3]"}, report


BAD_HOST_ERRORS = {
    "negative slots": "hosts[0].slots -5 is not valid: expected at least 1",
    "slots as text": "hosts[0].slots must be an int, got '2' (str)",
    "slots as bool": "hosts[0].slots must be an int",
    "too many slots": "hosts[0]: slots 1000000 is more than the limit of 65536",
    "host twice": "hosts names host 'localhost' twice",
    "host like an option": "hosts[0]: host '-oProxyCommand=touch' is not valid",
    "user like an option": "a host or user name cannot start with '-'",
    "slots in the name": "host 'localhost:2' is not valid: a host name has no ':'",
    "host not a str": "hosts[0]: host must be a str, got NoneType",
    "newline in the name": "hosts[0]: host 'localhost\\n' is not valid",
}


def _check_bad_host(case, report):
    # A HostSlots list gets the checks of the string form, before any rank starts.
    assert report["error"] == "LaunchError", (case, report)
    assert report["message"].startswith("hvdlike.run: "), (case, report)
    assert BAD_HOST_ERRORS[case] in report["message"], (case, report)


def test_hostile_results_exit_statuses_and_host_lists_in_one_caller(tagged):
    """Each scenario is checked on its own; the failures of all of them are reported."""
    folder, env = tagged
    script = folder / "caller.py"
    bodies = "\n\n".join(textwrap.dedent(body).strip() for body in (
        EXCEPTION_WITHOUT_ITS_ARGS, EXCEPTION_ONLY_THE_RANKS_REBUILD,
        VALUE_THAT_DOES_NOT_UNPICKLE, VALUE_THAT_EXITS_WHEN_UNPICKLED, EXITS_WITH_THREE,
        BAD_HOSTS))
    script.write_text(textwrap.dedent(CALLER).format(
        folder=str(folder), bodies=bodies))
    code, out, err = _run_caller(script, folder, env, timeout=180 * CALLER_JOBS)
    reports = _reports(out, err)
    checks = {"needs_two": _check_needs_two, "picky": _check_picky, "bad": _check_bad,
              "quits": _check_quits, "exits_three": _check_exits_three,
              "good_hosts": _check_good_hosts}
    checks.update({"hosts:" + case.replace(" ", "_"):
                   (lambda report, case=case: _check_bad_host(case, report))
                   for case in BAD_HOST_ERRORS})
    failures = []
    if code != 0:
        failures.append(f"caller: exited with {code}")
    for name, check in checks.items():
        if name not in reports:
            failures.append(f"{name}: no report")
            continue
        try:
            check(reports[name])
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
    if (folder / "a-rank-ran").exists():
        failures.append("hosts: a rank ran for a refused host list")
    assert not failures, "\n".join(failures) + f"\nstdout:\n{out}\nstderr:\n{err}"


MODULE = """
import os


def train():
    return "ok from {where}"


def train_and_path_of_rank():
    return train(), os.environ["PYTHONPATH"].split(os.pathsep)
"""
MAIN = """
    import hvdlike
    import mymod

    if __name__ == "__main__":
        (result, path), = hvdlike.run(mymod.train_and_path_of_rank, np=1)
        print("RESULT", [result], flush=True)
        print("PATH", repr(path), flush=True)
"""


@pytest.mark.parametrize("pythonpath", ["unset", "unrelated", "with a decoy first"])
def test_a_module_beside_the_calling_script_is_found_with_or_without_pythonpath(
        tagged, pythonpath):
    folder, env = tagged
    proj, elsewhere, other = folder / "proj", folder / "elsewhere", folder / "other"
    for directory in (proj, elsewhere, other):
        directory.mkdir()
    (proj / "mymod.py").write_text(MODULE.format(where="proj"))
    (proj / "main.py").write_text(textwrap.dedent(MAIN))
    if pythonpath == "unset":
        env.pop("PYTHONPATH", None)
    else:
        if pythonpath == "with a decoy first":
            # A module of the same name further down the caller's import path (after
            # the script's directory): the ranks must import the one the caller did.
            (other / "mymod.py").write_text(MODULE.format(where="other"))
        env["PYTHONPATH"] = os.pathsep.join(
            [str(other), ROOT, str(other)] + env.get("PYTHONPATH", "").split(os.pathsep))
    code, out, err = _run_caller(proj / "main.py", elsewhere, env)
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "RESULT ['ok from proj']" in out.splitlines(), out
    path_line = [line for line in out.splitlines() if line.startswith("PATH ")]
    assert len(path_line) == 1, out
    entries = ast.literal_eval(path_line[0][len("PATH "):])
    assert len(entries) == len(set(entries)), entries
    assert entries[0] == os.path.realpath(proj), entries
    if pythonpath != "unset":
        assert os.path.realpath(other) in entries, entries


SIGNALLED = """
    import os, signal, sys, time

    import hvdlike

    def train():
        import time
        import torch
        import hvdlike.torch as hvd
        torch.set_num_threads(1)
        hvd.init()
        hvd.allreduce(torch.ones(1))
        if hvd.rank() == 0:
            print("RANKS UP", flush=True)
        while True:
            hvd.allreduce(torch.ones(1))
            time.sleep(0.05)

    def caller_handler(signum, frame):
        print(f"CALLER HANDLER {{signum}}", flush=True)
        sys.exit(42)

    if __name__ == "__main__":
        if {own_handler}:
            signal.signal(signal.SIGTERM, caller_handler)
        try:
            hvdlike.run(train, np=2)
        except KeyboardInterrupt as exc:
            print(f"KEYBOARDINTERRUPT {{exc}}", flush=True)
            sys.exit(5)
"""


@pytest.mark.parametrize("own_handler", [True, False], ids=["caller_handler", "default"])
def test_sigterm_reaches_the_callers_handler_after_the_ranks_stop(tagged, own_handler):
    """run() used to turn SIGTERM into KeyboardInterrupt, past the caller's own
    handler (a caller catching Ctrl-C then exited 0 on a SIGTERM)."""
    folder, env = tagged
    script = folder / "caller.py"
    script.write_text(textwrap.dedent(SIGNALLED.format(own_handler=own_handler)))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=str(folder), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        seen = ""
        while "RANKS UP" not in seen and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen += line
        assert "RANKS UP" in seen, seen + proc.stderr.read()
        proc.send_signal(15)
        out, err = proc.communicate(timeout=60)
    finally:
        kill_session(proc.pid)
    assert "KEYBOARDINTERRUPT" not in out, out + err
    if own_handler:
        assert "CALLER HANDLER 15" in out and proc.returncode == 42, (proc.returncode, out, err)
    else:
        assert proc.returncode == -15, (proc.returncode, out, err)
    assert "received SIGTERM; stopping 2 rank(s)" in err


