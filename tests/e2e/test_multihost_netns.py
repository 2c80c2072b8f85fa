"""Real multi-host runs: two network namespaces with their own IPs, each running sshd.

The launcher runs in the root namespace and reaches both hosts over ssh; its
rendezvous store listens on the bridge address both hosts route to.
"""

import os
import shutil
import signal
import sys
import textwrap

import pytest

from tests.engines import MPI_ENGINES, mpi_env

from .conftest import (
    TRAINING, finish, kill_session, launcher_env, run, start, wait_ready, wait_until_gone,
)

pytestmark = pytest.mark.netns

COLLECTIVES = """
    import os
    import torch
    torch.set_num_threads(1)
    import hvdlike.torch as hvd

    hvd.init()
    assert hvd.cross_size() == 2, hvd.cross_size()
    total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
    gathered = hvd.allgather(torch.tensor([hvd.rank()])).tolist()
    root = hvd.broadcast(torch.tensor([hvd.rank() * 10.0]), root_rank=2).item()
    print(f"rank={hvd.rank()} size={hvd.size()} local={hvd.local_rank()}/{hvd.local_size()} "
          f"cross={hvd.cross_rank()}/{hvd.cross_size()} host={os.environ['HVDLIKE_HOSTNAME']} "
          f"sum={total:g} gather={gathered} bcast={root:g}")
    # Two hosts of two ranks: allreduce and allgather are hierarchical (auto), on
    # shared memory inside each host and between ranks 0 and 2 across.
    from hvdlike.core import api
    plane = api.runtime().process_sets[0].groups.cpu_plane
    timeline = os.path.join(os.path.dirname(os.path.abspath(__file__)), "timeline.json")
    hvd.start_timeline(timeline)
    ok = True
    n, r = hvd.size(), hvd.rank()
    for dtype in (torch.float32, torch.float64, torch.int32, torch.uint8, torch.bool):
        for op, fold in ((hvd.Sum, sum), (hvd.Max, max), (hvd.Min, min)):
            values = [torch.arange(300001, dtype=torch.int64) % (q + 3) for q in range(n)]
            if dtype == torch.bool:
                values = [v > 1 for v in values]
            got = hvd.allreduce(values[r].to(dtype), op=op)
            want = values[0].to(torch.int64)
            for v in values[1:]:
                want = {sum: want + v, max: torch.maximum(want, v),
                        min: torch.minimum(want, v)}[fold]
            want = want.bool() if dtype == torch.bool else want.to(dtype)
            ok = ok and torch.equal(got, want)
        rows = [torch.full((q + 1, 2), q, dtype=dtype) for q in range(n)]
        ok = ok and torch.equal(hvd.allgather(rows[r]), torch.cat(rows))
    hvd.stop_timeline()
    spans = set()
    if r == 0:
        import json
        with open(timeline) as f:
            spans = {e["name"] for e in json.load(f) if e.get("ph") == "X"}
    phases = {"SHM_REDUCE", "GLOO_CROSS_ALLREDUCE", "SHM_BROADCAST", "GLOO_CROSS_ALLGATHER"}
    print(f"rank={r} plane={type(plane).__name__} correct={ok} "
          f"phases={phases <= spans if r == 0 else '-'}")
    # Every process of the job (ssh clients, sshd sessions, helpers) shares this PID space.
    import psutil
    secret = os.environ["HVDLIKE_JOB_SECRET"]
    leaks = [p.pid for p in psutil.process_iter(["cmdline"]) if secret in " ".join(p.info["cmdline"] or [])]
    print(f"rank={hvd.rank()} secret on command lines: {len(leaks)}")
    hvd.shutdown()
"""



def _script(folder, body):
    path = folder / "job.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_collectives_across_two_hosts(netns_cluster, marker):
    c = netns_cluster
    script = _script(marker, COLLECTIVES)
    code, out, err, _ = run(["-np", "4", "-H", f"{c.ips[0]}:2,{c.ips[1]}:2", *c.ssh_options(),
                             "python", script], timeout=150)
    assert code == 0, err
    expected = {0: (0, 0, c.ips[0]), 1: (1, 0, c.ips[0]), 2: (0, 1, c.ips[1]), 3: (1, 1, c.ips[1])}
    for rank, (local, cross, host) in expected.items():
        assert (f"[{rank}]<stdout>:rank={rank} size=4 local={local}/2 cross={cross}/2 host={host} "
                f"sum=6 gather=[0, 1, 2, 3] bcast=20") in out
        assert f"[{rank}]<stdout>:rank={rank} secret on command lines: 0" in out
        assert (f"[{rank}]<stdout>:rank={rank} plane=HierarchicalGroup correct=True "
                f"phases={True if rank == 0 else '-'}") in out
    assert c.wait_until_clean() == []


