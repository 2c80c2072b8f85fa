"""Elastic jobs whose store keys a local user without the job secret deletes or replays.

The attacker (tests/security/elastic_attacker.py, uid ``nobody`` when run as
root) knows only the store's address: it cannot sign a record, but TCPStore
lets it delete any key and write back a value it read earlier under the same
key. Neither may make a job end "successfully" having trained nothing, or wait
in silence: the job fails naming the record, or carries on correctly and the
launcher says what it repaired.
"""

import base64
import json
import os
import re
import subprocess
import sys
import time

import psutil
import pytest

from .conftest import ROOT, finish, kill_session, launcher_env, start

TRAIN = os.path.join(ROOT, "tests", "e2e", "elastic_train.py")


def _env(**extra):
    return launcher_env(HVDLIKE_GLOO_TIMEOUT_SECONDS="10", ELASTIC_EPOCHS="1", **extra)


def _store_of(launcher, timeout=30):
    """The address the launcher's store listens on (its only listening socket)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            for conn in psutil.Process(launcher.pid).net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    return conn.laddr.ip, conn.laddr.port
        except psutil.NoSuchProcess:
            break
        time.sleep(0.01)
    pytest.fail(f"hvdlike-run never listened: {launcher.communicate()}")


def _attack(launcher, folder, **spec):
    """Start the attacker against ``launcher``'s store; returns its Popen."""
    host, port = _store_of(launcher)
    path = os.path.join(str(folder), "attack.json")
    with open(path, "w") as f:
        json.dump({"host": host, "port": port, **spec}, f)
    return subprocess.Popen([sys.executable, "-m", "tests.security.elastic_attacker", path],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _report(attacker):
    try:
        out, err = attacker.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        kill_session(attacker.pid)
        out, err = attacker.communicate()
        pytest.fail(f"the attacker did not finish: {err}")
    assert attacker.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _job(marker, argv, env, seconds, **spec):
    """Run ``hvdlike-run argv`` under attack; (exit code, stdout, stderr, report)."""
    proc = start(argv, env=env)
    attacker = None
    try:
        attacker = _attack(proc, marker, seconds=seconds, **spec)
        code, out, err = finish(proc, timeout=60)
        report = _report(attacker)
    finally:
        kill_session(proc.pid)
        if attacker is not None:
            kill_session(attacker.pid)
    return code, out, err, report


def test_deleted_seats_fail_the_job_instead_of_completing_it_untrained(marker):
    # Every process of generation 1 finds its seat gone. It cannot tell that from
    # having been left out, but the generation's roster lists it: the job's
    # store was tampered with, and the job fails saying so (it exited 0 with
    # nothing trained: "rank 1 completed").
    discover = marker / "discover.sh"
    discover.write_text("#!/bin/sh\necho localhost:2\n")
    discover.chmod(0o755)
    code, out, err, report = _job(
        marker, ["-np", "2", "--min-np", "1", "--max-np", "2", "--host-discovery-script",
                 str(discover), sys.executable, TRAIN, str(marker)],
        _env(ELASTIC_STEP_SECONDS="0.2"), seconds=20, delete=["/elastic/g1/seat/"])
    assert any(k.endswith("/elastic/g1/seat/w0") for k in report["deleted"]), report
    assert code != 0, err
    assert not re.search(r"rank \d completed", err), err
    assert "DONE" not in out and "GEN" not in out, out + err
    assert "the rendezvous store was tampered with" in err, err
    # Whichever process finds its seat gone first fails the job; the launcher may
    # stop the other before it looks.
    assert re.search(r"key 'elastic/g1/seat/w[01]' \(this process's seat in generation 1\) "
                     r"was deleted", err), err
    assert re.search(r"lost rank [01] \(generation 1\) on host localhost: exited with code 1",
                     err), err


def _shrink_under_replay(marker, steps, **replay):
    # w1 fails at step 3; its host is blacklisted and generation 2 is w0 alone.
    return _job(
        marker, ["-np", "2", "--min-np", "1", "-H", "127.0.0.1:1,127.0.0.2:1",
                 sys.executable, TRAIN, str(marker)],
        _env(ELASTIC_FAULTS="w1:3:raise", ELASTIC_BATCHES=str(steps),
             ELASTIC_STEP_SECONDS="0.2"),
        seconds=40, replay={"suffix": "/elastic/latest", **replay})


def _assert_latest_replayed(report):
    assert report["replayed"] >= 1, report
    assert base64.b64decode(report["recorded"]).endswith(b"1"), report
    assert base64.b64decode(report["replaced"]).endswith(b"2"), report


def test_latest_written_back_while_survivors_wait_is_restored_by_the_launcher(marker):
    # Generation 1's signed "elastic/latest" goes back over generation 2's as soon
    # as the launcher publishes it: w0, waiting to re-form, saw 1 and waited on in
    # silence for a generation it had missed. The launcher now sees its record
    # replaced, restores it and says so.
    code, out, err, report = _shrink_under_replay(marker, steps=8)
    _assert_latest_replayed(report)
    assert "hvdlike-run: elastic/latest in the job's store said generation 1 instead of 2" \
        in err, err
    assert "by a process without the job's secret; restored it" in err, err
    if code == 0:
        assert "DONE worker=w0 rank=0 size=1 steps=8 " in out, out + err
        assert "sizes 2 -> 1" in err, err
    else:  # w0 read 2 before the replay and 1 again before the repair: it refuses
        assert "key 'elastic/latest' went back from generation 2 to 1" in err, err


def test_latest_going_backwards_under_a_member_fails_the_job_naming_it(marker):
    # Once generation 2 has formed, its old value is written back again and again
    # (the launcher's repairs lose the race): w0 reads 1 at its next commit. It
    # refuses to take the record for news (before: it trained on, as if the
    # replay were the truth) and the job fails naming it, without waiting out a timeout.
    code, out, err, report = _shrink_under_replay(marker, steps=30,
                                                  after="/elastic/g2/ready/w0", repeat=True)
    _assert_latest_replayed(report)
    assert code != 0, out + err
    assert "the rendezvous store was tampered with: key 'elastic/latest' went back from " \
        "generation 2 to 1" in err, err
    assert "an old record was written back by a process without the job's secret" in err, err
    assert "DONE" not in out, out
    assert "lost rank 0 (generation 2) on host 127.0.0.1: exited with code 1" in err, err
