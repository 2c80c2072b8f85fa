"""Ray across two hosts: a Ray head in one network namespace, a Ray worker node in the other.

``ray start --head`` runs in the first namespace host, ``ray start --address=...``
in the second; a driver script in the first runs a fixed ``RayExecutor`` with one
rank per host (``num_hosts=2``), so the ranks' collectives and the store cross
the bridge between the two hosts. The namespaces' teardown kills every Ray
process by namespace (never by name, so no other Ray on the machine is touched).
"""

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from .conftest import finish, launcher_env, write_script

pytestmark = pytest.mark.netns

START_ATTEMPTS = 2

DRIVER = """
    import json, os, sys
    import ray
    from hvdlike.ray import RayExecutor

    def train():
        import os, socket
        import torch
        torch.set_num_threads(1)
        import hvdlike.torch as hvd

        hvd.init()
        total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
        gathered = hvd.allgather(torch.tensor([hvd.rank()])).tolist()
        out = {"rank": hvd.rank(), "size": hvd.size(), "cross": hvd.cross_rank(),
               "cross_size": hvd.cross_size(), "sum": total, "gather": gathered,
               "ip": ray.util.get_node_ip_address(),
               "store": os.environ["HVDLIKE_STORE_ADDR"]}
        hvd.shutdown()
        return out

    ray.init(address=sys.argv[1], log_to_driver=False)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_hosts=2,
                           num_workers_per_host=1)
    executor.start()
    try:
        print("RESULT " + json.dumps(executor.run(train)), flush=True)
    finally:
        executor.shutdown()
"""


def _ray_cli():
    found = shutil.which("ray", path=os.path.dirname(sys.executable) + os.pathsep
                         + os.environ.get("PATH", ""))
    if found is None:
        pytest.skip("Ray netns test skipped: no 'ray' command (pip install 'hvdlike[ray]')")
    return found


def _in_ns(cluster, ns, argv, env, timeout):
    proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    return finish(proc, timeout)


def test_ray_executor_across_a_head_and_a_worker_node(netns_cluster, marker):
    pytest.importorskip("ray", reason="Ray netns test skipped: ray is not installed")
    ray_cli = _ray_cli()
    temp = tempfile.mkdtemp(prefix="hvray-")  # Ray's socket paths must stay under 108 bytes
    try:
        _run_across(netns_cluster, ray_cli, marker, temp)
    finally:
        _kill_ray(netns_cluster)
        assert netns_cluster.wait_until_clean() == []
        shutil.rmtree(temp, ignore_errors=True)


def _kill_ray(netns_cluster, namespaces=None):
    """Ray's daemons, by their pids in the namespaces (sshd is left alone)."""
    daemons = set(netns_cluster.daemon_pids())
    for ns in namespaces or netns_cluster.namespaces:
        for pid in netns_cluster.pids(ns):
            if pid in daemons:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _start_ray(netns_cluster, ns, argv, env, what):
    """``ray start`` in ``ns``; a second try after a failed one; skip if Ray cannot start.

    On a busy machine Ray's own 30 s limit for a node to register can pass.
    """
    for _ in range(START_ATTEMPTS):
        code, out, err = _in_ns(netns_cluster, ns, argv, env, 180)
        if code == 0:
            return
        _kill_ray(netns_cluster, [ns])  # what the failed start left in this host
    last = (err.strip().splitlines() or out.strip().splitlines() or ["?"])[-1]
    reason = (f"Ray netns test skipped: ray start ({what}) in {ns} failed "
              f"{START_ATTEMPTS} times (exit {code}): {last}")
    print(reason)
    pytest.skip(reason)


def _run_across(netns_cluster, ray_cli, marker, temp):
    head_ns, worker_ns = netns_cluster.namespaces
    head_ip, worker_ip = netns_cluster.ips
    # Ray's token authentication across hosts: every node and the driver share one token.
    env = launcher_env(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token",
                       RAY_AUTH_TOKEN=secrets.token_hex(32))
    _start_ray(netns_cluster, head_ns, [
        ray_cli, "start", "--head", f"--node-ip-address={head_ip}", "--port=6379",
        "--num-cpus=1", "--include-dashboard=false", f"--temp-dir={temp}",
        "--disable-usage-stats"], env, "head")
    _start_ray(netns_cluster, worker_ns, [
        ray_cli, "start", f"--address={head_ip}:6379", f"--node-ip-address={worker_ip}",
        "--num-cpus=1", "--disable-usage-stats"], env, "worker")
    script = write_script(marker, "driver.py", DRIVER)
    code, out, err = _in_ns(netns_cluster, head_ns, [sys.executable, script, f"{head_ip}:6379"],
                            env, 240)
    assert code == 0, f"{out}\n{err}"
    import json

    results = json.loads(next(line for line in out.splitlines()
                              if line.startswith("RESULT "))[len("RESULT "):])
    assert [r["rank"] for r in results] == [0, 1]
    assert [(r["size"], r["cross"], r["cross_size"]) for r in results] == [(2, 0, 2), (2, 1, 2)]
    assert {r["sum"] for r in results} == {3.0}
    assert all(r["gather"] == [0, 1] for r in results)
    assert sorted(r["ip"] for r in results) == sorted([head_ip, worker_ip]), results
    # Actors on two nodes: the store listens on the driver's node address, not loopback.
    assert {r["store"] for r in results} == {head_ip}, results
