"""Slurm's compressed lists, and hvdlike-run taking hosts from an allocation."""

import pytest

from hvdlike.core.errors import ConfigError
from hvdlike.core.mpi_bootstrap import expand_nodelist, expand_tasks_per_node
from hvdlike.launcher import cli, slurm
from hvdlike.launcher.errors import LaunchError
from hvdlike.launcher.hosts import HostSlots
from hvdlike.launcher.job import Job


@pytest.mark.parametrize("text, hosts", [
    ("node[1-3,5]", ["node1", "node2", "node3", "node5"]),
    ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
    ("single", ["single"]),
    ("a,b[8-10]", ["a", "b8", "b9", "b10"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
    ("gpu[1-2]-ib", ["gpu1-ib", "gpu2-ib"]),
    ("", []),
])
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["node[1-3", "node1-3]", "node[a-b]", "node[5-3]"])
def test_malformed_nodelist_is_refused(text):
    with pytest.raises(ConfigError, match="node list"):
        expand_nodelist(text)


@pytest.mark.parametrize("text", ["node[1-99999999]", "a[1-1000]b[1-1000]",
                                  "n[1-60000],m[1-60000]", "n[1-50000,1-50001]"])
def test_a_node_list_naming_more_nodes_than_a_cluster_has_is_refused_unbuilt(text):
    with pytest.raises(ConfigError, match="names more than 100000 nodes"):
        expand_nodelist(text)
    assert len(expand_nodelist("n[1-100000]")) == 100000  # the largest accepted


def test_a_huge_hand_written_allocation_is_a_launch_error():
    with pytest.raises(LaunchError, match="cannot read the Slurm allocation: "
                                          "SLURM_JOB_NODELIST: node list "
                                          "'n\\[1-99999999\\]' names more than"):
        slurm.allocation_hosts({**SALLOC, "SLURM_JOB_NODELIST": "n[1-99999999]"})
    with pytest.raises(LaunchError, match="SLURM_TASKS_PER_NODE '1\\(x100000000\\)'"):
        slurm.allocation_hosts({**SALLOC, "SLURM_TASKS_PER_NODE": "1(x100000000)"})


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(ConfigError, match="SLURM_JOB_CPUS_PER_NODE='2x'"):
        expand_tasks_per_node("2x", "SLURM_JOB_CPUS_PER_NODE")


SALLOC = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS": "5",
          "SLURM_TASKS_PER_NODE": "3,2", "SLURM_JOB_CPUS_PER_NODE": "8(x2)", "PATH": "/bin"}


def test_allocation_hosts_use_tasks_when_requested_else_cpus():
    assert slurm.allocation_hosts(SALLOC) == [HostSlots("n1", 3), HostSlots("n2", 2)]
    no_tasks = {k: v for k, v in SALLOC.items() if k != "SLURM_NTASKS"}
    assert slurm.allocation_hosts(no_tasks) == [HostSlots("n1", 8), HostSlots("n2", 8)]


def test_allocation_mismatch_is_explained():
    with pytest.raises(LaunchError, match="names 2 node.*gives 1"):
        slurm.allocation_hosts({**SALLOC, "SLURM_TASKS_PER_NODE": "5"})


def test_a_node_without_slots_is_named_not_taken_for_np_0():
    with pytest.raises(LaunchError, match="SLURM_JOB_CPUS_PER_NODE='0' gives a node no slots"):
        slurm.allocation_hosts({"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "vm",
                                "SLURM_JOB_CPUS_PER_NODE": "0"})
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST: node list 'n\\[' is not valid"):
        slurm.allocation_hosts({**SALLOC, "SLURM_JOB_NODELIST": "n["})


def test_only_outside_a_step_and_without_hosts():
    assert slurm.in_allocation(SALLOC)
    assert not slurm.in_allocation({**SALLOC, "SLURM_STEP_ID": "0"})  # inside srun
    assert not slurm.in_allocation({"PATH": "/bin"})
    assert slurm.hosts_if_allocated(SALLOC, "h:2", None) is None
    assert slurm.hosts_if_allocated(SALLOC, None, "hosts.txt") is None


