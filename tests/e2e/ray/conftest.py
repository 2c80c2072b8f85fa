"""One real local Ray cluster for every Ray test: a head and a worker node.

Ray's start-up is the slow part of these tests (tens of seconds on a busy
2-core machine), so the cluster is started once for the package and shut down
after its last test. Two nodes, :data:`CPUS_PER_NODE` CPUs each, on this
machine (``ray.cluster_utils.Cluster``): enough for fixed jobs on one node and
for an elastic job that loses a node's rank and grows onto a node added later.

When Ray is missing or its cluster does not come up, every test here skips
with the reason printed.
"""

import time

import psutil
import pytest

from ..conftest import launcher_env

CPUS_PER_NODE = 2
START_ATTEMPTS = 2


class RayCluster:
    """The started cluster: ``ray`` (the connected module) and its nodes."""

    def __init__(self, ray, cluster):
        self.ray = ray
        self.cluster = cluster
        self.head = cluster.head_node

    def total_cpus(self) -> float:
        return sum(n["Resources"].get("CPU", 0) for n in self.ray.nodes() if n["Alive"])

    def add_node(self, cpus=CPUS_PER_NODE):
        node = self.cluster.add_node(num_cpus=cpus)
        self.cluster.wait_for_nodes()
        return node

    def remove_node(self, node):
        self.cluster.remove_node(node)
        self.cluster.wait_for_nodes()


def _start(ray):
    from ray.cluster_utils import Cluster

    # Actors are new Python processes: give them the same import path and gloo timeout.
    env = launcher_env()
    runtime_env = {"env_vars": {k: env[k] for k in ("PYTHONPATH", "HVDLIKE_GLOO_TIMEOUT_SECONDS")}}
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": CPUS_PER_NODE, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=CPUS_PER_NODE)
        ray.init(address=cluster.address, log_to_driver=False, runtime_env=runtime_env)
        cluster.wait_for_nodes()
    except BaseException:
        ray.shutdown()
        cluster.shutdown()
        raise
    return cluster


@pytest.fixture(scope="package")
def ray_cluster():
    try:
        import ray
        from ray.cluster_utils import Cluster  # noqa: F401 - part of what the tests need
    except ImportError:
        print("Ray tests skipped: ray is not installed (pip install 'hvdlike[ray]')")
        pytest.skip("Ray tests skipped: ray is not installed (pip install 'hvdlike[ray]')")
    failure = None
    for _ in range(START_ATTEMPTS):
        try:
            cluster = _start(ray)
            break
        except Exception as exc:  # noqa: BLE001 - Ray raises bare Exception on a slow start
            failure = exc
    else:
        reason = (f"Ray tests skipped: a local Ray cluster did not start in {START_ATTEMPTS} "
                  f"attempts: {type(failure).__name__}: {failure}")
        print(reason)
        pytest.skip(reason)
    try:
        yield RayCluster(ray, cluster)
    finally:
        ray.shutdown()
        cluster.shutdown()


def wait_gone(pids, timeout=20.0):
    """Assert every process in ``pids`` ends (zombies count as ended) within ``timeout``."""
    deadline = time.monotonic() + timeout

    def alive(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"rank actors still alive: {[p for p in pids if alive(p)]}"
        time.sleep(0.2)


def wait_cpus_back(ray_cluster, timeout=20.0):
    """Assert Ray gets every CPU back (no actor or placement group left) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while ray_cluster.ray.available_resources().get("CPU", 0) < ray_cluster.total_cpus():
        assert time.monotonic() < deadline, ray_cluster.ray.available_resources()
        time.sleep(0.2)
