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


def _report(out, err):
    lines = [line for line in out.splitlines() if line.startswith("REPORT ")]
    assert len(lines) == 1, f"stdout:\n{out}\nstderr:\n{err}"
    return json.loads(lines[0][len("REPORT "):])


# Prints one REPORT line describing what hvdlike.run(<fn>, np=2) gave.
CALLER = """
    import json, os, sys
    import hvdlike
    from hvdlike.launcher.api import RankError

    {body}

    if __name__ == "__main__":
        try:
            report = {{"result": repr(hvdlike.run({fn}, np=2))}}
        except RankError as exc:
            report = {{"error": "RankError", "message": str(exc), "rank": exc.rank,
                      "host": exc.host, "remote_traceback": exc.remote_traceback,
                      "cause": None if exc.__cause__ is None else
                               [type(exc.__cause__).__name__, str(exc.__cause__)]}}
        except BaseException as exc:
            report = {{"error": type(exc).__name__, "message": str(exc)}}
        print("REPORT " + json.dumps(report), flush=True)
"""


def _call(tagged, body, fn):
    folder, env = tagged
    script = folder / "caller.py"
    script.write_text(textwrap.dedent(CALLER).format(body=textwrap.dedent(body).strip(), fn=fn))
    code, out, err = _run_caller(script, folder, env)
    return code, _report(out, err), err


EXCEPTION_WITHOUT_ITS_ARGS = """
    class NeedsTwo(Exception):
        def __init__(self, what, code):
            super().__init__(what)
            self.code = code

    def fails_everywhere():
        raise NeedsTwo("boom on the rank", 2)
"""


def test_an_exception_that_pickles_but_does_not_unpickle_comes_back_as_text(tagged):
    code, report, err = _call(tagged, EXCEPTION_WITHOUT_ITS_ARGS, "fails_everywhere")
    assert code == 0, err
    assert report["error"] == "RankError", report
    assert report["rank"] in (0, 1) and report["host"] == "localhost", report
    assert report["message"].startswith(
        f"rank {report['rank']} (host localhost) raised NeedsTwo: boom on the rank\n"), report
    assert "in fails_everywhere" in report["remote_traceback"], report
    assert "boom on the rank" in report["remote_traceback"], report
    assert report["remote_traceback"].rstrip() in report["message"], report
    assert report["cause"] is None, report  # not rebuilt: no half-made exception


EXCEPTION_ONLY_THE_RANKS_REBUILD = """
    def rebuild(text):
        if "HVDLIKE_RANK" not in os.environ:
            raise RuntimeError("this exception cannot be rebuilt outside a rank")
        return Picky(text)

    class Picky(Exception):
        def __reduce__(self):
            return rebuild, (self.args[0],)

    def fails_everywhere():
        raise Picky("disk full on the rank")
"""


def test_an_exception_the_caller_cannot_rebuild_still_names_the_rank_and_error(tagged):
    code, report, err = _call(tagged, EXCEPTION_ONLY_THE_RANKS_REBUILD, "fails_everywhere")
    assert code == 0, err
    assert report["error"] == "RankError", report
    assert report["message"].startswith(
        f"rank {report['rank']} (host localhost) raised Picky: disk full on the rank\n"), report
    assert "in fails_everywhere" in report["remote_traceback"], report
    assert report["cause"] is None, report


VALUE_THAT_DOES_NOT_UNPICKLE = """
    class Bad:
        def __reduce__(self):
            return int, ("x",)

    def returns_bad():
        return Bad()
"""


def test_a_return_value_that_does_not_unpickle_is_a_rank_error_saying_why(tagged):
    code, report, err = _call(tagged, VALUE_THAT_DOES_NOT_UNPICKLE, "returns_bad")
    assert code == 0, err
    assert report["error"] == "RankError", report
    assert report["rank"] == 0 and report["host"] == "localhost", report
    assert report["message"] == (
        "rank 0 (host localhost) returned a value that could not be unpickled on the "
        "caller's side (ValueError: invalid literal for int() with base 10: 'x')"), report
    assert report["cause"] == ["ValueError", "invalid literal for int() with base 10: 'x'"]


