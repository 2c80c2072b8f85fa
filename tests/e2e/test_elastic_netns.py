"""Elastic jobs on two real hosts (network namespaces with sshd), ranks over ssh."""

import re
import sys

import pytest

from .conftest import finish, kill_session, start
from .test_elastic import TRAIN, _assert_generations_agree, _done, _env, _trained_sizes, \
    _wait_progress, resume_seconds

pytestmark = pytest.mark.netns


def test_host_added_then_its_rank_sigkilled(netns_cluster, marker):
    """2 ranks on host A; host B (2 slots) is discovered: 4 ranks; a rank on B is
    SIGKILLed: B is blacklisted and the 2 ranks on A finish every committed step.

    The steps of generation 1 are slow enough (0.25 s) that B is discovered long
    before step 16, the step w3 dies at; once B has joined, the pace no longer
    matters and steps take the default time. Two epochs leave a few steps to
    train at size 2 after the kill."""
    c = netns_cluster
    hosts = marker / "hosts.txt"
    hosts.write_text(f"{c.ips[0]}:2\n")
    script = marker / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    progress = marker / "progress"
    epochs, batches = 2, 10
    proc = start(["-np", "2", "--min-np", "2", "--max-np", "4", "--host-discovery-script",
                  str(script), *c.ssh_options(), sys.executable, TRAIN, str(marker)],
                 env=_env(ELASTIC_STEP_SECONDS="0.25", ELASTIC_SLOW_GENERATIONS="1",
                          ELASTIC_EPOCHS=str(epochs), ELASTIC_BATCHES=str(batches),
                          ELASTIC_PROGRESS=str(progress), ELASTIC_FAULTS="w3:16:kill"))
    try:
        _wait_progress(progress, lambda steps, size: steps >= 2, proc)
        hosts.write_text(f"{c.ips[0]}:2\n{c.ips[1]}:2\n")
        code, out, err = finish(proc, timeout=240)
    finally:
        kill_session(proc.pid)
    assert code == 0, err
    done = _done(out)
    assert sorted(done) == ["w0", "w1"], out
    assert {steps for _, _, steps, _ in done.values()} == {epochs * batches}, out
    assert len({params for _, _, _, params in done.values()}) == 1
    _assert_generations_agree(out)
    assert _trained_sizes(out, "w0") == [2, 4, 2], out + err[-6000:]
    assert _trained_sizes(out, "w3") == [4], out
    assert f"lost rank 3 (generation 2) on host {c.ips[1]}: was killed by signal 9 (SIGKILL)" \
        in err, err
    assert "sizes 2 -> 4 -> 2" in err
    assert re.search(r"GEN worker=w2 gen=2 rank=2 size=4", out), out
    print("\n".join(line for line in (err + out).splitlines()
                    if line.startswith("hvdlike-run:") or "DONE worker" in line
                    or "GEN worker" in line or "FAULT" in line))
    print(f"kill to training resumed: {resume_seconds(out, 3):.1f}s")
    assert c.wait_until_clean() == []


def test_partitioned_host_is_dropped_and_the_others_finish(netns_cluster, marker):
    """3 ranks, one on host B; B's link goes down mid-run. The survivors' collectives
    time out into HorovodInternalError, the launcher loses B's ssh connection,
    blacklists B, and the two ranks on A finish every committed step.

    The launcher learns that B is gone from ssh's keep-alives: one is sent after
    every 2 s of silence, and three unanswered ones (about 8 s of a dead link)
    end the connection, instead of the 5 s x 3 the launcher asks for by default
    (options given with --ssh-option come first and win). A reachable sshd
    answers a keep-alive at once, far within those 6 s even on a loaded
    machine, so a live host is not taken for a lost one. Only generation 1, which
    the link is cut in, trains at the slow pace that leaves time for the cut."""
    import subprocess

    c = netns_cluster
    progress = marker / "progress"
    epochs, batches = 3, 6
    keepalive = ["--ssh-option", "ServerAliveInterval=2", "--ssh-option", "ServerAliveCountMax=3"]
    proc = start(["-np", "3", "--min-np", "2", "-H", f"{c.ips[0]}:2,{c.ips[1]}:1",
                  *c.ssh_options(), *keepalive, sys.executable, TRAIN, str(marker)],
                 env=_env(ELASTIC_STEP_SECONDS="0.2", ELASTIC_SLOW_GENERATIONS="1",
                          ELASTIC_EPOCHS=str(epochs), ELASTIC_BATCHES=str(batches),
                          ELASTIC_PROGRESS=str(progress), HVDLIKE_GLOO_TIMEOUT_SECONDS="8"))
    link = f"hvv{c.tag}2"  # the second host's cable into the bridge
    try:
        _wait_progress(progress, lambda steps, size: steps >= 3, proc)
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        code, out, err = finish(proc, timeout=240)
    finally:
        subprocess.run(["ip", "link", "set", link, "up"], check=False)
        kill_session(proc.pid)
    assert code == 0, err
    done = _done(out)
    assert sorted(done) == ["w0", "w1"], out
    assert {steps for _, _, steps, _ in done.values()} == {epochs * batches}, out
    assert len({params for _, _, _, params in done.values()}) == 1
    _assert_generations_agree(out)
    assert _trained_sizes(out, "w0") == [3, 2], out + err[-4000:]
    assert f"lost rank 2 (generation 1) on host {c.ips[1]}: lost its ssh connection" in err, err
    assert "sizes 3 -> 2" in err
    assert c.wait_until_clean(timeout=60) == []