def test_remote_rank_killed_mid_run_leaves_nothing_behind(netns_cluster, marker):
    c = netns_cluster
    script = _script(marker, TRAINING)
    proc = start(["-np", "4", "-H", f"{c.ips[0]}:2,{c.ips[1]}:2", "--grace-period-seconds", "2",
                  *c.ssh_options(), "python", script])
    try:
        wait_ready(marker, 4, proc, timeout=120)
        victim = int((marker / "ready.3").read_text())
        assert victim in c.pids(c.namespaces[1])  # rank 3 really runs on the second host
        os.kill(victim, signal.SIGKILL)
        code, out, err = finish(proc, timeout=45)  # issue: everything gone within 45 s
    finally:
        kill_session(proc.pid)
    assert code == 128 + signal.SIGKILL, err
    assert f"rank 3 on host {c.ips[1]} was killed by signal 9 (SIGKILL)" in err
    assert c.wait_until_clean() == []
    assert not wait_until_gone(str(marker))


def test_host_that_does_not_answer_ssh(netns_cluster, marker):
    c = netns_cluster
    code, out, err, _ = run(["-H", f"{c.unused_ip}:1", "--start-timeout", "3",
                                   *c.ssh_options(), "true"], timeout=60)
    assert code != 0 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hvdlike-run: error: host {c.unused_ip}: ")


def test_host_without_hvdlike(netns_cluster, marker):
    c = netns_cluster
    bare = marker / "bare-python"  # an interpreter that cannot see the installed packages
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    bare.chmod(0o755)
    code, out, err, _ = run(["-H", f"{c.ips[0]}:1,{c.ips[1]}:1", "--remote-python", str(bare),
                             *c.ssh_options(), "true"], timeout=60)
    assert code != 0 and "Traceback" not in err
    assert err.startswith("hvdlike-run: error: 2 of 2 hosts failed the pre-flight check:")
    assert err.count("hvdlike is not installed") == 2
    assert c.wait_until_clean() == []


def test_run_api_across_hosts(netns_cluster):
    import hvdlike

    c = netns_cluster

    def where():  # defined here so cloudpickle ships it by value
        import os

        import torch

        torch.set_num_threads(1)
        import hvdlike.torch as hvd

        hvd.init()
        try:
            total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
            return os.environ["HVDLIKE_HOSTNAME"], hvd.cross_rank(), hvd.cross_size(), total
        finally:
            hvd.shutdown()

    results = hvdlike.run(where, np=2, hosts=f"{c.ips[0]}:1,{c.ips[1]}:1",
                          ssh_identity_file=c.key, ssh_options=list(c.SSH_OPTIONS))
    assert results == [(c.ips[0], 0, 2, 2.0), (c.ips[1], 1, 2, 2.0)]
    assert c.wait_until_clean() == []


@pytest.mark.parametrize("engine", MPI_ENGINES)
def test_mpirun_across_two_hosts(netns_cluster, marker, engine):
    env = mpi_env(engine, launcher_env())
    c = netns_cluster
    script = _script(marker, """
        import torch
        torch.set_num_threads(1)
        import hvdlike.torch as hvd

        hvd.init()
        from hvdlike.core import api
        total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
        big = hvd.allreduce(torch.full((1 << 18,), float(hvd.rank())), op=hvd.Sum)
        root = hvd.broadcast(torch.full((1000,), float(hvd.rank())), root_rank=3)
        ok = bool((big == 6).all()) and bool((root == 3).all())
        print(f"mpi rank={hvd.rank()} local={hvd.local_rank()} "
              f"cross={hvd.cross_rank()}/{hvd.cross_size()} sum={total:g} big={ok} "
              f"engines={'+'.join(api.runtime().engines)}")
        hvd.shutdown()
    """)
    if engine == "mpich":
        # The namespaces share one host name: tell Hydra which interface reaches them.
        mpi_args = f"-iface {c.bridge}"
    else:
        # The namespaces share one host name, so Open MPI takes them for one node: keep its
        # byte transfer to TCP and leave out HAN, its node-aware collectives, which stall here.
        mpi_args = "--mca btl tcp,self --mca btl_tcp_if_include eth0 --mca coll ^han"
    code, out, err, _ = run(["--mpi", "-np", "4", "-H", f"{c.ips[0]}:2,{c.ips[1]}:2",
                             f"--mpi-args={mpi_args}", *c.ssh_options(), "python", script],
                            timeout=150, env=env)
    assert code == 0, err
    for rank in range(4):
        # Negotiation and CPU tensors ride MPI across the two hosts.
        assert (f"mpi rank={rank} local={rank % 2} cross={rank // 2}/2 sum=6 big=True "
                f"engines=mpi+mpi") in out
    assert c.wait_until_clean() == []


SLEEPER = """
    import os, time
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "ready." + os.environ["HVDLIKE_RANK"]), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "launcher-killed"])
def test_stopping_the_launcher_ends_ranks_on_every_host(netns_cluster, marker, sig):
    c = netns_cluster
    script = _script(marker, SLEEPER)
    proc = start(["-np", "4", "-H", f"{c.ips[0]}:2,{c.ips[1]}:2", "--grace-period-seconds", "2",
                  *c.ssh_options(), "python", script])
    try:
        wait_ready(marker, 4, proc, timeout=90)
        proc.send_signal(sig)
        code, out, err = finish(proc, timeout=30)
    finally:
        kill_session(proc.pid)
    assert code == (130 if sig == signal.SIGINT else -signal.SIGKILL), err
    assert c.wait_until_clean() == []
    assert not wait_until_gone(str(marker))