VALUE_THAT_EXITS_WHEN_UNPICKLED = """
    class Quits:
        def __reduce__(self):
            return sys.exit, (5,)

    def returns_quits():
        return Quits()
"""


def test_a_return_value_that_exits_when_unpickled_does_not_end_the_caller(tagged):
    code, report, err = _call(tagged, VALUE_THAT_EXITS_WHEN_UNPICKLED, "returns_quits")
    assert code == 0, err
    assert report["error"] == "RankError", report
    assert report["message"].startswith(
        "rank 0 (host localhost) returned a value that could not be unpickled on the "
        "caller's side (SystemExit: 5)"), report


MODULE = 'def train():\n    return "ok from {where}"\n'
MAIN = """
    import os
    import hvdlike
    import mymod

    def path_of_rank():
        return os.environ["PYTHONPATH"].split(os.pathsep)

    if __name__ == "__main__":
        print("RESULT", hvdlike.run(mymod.train, np=1), flush=True)
        print("PATH", repr(hvdlike.run(path_of_rank, np=1)[0]), flush=True)
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


BAD_HOSTS = """
    import os
    import hvdlike
    from hvdlike.launcher.errors import LaunchError
    from hvdlike.launcher.hosts import HostSlots

    def touch():
        open(os.path.join({folder!r}, "a-rank-ran"), "w").close()
        return 1

    CASES = {{
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
    }}

    if __name__ == "__main__":
        for name, hosts in CASES.items():
            try:
                hvdlike.run(touch, np=2, hosts=hosts)
                print("CASE", name, "| ran", flush=True)
            except LaunchError as exc:
                print("CASE", name, "| LaunchError", str(exc).replace("\\n", " "), flush=True)
            except BaseException as exc:
                print("CASE", name, "|", type(exc).__name__, str(exc).replace("\\n", " "),
                      flush=True)
"""


def test_host_slots_lists_get_the_checks_of_the_string_form(tagged):
    folder, env = tagged
    script = folder / "hosts.py"
    script.write_text(textwrap.dedent(BAD_HOSTS.format(folder=str(folder))))
    code, out, err = _run_caller(script, folder, env)
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    cases = dict(line[len("CASE "):].split(" | ", 1) for line in out.splitlines()
                 if line.startswith("CASE "))
    assert len(cases) == 10, out
    expected = {
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
    for name, text in expected.items():
        assert cases[name].startswith("LaunchError hvdlike.run: "), (name, cases[name])
        assert text in cases[name], (name, cases[name])
    assert not (folder / "a-rank-ran").exists()


GOOD_HOSTS = """
    import hvdlike
    from hvdlike.launcher.hosts import HostSlots

    if __name__ == "__main__":
        print("RESULT", hvdlike.run(lambda: 3, hosts=[HostSlots("localhost", 2)]), flush=True)
"""


def test_a_valid_host_slots_list_still_runs(tagged):
    folder, env = tagged
    script = folder / "good.py"
    script.write_text(textwrap.dedent(GOOD_HOSTS))
    code, out, err = _run_caller(script, folder, env)
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "RESULT [3, 3]" in out.splitlines(), out


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


EXITS_WITH_THREE = """
    def exits_three():
        if os.environ["HVDLIKE_RANK"] == "1":
            os._exit(3)
        return "ok"
"""


def test_a_function_exiting_with_status_three_is_not_taken_for_a_refused_payload(tagged):
    # 3 is also the status of a rank that refuses its payload; only the refusal's
    # own record in the store makes the caller say so.
    code, report, err = _call(tagged, EXITS_WITH_THREE, "exits_three")
    assert code == 0, err
    assert report["error"] == "RankError", report
    assert report["message"] == "rank 1 (host localhost) exited with code 3 without a result", \
        report
