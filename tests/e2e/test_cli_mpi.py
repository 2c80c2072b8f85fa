"""hvdlike-run --mpi under MPICH and Open MPI, and a plain Open MPI mpirun.

The ranks bootstrap through mpi4py; the same test runs under each MPI (see
``tests/engines.py`` for how both are installed side by side).
"""

import os

import pytest

from tests.engines import MPI_ENGINES, mpi_env

from .conftest import ROOT, finish, launcher_env, run, write_script

JOB = """
    import torch
    torch.set_num_threads(1)
    import hvdlike.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    print(f"mpi rank={hvd.rank()} size={hvd.size()} local={hvd.local_rank()} sum={total:g}")
    hvd.shutdown()
"""


@pytest.mark.parametrize("engine", MPI_ENGINES)
def test_mpirun_job_runs_collectives(marker, engine):
    env = mpi_env(engine, launcher_env())
    script = write_script(marker, "job.py", JOB)
    code, out, err, _ = run(["--mpi", "-np", "2", "--cycle-time-ms", "2", "python", script],
                            timeout=150, env=env)
    assert code == 0, err
    for rank in (0, 1):
        assert f"mpi rank={rank} size=2 local={rank} sum=3" in out
    if engine == "openmpi" and os.geteuid() == 0:
        assert "passing --allow-run-as-root to Open MPI's mpirun" in err


def _plain_mpirun(engine, script, timeout):
    """``mpirun -np 2 python script`` of ``engine``, no hvdlike launcher: (code, out, err)."""
    import subprocess

    env = mpi_env(engine, launcher_env())
    env.pop("MPI4PY_LIBMPI", None)
    argv = ["mpirun", "-np", "2"] + (["--allow-run-as-root"]
                                     if engine == "openmpi" and os.geteuid() == 0 else [])
    proc = subprocess.Popen(argv + ["python", script], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    return finish(proc, timeout=timeout)


def test_plain_open_mpi_mpirun_bootstraps_from_ompi_variables(marker):
    """``mpirun -np 2 python train.py`` with no hvdlike launcher: ranks read OMPI_*."""
    code, out, err = _plain_mpirun("openmpi", write_script(marker, "job.py", JOB), 150)
    assert code == 0, err
    for rank in (0, 1):
        assert f"mpi rank={rank} size=2 local={rank} sum=3" in out


FORKS = """
    import os, sys
    import torch
    torch.set_num_threads(1)
    import hvdlike.torch as hvd

    hvd.init()
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a child leaving like any Python program: its exit hooks run
    os.waitpid(pid, 0)
    total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
    print(f"rank={hvd.rank()} reaped its child, sum={total:g}", flush=True)
"""


@pytest.mark.parametrize("engine", MPI_ENGINES)
def test_a_child_forked_after_init_exits_without_finalizing_the_parents_mpi(marker, engine):
    """mpi4py's exit hook finalized MPI in the child too: Open MPI's job hung
    (the children spun on, orphaned), MPICH's exited 15 after succeeding."""
    code, out, err = _plain_mpirun(engine, write_script(marker, "forks.py", FORKS), 60)
    assert code == 0, err
    for rank in (0, 1):
        assert f"rank={rank} reaped its child, sum=2" in out


CLEAN = """
    import torch
    torch.set_num_threads(1)
    import hvdlike.torch as hvd

    hvd.init()
    rank = hvd.rank()
    for i in range(20):
        hvd.allreduce(torch.ones(10), name=f"a{i}")
    hvd.shutdown()
    print(f"rank={rank} clean", flush=True)
"""


@pytest.mark.parametrize("engine", MPI_ENGINES)
def test_a_clean_mpirun_job_ends_without_store_connection_warnings(marker, engine):
    """Under mpirun rank 0 hosts the store: it used to drop it under ranks still
    closing, whose stderr filled with torch's "Broken pipe ... Did the remote
    server shutdown or crash?" warnings and C++ frames (4 runs of 5)."""
    script = write_script(marker, "clean.py", CLEAN)
    for _ in range(3):
        code, out, err = _plain_mpirun(engine, script, 60)
        assert code == 0, err
        assert "rank=0 clean" in out and "rank=1 clean" in out
        for noise in ("recvValue failed", "Broken pipe", "Connection was likely closed"):
            assert noise not in err, err