def test_cli_inside_allocation_starts_ranks_with_srun(monkeypatch, tmp_path):
    monkeypatch.setattr("os.environ", dict(SALLOC, PATH=f"{tmp_path}:/bin:/usr/bin"))
    srun = tmp_path / "srun"
    srun.write_text("#!/bin/sh\n")
    srun.chmod(0o755)
    _fake_scontrol(tmp_path, "task/affinity,task/cgroup")
    config = cli.to_config(cli.build_parser().parse_args(["-np", "4", "python", "x.py"]))
    assert config.use_srun and config.hosts == [HostSlots("n1", 3), HostSlots("n2", 2)]
    config.environ = dict(SALLOC, PATH=f"{tmp_path}:/bin", SLURM_CONF="/etc/x.conf", HOSTNAME="login")
    job = Job(config)
    assert [p.host for p in job.placements] == ["n1", "n1", "n1", "n2"]
    argv = job.launch_argv(job.placements[3])
    assert argv[0] == str(srun) and "--nodelist=n2" in argv and "--ntasks=1" in argv
    assert "--overlap" in argv and argv[-1].endswith("remote.py")
    assert "--cpu-bind=none" in argv
    env = job.rank_spec(job.placements[3], "10.0.0.1", 1234)["env"]
    assert env["SLURM_JOB_ID"] == "77" and env["SLURM_CONF"] == "/etc/x.conf"
    assert "HOSTNAME" not in env and "SLURM_NTASKS" not in env
    assert env["HVDLIKE_RANK"] == "3" and env["HVDLIKE_LOCAL_RANK"] == "0"
    assert "(srun;" in job.describe()


def _fake_scontrol(folder, plugin):
    scontrol = folder / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho 'SwitchType = (null)'\necho 'TaskPlugin              = "
                        f"{plugin}'\n")
    scontrol.chmod(0o755)


@pytest.mark.parametrize("plugin, binds", [("task/none", False), ("task/affinity", True),
                                           ("task/cgroup,task/affinity", True), (None, True)])
def test_cpu_bind_is_passed_only_where_the_cluster_can_bind(tmp_path, plugin, binds):
    # On a task/none cluster srun would print "lacks support for cpu binding" per rank.
    srun = tmp_path / "srun"
    srun.write_text("#!/bin/sh\n")
    srun.chmod(0o755)
    if plugin is not None:
        _fake_scontrol(tmp_path, plugin)
    assert slurm.binds_cpus(str(srun), {"PATH": str(tmp_path)}) is binds
    argv = slurm.srun_command("n1", ["helper"], str(srun), cpu_bind=binds)
    assert ("--cpu-bind=none" in argv) is binds and argv[-1] == "helper"


def test_explicit_hosts_win_over_the_allocation(monkeypatch):
    monkeypatch.setattr("os.environ", dict(SALLOC))
    config = cli.to_config(cli.build_parser().parse_args(["-H", "localhost:2", "python"]))
    assert not config.use_srun and config.hosts == [HostSlots("localhost", 2)]


def test_missing_srun_is_a_clear_error():
    with pytest.raises(LaunchError, match="srun is not on PATH"):
        slurm.find_srun({"PATH": "/nonexistent"})


def test_inside_a_step_the_missing_np_error_says_why_the_allocation_is_not_used(monkeypatch):
    monkeypatch.setattr("os.environ", {**SALLOC, "SLURM_STEP_ID": "3"})
    with pytest.raises(LaunchError, match="inside step 3 of Slurm job 77"):
        cli.to_config(cli.build_parser().parse_args(["python", "x.py"]))
    monkeypatch.setattr("os.environ", {"SLURM_JOB_ID": "77", "PATH": "/bin"})
    with pytest.raises(LaunchError, match="sets no SLURM_JOB_NODELIST"):
        cli.to_config(cli.build_parser().parse_args(["python", "x.py"]))
