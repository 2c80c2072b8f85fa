"""Ranks started by ``torchrun``, and by the ``env://`` variables alone, as users start them.

Each test runs real processes meeting over loopback; every run has a hard
timeout and the ``marker`` fixture fails the test if a process outlives it.
"""

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from hvdlike.core import secret_share

from .conftest import ROOT, finish, launcher_env, write_script

ALLREDUCE = """
    import os, sys, time
    import torch
    torch.set_num_threads(1)
    time.sleep(float(os.environ.get("DELAY" + os.environ["RANK"], "0")))
    if os.environ.get("TORCH_FIRST"):  # the user's own process group first, as with DDP
        import torch.distributed as dist
        dist.init_process_group("gloo")
    import hvdlike.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    print(f"env rank={hvd.rank()} size={hvd.size()} local={hvd.local_rank()}/{hvd.local_size()} "
          f"sum={total:g}", flush=True)
    hvd.shutdown()
"""


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _torchrun():
    found = shutil.which("torchrun")
    if found is None:
        pytest.skip("needs torchrun (installed with torch)")
    return found


def _run(argv, env, timeout=150):
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    return finish(proc, timeout)


def test_a_restarted_torchrun_group_trains_with_the_users_secret(marker):
    # docs/kubernetes.md has PyTorchJob users set HVDLIKE_JOB_SECRET; torchrun's
    # store outlives a restart, and the restarted attempt read the first
    # attempt's records (a dead rank's shared-memory segment, its address).
    script = write_script(marker, "crash_once.py", """
        import os
        import torch
        torch.set_num_threads(1)
        import hvdlike.torch as hvd

        hvd.init()
        restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        hvd.allreduce(torch.ones(1), name="before")
        if restart == 0 and hvd.rank() == 1:
            os._exit(3)
        for i in range(3):
            total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum,
                                  name=f"step{i}").item()
        print(f"attempt={restart} rank={hvd.rank()} sum={total:g}", flush=True)
        hvd.shutdown()
    """)
    env = launcher_env(HVDLIKE_JOB_SECRET=secrets.token_hex(16))
    code, out, err = _run([_torchrun(), "--nproc-per-node", "2", "--master-port", str(_port()),
                           "--max-restarts", "1", script], env)
    assert code == 0, err
    # torchrun passes both ranks' output through one pipe: lines may run together
    assert sorted(re.findall(r"attempt=\d+ rank=\d+ sum=\S+?(?=attempt|$|\s)", out)) == [
        "attempt=1 rank=0 sum=3", "attempt=1 rank=1 sum=3"], out + err


@pytest.mark.parametrize("torch_first", [False, True], ids=["hvdlike-alone", "torch-first"])
def test_env_variables_without_torchrun_start_a_job(marker, torch_first):
    # A PyTorchJob pod running python itself (no torchrun agent to serve the
    # store): rank 0 serves it, as init_process_group("env://") does -- or, when
    # the script called that first, hvdlike uses the store it serves.
    script = write_script(marker, "env.py", ALLREDUCE)
    port = _port()
    procs = []
    for rank in range(2):
        env = launcher_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                           LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port), DELAY0="0.5", HVDLIKE_START_TIMEOUT="30")
        env.pop("TORCHELASTIC_RUN_ID", None)
        if torch_first:
            env["TORCH_FIRST"] = "1"
        procs.append(subprocess.Popen([sys.executable, script], cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      start_new_session=True))
    results = [finish(proc, 90) for proc in procs]
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, err
        assert f"env rank={rank} size=2 local={rank}/2 sum=3" in out, out + err


def test_a_secret_file_left_by_a_killed_rank_0_is_not_taken(marker):
    # Rank 0 SIGKILLed during start-up left its file; the next torchrun on the
    # same port, whose rank 0 comes late, must not take the dead job's secret.
    port = _port()
    tag = f"torchrun/none/0/{port}"
    killed = subprocess.run(
        [sys.executable, "-c", "import os, signal, sys\n"
         "from hvdlike.core import secret_share\n"
         f"secret_share.publish({tag!r}); os.kill(os.getpid(), signal.SIGKILL)"],
        cwd=ROOT, env=launcher_env(), timeout=60)
    assert killed.returncode == -signal.SIGKILL
    assert os.path.exists(secret_share.path_for(tag))
    script = write_script(marker, "late.py", ALLREDUCE)
    code, out, err = _run([_torchrun(), "--nproc-per-node", "2", "--master-port", str(port),
                           script], launcher_env(DELAY0="2", HVDLIKE_START_TIMEOUT="30"))
    assert code == 0, err
    for rank in range(2):
        assert f"env rank={rank} size=2 local={rank}/2 sum=3" in out, out + err
    assert not os.path.exists(secret_share.path_for(tag))


def test_nodes_with_different_rank_counts_get_horovods_cross_ranks(marker):
    # Two torchrun agents (nodes) of 1 and 2 ranks: Horovod's cross rank is the
    # node's index among the nodes that have a rank with the same local rank.
    script = write_script(marker, "cross.py", """
        import torch
        torch.set_num_threads(1)
        import hvdlike.torch as hvd

        hvd.init()
        total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
        print(f"node rank={hvd.rank()} local={hvd.local_rank()}/{hvd.local_size()} "
              f"cross={hvd.cross_rank()}/{hvd.cross_size()} sum={total:g}", flush=True)
        hvd.shutdown()
    """)
    endpoint = f"127.0.0.1:{_port()}"
    env = launcher_env(HVDLIKE_JOB_SECRET=secrets.token_hex(16))
    procs = [subprocess.Popen([_torchrun(), "--nnodes", "2", "--node-rank", str(node),
                               "--nproc-per-node", str(node + 1), "--rdzv-backend", "c10d",
                               "--rdzv-endpoint", endpoint, "--rdzv-id", "cross", script],
                              cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, start_new_session=True)
             for node in range(2)]
    results = [finish(proc, 150) for proc in procs]
    out = "".join(o for _, o, _ in results)
    for code, _, err in results:
        assert code == 0, err
    lines = sorted(re.findall(r"node rank=\d local=\d/\d cross=\d/\d sum=6", out))
    # Which node gets the job's first ranks is the rendezvous' choice.
    alone_first = ["node rank=0 local=0/1 cross=0/2 sum=6",
                   "node rank=1 local=0/2 cross=1/2 sum=6",
                   "node rank=2 local=1/2 cross=0/1 sum=6"]
    pair_first = ["node rank=0 local=0/2 cross=0/2 sum=6",
                  "node rank=1 local=1/2 cross=0/1 sum=6",
                  "node rank=2 local=0/1 cross=1/2 sum=6"]
    assert lines in (alone_first, pair_first), out
