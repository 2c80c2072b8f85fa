"""A network partition between two namespace hosts is an error, never a hang."""

import subprocess
import time

import psutil
import pytest

from .conftest import TRAINING, finish, kill_session, launcher_env, start, wait_ready
from .test_multihost_netns import _script

pytestmark = pytest.mark.netns


def _job_processes(cluster, ns):
    """``pid: command line`` of the processes in ``ns`` other than sshd's: the
    per-connection sshd of a cut connection rightly waits for its client, whose
    goodbye only the link's return can bring; nothing of the job may."""
    found = []
    for pid in cluster.pids(ns):
        try:
            process = psutil.Process(pid)
            if not process.name().startswith("sshd"):
                found.append(f"{pid}: {' '.join(process.cmdline())}")
        except psutil.Error:  # ended meanwhile
            pass
    return found


def _wait_for_no_job_processes(cluster, ns, timeout):
    deadline = time.monotonic() + timeout
    while True:
        left = _job_processes(cluster, ns)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_partition_fails_the_job_naming_the_unreachable_rank(netns_cluster, marker):
    c = netns_cluster
    script = _script(marker, TRAINING)
    env = launcher_env(HVDLIKE_GLOO_TIMEOUT_SECONDS="8")
    proc = start(["-np", "2", "-H", f"{c.ips[0]}:1,{c.ips[1]}:1", "--grace-period-seconds", "2",
                  *c.ssh_options(), "python", script], env=env)
    link = f"hvv{c.tag}2"  # the second host's cable into the bridge
    try:
        wait_ready(marker, 2, proc, timeout=120)
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        began = time.monotonic()
        code, out, err = finish(proc, timeout=90)
        elapsed = time.monotonic() - began
        # Nobody can tell the cut-off rank to stop (its ssh connection is cut
        # too, without a reset): it must end on its own while the link is still
        # down -- its store requests hang rather than fail -- not when it returns.
        left = _wait_for_no_job_processes(c, c.namespaces[1], timeout=45)
        ended_after = time.monotonic() - began
    finally:
        subprocess.run(["ip", "link", "set", link, "up"], check=False)
        kill_session(proc.pid)
    assert code != 0, err
    assert elapsed < 60, elapsed
    # rank 0 (still reachable) reports that rank 1 stopped answering
    assert "rank 1 on" in err and "died or stopped responding" in err, err
    assert left == [], f"still running on the cut-off host {ended_after:.0f}s after the cut: {left}"
    assert c.wait_until_clean(timeout=40) == []


def test_ranks_cut_off_from_the_launcher_stop_on_their_own(netns_cluster, marker):
    c = netns_cluster
    script = _script(marker, TRAINING)
    env = launcher_env(HVDLIKE_GLOO_TIMEOUT_SECONDS="8")
    proc = start(["-np", "2", "-H", f"{c.ips[0]}:1,{c.ips[1]}:1", "--grace-period-seconds", "2",
                  *c.ssh_options(), "python", script], env=env)
    # The launcher (it serves the store) and the hosts now send each other's
    # frames to a MAC nobody has: dropped without a word either way, as over a
    # dead route. The hosts still reach each other: their collectives go on.
    def neighbours(action, *how, check=False):
        for ns in c.namespaces:  # each host's entry for the launcher
            subprocess.run(["ip", "netns", "exec", ns, "ip", "neigh", action, c.bridge_ip,
                            "dev", "eth0", *how], check=check)
        for ip in c.ips:  # the launcher's entries for the hosts
            subprocess.run(["ip", "neigh", action, ip, "dev", c.bridge, *how], check=check)

    try:
        wait_ready(marker, 2, proc, timeout=120)
        neighbours("replace", "lladdr", "02:00:00:00:00:01", "nud", "permanent", check=True)
        began = time.monotonic()
        # Nothing may train on without its launcher: every rank ends on its own.
        left = [p for ns in c.namespaces for p in _wait_for_no_job_processes(c, ns, timeout=45)]
        ended_after = time.monotonic() - began
    finally:
        neighbours("del")
        kill_session(proc.pid)
        proc.communicate(timeout=30)
    assert left == [], f"still running {ended_after:.0f}s after the launcher was cut off: {left}"
    assert c.wait_until_clean(timeout=40) == []
