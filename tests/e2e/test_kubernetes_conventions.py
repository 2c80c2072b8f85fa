"""docs/kubernetes.md: every example manifest parses and its entry command runs here.

No cluster: each command runs on this machine the way the operator would start
it in a pod (MPIJob: the hostfile and discovery script it mounts under
/etc/mpi, written here in its format; PyTorchJob: the PET_* variables it sets
and HVDLIKE_JOB_SECRET as a Secret would provide it).
"""

import os
import re
import secrets
import shutil
import socket
import stat
import subprocess
import sys

import pytest

from .conftest import ROOT, finish, launcher_argv, launcher_env, write_script

yaml = pytest.importorskip("yaml", reason="needs PyYAML to parse the manifests")

DOC = os.path.join(ROOT, "docs", "kubernetes.md")

TRAIN = """
    import torch
    torch.set_num_threads(1)
    import hvdlike.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    print(f"k8s rank={hvd.rank()} size={hvd.size()} sum={total:g}", flush=True)
    hvd.shutdown()
"""

ELASTIC_TRAIN = """
    import torch
    torch.set_num_threads(1)
    import hvdlike.torch as hvd

    hvd.init()
    state = hvd.elastic.ObjectState(step=0)

    @hvd.elastic.run
    def train(state):
        while state.step < 3:
            hvd.allreduce(torch.ones(1), name=f"step{state.step}")
            state.step += 1
            state.commit()
        return hvd.size()

    size = train(state)
    print(f"k8s elastic rank={hvd.rank()} size={size} steps={state.step}", flush=True)
"""


def manifests():
    """``{example name: parsed manifest}`` from the doc's yaml blocks."""
    with open(DOC) as handle:
        text = handle.read()
    found = {}
    for block in re.findall(r"```yaml\n(.*?)```", text, re.S):
        name = re.match(r"# example: (\S+)", block)
        assert name, f"yaml block without '# example: NAME': {block[:60]!r}"
        found[name.group(1)] = yaml.safe_load(block)
    return found


def _container(manifest, replica):
    specs = manifest["spec"].get("mpiReplicaSpecs") or manifest["spec"]["pytorchReplicaSpecs"]
    return specs[replica]["template"]["spec"]["containers"][0]


def _localise(command, files):
    """The pod's command with its paths mapped to this machine's files."""
    argv = [files.get(word, word) for word in command]
    if argv[0] == "hvdlike-run":
        argv = launcher_argv() + argv[1:]
    if argv[0] == "python":
        argv[0] = sys.executable
    return argv


def _run(argv, env, timeout=150):
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    return finish(proc, timeout)


def test_every_example_is_a_kubeflow_manifest():
    found = manifests()
    assert set(found) == {"mpijob", "mpijob-elastic", "pytorchjob"}
    assert found["mpijob"]["kind"] == found["mpijob-elastic"]["kind"] == "MPIJob"
    assert found["pytorchjob"]["kind"] == "PyTorchJob"
    env = {e["name"]: e for e in _container(found["pytorchjob"], "Worker")["env"]}
    assert "secretKeyRef" in env["HVDLIKE_JOB_SECRET"]["valueFrom"]


def test_mpijob_launcher_command_runs_with_the_mounted_hostfile(marker):
    manifest = manifests()["mpijob"]
    slots = manifest["spec"]["slotsPerWorker"]
    hostfile = marker / "hostfile"
    hostfile.write_text(f"localhost slots={slots}\n")  # the operator: "<worker> slots=N"
    files = {"/etc/mpi/hostfile": str(hostfile),
             "/opt/train/train.py": write_script(marker, "train.py", TRAIN)}
    argv = _localise(_container(manifest, "Launcher")["command"], files)
    code, out, err = _run(argv, launcher_env())
    assert code == 0, err
    for rank in range(slots):
        assert f"k8s rank={rank} size={slots} sum={slots * (slots + 1) // 2:g}" in out, out


def test_elastic_mpijob_command_runs_with_the_discovery_script(marker):
    manifest = manifests()["mpijob-elastic"]
    script = marker / "discover_hosts.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")  # one "host:slots" per live worker
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    files = {"/etc/mpi/discover_hosts.sh": str(script),
             "/opt/train/elastic_train.py": write_script(marker, "elastic_train.py",
                                                         ELASTIC_TRAIN)}
    argv = _localise(_container(manifest, "Launcher")["command"], files)
    code, out, err = _run(argv, launcher_env())
    assert code == 0, err
    for rank in range(2):
        assert f"k8s elastic rank={rank} size=2 steps=3" in out, out


def test_pytorchjob_command_runs_under_the_operators_variables(marker):
    if shutil.which("torchrun") is None:
        pytest.skip("needs torchrun (installed with torch)")
    manifest = manifests()["pytorchjob"]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nproc = int(manifest["spec"]["nprocPerNode"])
    # One pod of the job: what the operator sets (one node here), and the Secret's value.
    env = launcher_env(PET_NNODES="1", PET_NPROC_PER_NODE=str(nproc), PET_NODE_RANK="0",
                       PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(port),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="1", RANK="0",
                       HVDLIKE_JOB_SECRET=secrets.token_hex(16))
    files = {"/opt/train/train.py": write_script(marker, "train.py", TRAIN)}
    argv = _localise(_container(manifest, "Worker")["command"], files)
    argv[0] = shutil.which("torchrun")
    code, out, err = _run(argv, env)
    assert code == 0, err
    for rank in range(nproc):
        assert f"k8s rank={rank} size={nproc} sum={nproc * (nproc + 1) // 2:g}" in out, out
