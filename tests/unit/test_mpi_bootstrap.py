"""Bootstrapping ranks started by mpirun or srun (no MPI needed for these)."""

import sys

import pytest

from hvdlike.core import bootstrap, mpi_bootstrap
from hvdlike.core.job_store import JobStore
from hvdlike.core.errors import ConfigError


def test_topologies_match_horovod_definitions():
    topos = mpi_bootstrap.topologies(["a", "a", "b", "c", "c", "c"])
    assert [(t.local_rank, t.local_size) for t in topos] == [
        (0, 2), (1, 2), (0, 1), (0, 3), (1, 3), (2, 3)]
    assert [(t.cross_rank, t.cross_size) for t in topos] == [
        (0, 3), (0, 2), (1, 3), (2, 3), (1, 2), (0, 1)]


def test_nothing_detected_without_launcher_variables():
    assert mpi_bootstrap.detect({"PATH": "/bin"}) is None


@pytest.mark.parametrize("environ", [
    {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"},
    {"PMI_RANK": "0", "PMI_SIZE": "1", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"},
])
def test_single_rank_mpi_job_needs_no_store(environ):
    topo, rdzv = mpi_bootstrap.detect(environ)
    assert (topo.rank, topo.size) == (0, 1)
    assert rdzv.launcher.startswith("mpirun") and rdzv.addr == ""


def test_multi_rank_mpi_without_mpi4py_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes the import fail
    with pytest.raises(ConfigError, match="mpi4py"):
        mpi_bootstrap.detect({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"})


def test_bad_mpi_variable_is_named():
    with pytest.raises(ConfigError, match="PMI_SIZE"):
        mpi_bootstrap.detect({"PMI_RANK": "0", "PMI_SIZE": "many"})


def test_expand_nodelist():
    assert mpi_bootstrap.expand_nodelist("node[01-03,7],gpu5") == [
        "node01", "node02", "node03", "node7", "gpu5"]
    assert mpi_bootstrap.expand_nodelist("single") == ["single"]


SLURM = {
    "SLURM_PROCID": "5", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NUM_TASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
    "SLURM_STEP_NODELIST": "n[1-3]", "SLURM_STEP_TASKS_PER_NODE": "2(x3)",
}


def test_slurm_topology_and_rendezvous(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    topo, rdzv = mpi_bootstrap.detect(SLURM)
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size) == (5, 6, 1, 2)
    assert (topo.cross_rank, topo.cross_size) == (2, 3)
    assert rdzv.launcher == "srun" and rdzv.addr == "n1" and not rdzv.host_store
    assert 20000 <= rdzv.port < 32000


@pytest.mark.parametrize("change,words", [
    ({"SLURM_PROCID": "6"}, "srun: rank 6 is outside 0..5"),
    ({"SLURM_PROCID": "-1"}, "srun: rank -1 is outside 0..5"),
    ({"SLURM_LOCALID": "2"}, "srun: local rank 2 is outside 0..1"),
    ({"SLURM_LOCALID": "-1"}, "srun: local rank -1 is outside 0..1"),
    ({"SLURM_STEP_NUM_TASKS": "0", "SLURM_STEP_TASKS_PER_NODE": "0(x3)"},
     "srun: job size 0 must be >= 1"),
    ({"SLURM_STEP_TASKS_PER_NODE": "3(x3)"},
     "SLURM_STEP_TASKS_PER_NODE='3\\(x3\\)' adds up to 9 task\\(s\\), SLURM_STEP_NUM_TASKS says 6"),
    ({"SLURM_STEP_TASKS_PER_NODE": "3,3,0"}, "srun: 0 rank\\(s\\) on this host is outside 1..6"),
    ({"SLURM_NODEID": "3"}, "SLURM_NODEID=3 is outside the 3 node\\(s\\)"),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x"}, "SLURM_STEP_TASKS_PER_NODE='2\\(x' is not valid"),
    ({"SLURM_STEP_NODELIST": "n["}, "SLURM_STEP_NODELIST: node list 'n\\[' is not valid"),
])
def test_contradictory_slurm_variables_are_refused_naming_them(monkeypatch, change, words):
    # As under hvdlike-run and torchrun: a rank outside the step would wait for
    # peers that never come; a count that does not add up would mis-place ranks.
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(ConfigError, match=words):
        mpi_bootstrap.detect({**SLURM, **change})


def test_multi_host_slurm_without_a_secret_is_marked_unauthenticated(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    topo, rdzv = bootstrap.detect(SLURM)
    assert not rdzv.authenticated and "4242" in rdzv.secret


def test_slurm_takes_the_users_secret(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    topo, rdzv = bootstrap.detect({**SLURM, "HVDLIKE_JOB_SECRET": "mine"})
    assert rdzv.authenticated and rdzv.secret == "mine"


def test_slurm_master_addr_and_port_win():
    topo, rdzv = mpi_bootstrap.detect({**SLURM, "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                                       "SLURM_NODEID": "0", "MASTER_ADDR": "10.1.1.1",
                                       "MASTER_PORT": "29555"})
    assert (rdzv.addr, rdzv.port, rdzv.host_store) == ("10.1.1.1", 29555, True)


def test_hvdlike_variables_win_over_mpi():
    environ = {"HVDLIKE_RANK": "0", "HVDLIKE_SIZE": "1", "OMPI_COMM_WORLD_RANK": "3",
               "OMPI_COMM_WORLD_SIZE": "4"}
    topo, rdzv = bootstrap.detect(environ)
    assert topo.size == 1 and rdzv.launcher == "hvdlike-run"


def test_choose_store_address_single_host_is_loopback():
    peers = [("a", ["10.0.0.5"]), ("a", ["10.0.0.5"])]
    assert mpi_bootstrap.choose_store_address(peers) == "127.0.0.1"


def test_same_name_different_addresses_are_different_hosts():
    assert mpi_bootstrap.host_key("vm", ["10.0.0.2"]) != mpi_bootstrap.host_key("vm", ["10.0.0.3"])
    assert mpi_bootstrap.host_key("vm", ["b", "a"]) == mpi_bootstrap.host_key("vm", ["a", "b"])


def test_hosting_rank_can_connect_to_its_own_store_twice():
    port = mpi_bootstrap._free_port("127.0.0.1")
    topo = bootstrap.Topology(rank=0, size=2)
    rdzv = bootstrap.Rendezvous(launcher="mpirun (test)", addr="127.0.0.1", port=port,
                                secret="s", host_store=True)
    job_store = JobStore(topo, rdzv, 10)
    try:
        first = job_store.connect()
        second = job_store.connect()  # joins, does not bind again
        first.set("k", "v")
        assert second.get("k") == b"v"
    finally:
        job_store.close()


def test_open_mpi_ranks_point_mpi4py_at_the_launching_libmpi(tmp_path):
    (tmp_path / "libmpi.so.40").write_bytes(b"")
    environ = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_LIBDIR_LOC": str(tmp_path)}
    assert mpi_bootstrap.libmpi_of_launcher(environ) == str(tmp_path / "libmpi.so.40")
    prefix_only = {"OMPI_COMM_WORLD_RANK": "0", "OPAL_PREFIX": str(tmp_path.parent)}
    assert mpi_bootstrap.libmpi_of_launcher(prefix_only) is None  # no lib/ under it
    assert mpi_bootstrap.libmpi_of_launcher({"PMI_RANK": "0"}) is None
