"""What the launcher tells its user: exit descriptions, failure summary, pre-flight table."""

import json

import pytest

from hvdlike.launcher.errors import LaunchError
from hvdlike.launcher.hosts import HostSlots, assign_ranks
from hvdlike.launcher.monitor import (
    Output, Worker, WorkerState, describe_exit, failure_summary, root_cause,
)
from hvdlike.launcher.preflight import HostCheck, interpret, require_all_ok


@pytest.mark.parametrize("code, remote, text", [
    (3, False, "exited with code 3"),
    (137, False, "was killed by signal 9 (SIGKILL)"),
    (-15, False, "was killed by signal 15 (SIGTERM)"),
    (255, True, "lost its ssh connection (ssh exit status 255)"),
    (255, False, "exited with code 255"),
    (127, True, "could not start: command not found (exit code 127)"),
])
def test_describe_exit(code, remote, text):
    assert describe_exit(code, remote) == text


def test_failure_summary_names_rank_host_reason_and_stderr_tail():
    placement = assign_ranks([HostSlots("h1", 1), HostSlots("h2", 1)], 2)[1]
    worker = Worker(placement, ["true"], {}, remote=True, output=Output())
    worker.exit_code = 137
    for line in ["line %d" % i for i in range(20)]:
        worker.stderr_tail.append(line)
    summary = failure_summary(worker).splitlines()
    assert summary[0] == "rank 1 on host h2 was killed by signal 9 (SIGKILL)"
    assert summary[1] == "last line(s) of rank 1 stderr:"
    assert summary[-1] == "    line 19" and len(summary) == 12


def test_failure_summary_keeps_only_the_exception_line_of_a_traceback():
    placement = assign_ranks([HostSlots("h1", 1), HostSlots("h2", 1)], 2)[1]
    worker = Worker(placement, ["true"], {}, remote=False, output=Output())
    worker.exit_code = 1
    for line in ["loading shard", "Traceback (most recent call last):",
                 '  File "train.py", line 8, in <module>', '    raise ValueError("bad")',
                 "ValueError: bad", "[hvdlike rank 1] ERROR: exited"]:
        worker.stderr_tail.append(line)
    summary = failure_summary(worker).splitlines()
    assert summary[2:] == ["    loading shard", "    ValueError: bad",
                           "    [hvdlike rank 1] ERROR: exited"]


def _check(returncode=0, stdout="", stderr="", command="python"):
    return interpret("h1", returncode, stdout, stderr, "/usr/bin/python3", "/work", command)


def test_preflight_interpretation():
    ok = json.dumps({"cwd_ok": True, "command": "/usr/bin/python", "helper": "/x/remote.py"})
    assert _check(stdout="banner\n" + ok) == HostCheck("h1", None, "/x/remote.py")
    assert "ssh failed: ssh: connect to host h1 port 22: Connection refused" == _check(
        255, stderr="ssh: connect to host h1 port 22: Connection refused\n").problem
    assert "hvdlike is not installed for /usr/bin/python3" in _check(
        1, stderr="/usr/bin/python3: No module named hvdlike\n").problem
    assert "/usr/bin/python3 not found" in _check(127, stderr="sh: python3: not found").problem
    missing_dir = json.dumps({"cwd_ok": False, "command": None})
    assert _check(stdout=missing_dir).problem == "working directory /work does not exist"
    no_cmd = json.dumps({"cwd_ok": True, "command": None})
    assert _check(stdout=no_cmd, command="train").problem == "command 'train' not found"


def test_preflight_table_for_several_failed_hosts():
    with pytest.raises(LaunchError) as info:
        require_all_ok([HostCheck("a", "ssh failed: timeout"), HostCheck("bb"),
                        HostCheck("c", "command 'x' not found")])
    lines = str(info.value).splitlines()
    assert lines[0] == "2 of 3 hosts failed the pre-flight check:"
    assert lines[1:] == ["    a   ssh failed: timeout", "    bb  ok", "    c   command 'x' not found"]


def test_preflight_single_failure_is_one_line():
    with pytest.raises(LaunchError, match=r"^host a: ssh failed: x$"):
        require_all_ok([HostCheck("a", "ssh failed: x"), HostCheck("b")])
    require_all_ok([HostCheck("a"), HostCheck("b")])


def _failed(rank, code, at, remote=False):
    placement = assign_ranks([HostSlots("h", 4)], 4)[rank]
    worker = Worker(placement, ["true"], {}, remote=remote, output=Output())
    worker.state, worker.exit_code, worker.failed_at = WorkerState.FAILED, code, at
    return worker


def test_root_cause_prefers_a_rank_that_died_just_after_the_first_failure():
    first = _failed(0, 1, 10.0)  # a peer noticing the dead rank, reported first
    dead = _failed(2, 137, 10.4)
    assert root_cause([first, _failed(1, 1, 10.2), dead], first) is dead


def test_root_cause_keeps_the_first_failure_otherwise():
    first = _failed(0, 1, 10.0)
    late = _failed(2, 137, 15.0)  # outside the window: a separate event
    assert root_cause([first, late], first) is first
    killed = _failed(1, 137, 10.0)
    assert root_cause([killed, _failed(3, 139, 10.1)], killed) is killed
    lost = _failed(3, 255, 10.5, remote=True)
    assert root_cause([first, lost], first) is lost


def test_root_cause_is_the_rank_whose_exit_shut_the_job_down_under_its_peer():
    # Rank 1 exits 7; its way out shuts the job down, rank 0's collective fails at
    # once naming it, and rank 0 happens to be reaped first.
    first = _failed(0, 1, 10.0)
    first.stderr_tail.extend([
        "Traceback (most recent call last):",
        '  File "train.py", line 9, in <module>',
        "hvdlike.core.errors.HvdlikeInternalError: hvdlike was shut down before this "
        "collective completed: rank 1 on localhost (pid 4242) shut down (called shutdown() "
        "or its script ended)"])
    leaver = _failed(1, 7, 10.3)
    assert root_cause([first, leaver], first) is leaver
    # Its exit may take seconds on a busy host (it announced it: not a hang) ...
    assert root_cause([first, _failed(1, 7, 13.0)], first).rank == 1
    # ... but outside that window, or naming a rank that did not fail, the first
    # failure stands.
    assert root_cause([first, _failed(1, 7, 21.0)], first) is first
    assert root_cause([first, _failed(2, 7, 10.3)], first) is first
    # The same for a call made after the shutdown (not one under way).
    late = _failed(0, 1, 10.0)
    late.stderr_tail.append("HvdlikeInternalError: cannot submit 'x': hvdlike has shut down: "
                            "rank 1 on localhost (pid 4242) shut down (called shutdown())")
    assert root_cause([late, leaver], late) is leaver
    # Two ranks each blaming the other: no cause to prefer.
    other = _failed(1, 1, 10.1)
    other.stderr_tail.append("HvdlikeInternalError: hvdlike was shut down before this "
                             "collective completed: rank 0 on localhost (pid 1) shut down")
    assert root_cause([first, other], first) is first
