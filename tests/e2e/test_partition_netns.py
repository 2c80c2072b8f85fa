"""A network partition between two namespace hosts is an error, never a hang."""

import subprocess
import time

import pytest

from .conftest import TRAINING, finish, kill_session, launcher_env, start, wait_ready
from .test_multihost_netns import _script

pytestmark = pytest.mark.netns


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
    finally:
        subprocess.run(["ip", "link", "set", link, "up"], check=False)
        kill_session(proc.pid)
    assert code != 0, err
    assert elapsed < 60, elapsed
    # rank 0 (still reachable) reports that rank 1 stopped answering
    assert "rank 1 on" in err and "died or stopped responding" in err, err
    assert c.wait_until_clean(timeout=40) == []
