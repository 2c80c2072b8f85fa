"""Real Slurm: ranks started by ``srun``, and ``hvdlike-run`` inside an allocation.

A one-host cluster (munged, slurmctld, slurmd; see ``tests/slurm.py``) is started
for this module and stopped after it; the tests skip with the reason when it
cannot start here (not root, ``slurm-wlm``/``munge`` not installed...).
"""

import os
import subprocess
import sys
import time

import pytest

from .conftest import ROOT, finish, launcher_argv, launcher_env, write_script

JOB = """
    import os
    import psutil
    import torch
    torch.set_num_threads(1)
    import hvdlike.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    print(f"slurm rank={hvd.rank()} size={hvd.size()} local={hvd.local_rank()}/{hvd.local_size()} "
          f"cross={hvd.cross_rank()}/{hvd.cross_size()} sum={total:g} "
          f"job={os.environ.get('SLURM_JOB_ID')} "
          f"stepd={any(p.name() == 'slurmstepd' for p in psutil.Process().parents())}",
          flush=True)
    hvd.shutdown()
"""


@pytest.fixture(scope="module")
def slurm_cluster():
    from tests import slurm

    reason = slurm.why_unavailable()
    if reason:
        print(f"Slurm tests skipped: {reason}")
        pytest.skip(f"Slurm tests skipped: {reason}")
    try:
        cluster = slurm.Cluster().setup()
    except slurm.Unavailable as exc:
        print(f"Slurm tests skipped: the cluster did not start: {exc}")
        pytest.skip(f"Slurm tests skipped: the cluster did not start: {exc}")
    try:
        yield cluster
    finally:
        cluster.teardown()


def _run(argv, env, timeout=120):
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    return finish(proc, timeout)


def _sum(n):
    return n * (n + 1) // 2


def test_srun_four_tasks_bootstrap_from_slurm_variables(slurm_cluster, marker):
    script = write_script(marker, "job.py", JOB)
    env = slurm_cluster.env(launcher_env())
    code, out, err = _run(["srun", "-n", "4", "--kill-on-bad-exit=1", sys.executable, script],
                          env)
    assert code == 0, err
    for rank in range(4):
        assert f"slurm rank={rank} size=4 local={rank}/4 cross=0/1 sum={_sum(4)}" in out, out


def test_hvdlike_run_inside_salloc_takes_hosts_from_the_allocation(slurm_cluster, marker):
    script = write_script(marker, "job.py", JOB)
    env = slurm_cluster.env(launcher_env())
    code, out, err = _run(["salloc", "-n", "3", *launcher_argv(), "--verbose", sys.executable,
                           script], env)
    assert code == 0, err
    node = slurm_cluster.node
    assert f"hosts {node}:3, ranks started with srun" in err
    job_ids = set()
    for rank in range(3):
        line = next(l for l in out.splitlines() if f"slurm rank={rank} " in l)
        assert f"size=3 local={rank}/3 cross=0/1 sum={_sum(3)}" in line, out
        job_ids.add(line.split("job=")[1].split()[0])
        # Each rank runs in a job step of the allocation (under slurmstepd), not beside it.
        assert "stepd=True" in line, line
    assert len(job_ids) == 1 and job_ids != {"None"}, out
    # This cluster binds nothing (task/none): no --cpu-bind for srun to refuse per rank.
    assert "cpu binding" not in err, err


def test_hvdlike_run_in_sbatch_script_and_a_failing_rank(slurm_cluster, marker):
    # One job shows both: every rank trains (hosts from the allocation), then rank 1 fails.
    job = write_script(marker, "job.py", JOB + """
    import sys, time
    if os.environ["HVDLIKE_RANK"] == "1":
        sys.exit(7)
    time.sleep(60)  # rank 0 is stopped when rank 1 fails
    """)
    batch = write_script(marker, "batch.sh", f"""\
        #!/bin/sh
        {' '.join(launcher_argv())} {sys.executable} {job}
        echo "job exit=$?"
    """)
    output = os.path.join(str(marker), "batch.out")
    env = slurm_cluster.env(launcher_env())
    code, out, err = _run(["sbatch", "--parsable", "-n", "2", f"--output={output}", batch], env)
    assert code == 0, err
    job = out.strip().split(";")[0]
    # Poll the queue briskly (sbatch --wait backs off to several seconds between checks).
    deadline = time.monotonic() + 150
    while _run(["squeue", "-h", "-j", job], env)[1].strip():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=env, timeout=30)
            pytest.fail(f"batch job {job} did not end within 150s")
        time.sleep(0.5)
    with open(output) as handle:
        log = handle.read()
    for rank in range(2):
        line = next((l for l in log.splitlines() if f"slurm rank={rank} " in l), "")
        assert f"size=2 local={rank}/2 cross=0/1 sum=3" in line, log
        assert "stepd=True" in line, line
    assert "job exit=7" in log, log
    assert "rank 1" in log and "exit" in log, log


def test_srun_ranks_split_by_init_comm_leave_no_secret_file(slurm_cluster, marker):
    # Under srun on one host rank 0 shares the job secret through a file in
    # /dev/shm; a job whose ranks split with init(comm=[...]) kept it after a
    # clean run. The other list's rank may start after rank 0's runtime closed
    # (here: 2 s late, while rank 0's process lingers): it still needs the file.
    script = write_script(marker, "subset.py", """
        import os, time
        import torch
        torch.set_num_threads(1)
        import hvdlike.torch as hvd
        from hvdlike.core import secret_share

        r = int(os.environ["SLURM_PROCID"])
        if r == 2:
            time.sleep(2)
        hvd.init(comm=[0, 1] if r < 2 else [2])
        total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
        tag = f"srun/{os.environ['SLURM_JOB_ID']}/{os.environ['SLURM_STEP_ID']}"
        print(f"subset rank={r} sum={total:g} file={secret_share.path_for(tag)}", flush=True)
        hvd.shutdown()
        if r == 0:
            time.sleep(5)  # rank 0's store serves rank 2 as long as its process runs
    """)
    env = slurm_cluster.env(launcher_env())
    code, out, err = _run(["srun", "-n", "3", "--kill-on-bad-exit=1", sys.executable, script],
                          env)
    assert code == 0, err
    lines = sorted(l for l in out.splitlines() if l.startswith("subset rank="))
    assert [l.split(" file=")[0] for l in lines] == [
        "subset rank=0 sum=2", "subset rank=1 sum=2", "subset rank=2 sum=1"], out
    (path,) = {l.split(" file=")[1] for l in lines}
    assert path.startswith(("/dev/shm/hvdlike-secret-", "/tmp/hvdlike-secret-")), path
    assert not os.path.exists(path), f"{path} left behind"
