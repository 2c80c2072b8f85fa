"""Attacks on a running job's rendezvous store by another local user.

The attacker (tests/security/attacker.py) is an unprivileged process (uid
``nobody``) that knows only the store's address. It lists and reads every key
and writes forged or replayed records. Nothing it writes may be used: the job
either finishes with the right result or fails with an error that says the
store was tampered with; no code of the attacker's ever runs.
"""

import base64
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from .conftest import ROOT, finish, kill_session, launcher_env, start, wait_ready, write_script

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="attack tests switch to uid nobody: needs root")

JOB = """
    import os, sys, time
    import torch
    torch.set_num_threads(1)
    import hvdlike.torch as hvd

    hvd.init()
    from hvdlike.core import api
    hvd.core_runtime = api.runtime  # test-only peek at where the store is
    here = os.path.dirname(os.path.abspath(__file__))
    for step in range(int(sys.argv[1])):
        total = hvd.allreduce(torch.ones(4) * (hvd.rank() + 1), name=f"step{step}", op=hvd.Sum)
        # The test drops a "stop" file once its attack is over; the ranks agree to end.
        stop = float(hvd.rank() == 0 and os.path.exists(os.path.join(here, "stop")))
        if hvd.allreduce(torch.tensor([stop]), name=f"stop{step}", op=hvd.Max).item():
            break
        if step == 0:
            with open(os.path.join(here, f"ready.{hvd.rank()}"), "w") as f:
                f.write(str(os.getpid()))
            if hvd.rank() == 0:
                with open(os.path.join(here, "job.tmp"), "w") as f:
                    f.write('{"secret": "%s", "addr": "%s", "port": %s}' % (
                        os.environ.get("HVDLIKE_JOB_SECRET", ""),
                        os.environ.get("HVDLIKE_STORE_ADDR", ""),
                        os.environ.get("HVDLIKE_STORE_PORT",
                                       hvd.core_runtime().rendezvous.port)))
                os.replace(os.path.join(here, "job.tmp"), os.path.join(here, "job.json"))
        time.sleep(0.05)
    print(f"rank {hvd.rank()} finished: total={total.tolist()}")
    hvd.shutdown()
"""


class Evil:
    """Unpickling this creates a file: proof that attacker-chosen code ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def attack(spec, folder, netns=None, stdin_port=None):
    """Start the attacker (as nobody); returns the Popen (JSON report on stdout)."""
    path = os.path.join(str(folder), f"spec{time.monotonic_ns()}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    argv = [sys.executable, "-m", "tests.security.attacker", path]
    if netns:
        argv = ["ip", "netns", "exec", netns] + argv
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.PIPE, text=True,
                            start_new_session=True)


def report_of(proc, timeout=60):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"attacker did not finish: {err}")
    assert proc.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["uid"] == 65534
    return report


def assert_secret_nowhere(report, secret):
    assert report["keys"], "the attacker saw no keys at all"
    for key, value in report["keys"].items():
        assert secret not in key
        raw = base64.b64decode(value)
        assert secret.encode() not in raw and secret.encode().hex().encode() not in raw


def _start_job(marker, steps, extra=(), env=None):
    script = write_script(marker, "job.py", JOB)
    proc = start(["-np", "2", *extra, sys.executable, script, str(steps)], env=env)
    wait_ready(marker, 2, proc, timeout=90)
    deadline = time.monotonic() + 10
    while not (marker / "job.json").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.1)
    return proc, json.loads((marker / "job.json").read_text())


def test_listing_and_reading_every_key_reveals_no_secret(marker):
    proc, job = _start_job(marker, steps=100000)
    pids = [int((marker / f"ready.{r}").read_text()) for r in range(2)]
    try:
        report = report_of(attack({"host": job["addr"], "port": job["port"], "seconds": 1.0,
                                   "pids": pids}, marker))
        (marker / "stop").write_text("")  # the job ran all along the attack; now it ends
        code, out, err = finish(proc, timeout=90)
    finally:
        kill_session(proc.pid)
    assert code == 0, err
    assert_secret_nowhere(report, job["secret"])
    assert all(v.startswith("refused") for v in report["environ"].values()), report["environ"]
    assert "[0]<stdout>:rank 0 finished: total=[3.0, 3.0, 3.0, 3.0]" in out


@pytest.mark.parametrize("how", ["forged abort", "replayed abort", "forged heartbeat"])
def test_forged_or_replayed_health_records_fail_closed(marker, how):
    spec = {"forged abort": {"forge": [{"suffix": "health/abort",
                                        "value": "attacker says stop"}]},
            "replayed abort": {"copy": [{"from": "health/host/0", "to": "health/abort"}]},
            "forged heartbeat": {"overwrite": [{"suffix": "health/hb/1",
                                               "value": base64.b64encode(b"7").decode()}]}}[how]
    proc, job = _start_job(marker, steps=100000)
    try:
        report = report_of(attack({"host": job["addr"], "port": job["port"], "seconds": 1.0,
                                   **spec}, marker))
        code, out, err = finish(proc, timeout=60)
    finally:
        kill_session(proc.pid)
    assert report["wrote"], report
    assert code != 0
    assert "the rendezvous store was tampered with" in err, err
    key = "health/hb/1" if how == "forged heartbeat" else "health/abort"
    assert f"health/{key.split('/', 1)[1]}'" in err
    assert "attacker says stop" not in err and "StallError" not in err
    assert_secret_nowhere(report, job["secret"])


RUN_CALLER = """
    import sys, time
    import hvdlike
    sys.path.insert(0, {root!r})

    def work():
        import os
        return int(os.environ["HVDLIKE_RANK"]) * 10 + 1

    try:
        print("RESULT", hvdlike.run(work, np=2, env={{"PYTHONPATH": {slow!r} + ":" + {root!r}}}))
    except Exception as exc:
        print("ERROR", type(exc).__name__, str(exc).splitlines()[0])
"""


def _store_port_of(pid, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            for conn in psutil.Process(pid).net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    return conn.laddr.ip, conn.laddr.port
        except psutil.NoSuchProcess:
            break
        time.sleep(0.02)
    pytest.fail("the hvdlike.run caller never listened")


@pytest.mark.parametrize("target", ["payload", "result", "replayed payload as result"])
def test_hvdlike_run_payload_and_results_cannot_be_replaced(marker, target):
    proof = str(marker / "attacker-code-ran")
    evil = base64.b64encode(pickle.dumps(Evil(proof))).decode()
    slow = marker / "slow"
    slow.mkdir()
    # Ranks pause at interpreter start, so the attacker has replaced the payload first.
    (slow / "sitecustomize.py").write_text("import time\ntime.sleep(2.5)\n")
    caller = write_script(marker, "caller.py", RUN_CALLER.format(root=ROOT, slow=str(slow)))
    proc = subprocess.Popen([sys.executable, caller], cwd=ROOT, env=launcher_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        addr, port = _store_port_of(proc.pid)
        spec = {"host": addr, "port": port, "seconds": 25.0}
        if target == "payload":
            spec["overwrite"] = [{"suffix": "launcher/run/payload", "value": evil}]
        elif target == "result":
            spec["overwrite"] = [{"suffix": f"launcher/run/result/{r}", "value": evil}
                                 for r in range(2)]
        else:
            spec["copy"] = [{"from": "launcher/run/payload", "to": "launcher/run/result/0"}]
        attacker = attack(spec, marker)
        out, err = proc.communicate(timeout=90)
        report = report_of(attacker)
    finally:
        kill_session(proc.pid)
    assert report["wrote"], report
    assert not os.path.exists(proof), "attacker-chosen code ran"
    assert "RESULT" not in out, out  # never a result built from forged data
    assert "ERROR RankError" in out, out + err
    assert "authentication" in out or "tampered" in out or "refused its payload" in out, out


def test_store_hosted_by_rank0_under_mpirun_listens_on_loopback_only(marker):
    pytest.importorskip("mpi4py", reason="needs mpi4py")
    if shutil.which("mpirun") is None:
        pytest.skip("needs mpirun")
    proc, job = _start_job(marker, steps=100, extra=["--mpi"])
    try:
        pids = [int((marker / f"ready.{r}").read_text()) for r in range(2)]
        listening = [(pid, c.laddr.ip, c.laddr.port) for pid in pids
                     for c in psutil.Process(pid).net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN]
        (marker / "stop").write_text("")  # the sockets are seen: the job may end now
        code, out, err = finish(proc, timeout=90)
    finally:
        kill_session(proc.pid)
    assert code == 0, err
    # The store rank 0 hosts: on the loopback address only. (MPICH's own
    # listeners are MPI's business and are not checked here.)
    store = [(pid, ip) for pid, ip, port in listening if port == job["port"]]
    assert store == [(pids[0], "127.0.0.1")], listening


@pytest.mark.netns
def test_attacker_on_another_host_cannot_read_the_secret_or_stop_the_job_silently(
        netns_cluster, marker):
    c = netns_cluster
    script = write_script(marker, "job.py", JOB)
    proc = start(["-np", "2", "-H", f"{c.ips[0]}:1,{c.ips[1]}:1", *c.ssh_options(),
                  "python", script, "100000"])
    try:
        wait_ready(marker, 2, proc, timeout=120)
        deadline = time.monotonic() + 10
        while not (marker / "job.json").exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.1)
        job = json.loads((marker / "job.json").read_text())
        report = report_of(attack({"host": job["addr"], "port": job["port"], "seconds": 1.0,
                                   "forge": [{"suffix": "health/abort", "value": "stop"}]},
                                  marker, netns=c.namespaces[1]))
        code, out, err = finish(proc, timeout=60)
    finally:
        kill_session(proc.pid)
    assert_secret_nowhere(report, job["secret"])
    assert code != 0 and "the rendezvous store was tampered with" in err, err
    assert c.wait_until_clean() == []
