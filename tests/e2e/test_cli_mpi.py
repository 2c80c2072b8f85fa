"""hvdlike-run --mpi: the launch handed to mpirun, ranks bootstrapping through mpi4py."""

import shutil

import pytest

from .conftest import run, write_script

pytest.importorskip("mpi4py", reason="needs mpi4py (pip install 'hvdlike[mpi]')")
if shutil.which("mpirun") is None:
    pytest.skip("needs mpirun (pip install 'hvdlike[mpi]')", allow_module_level=True)


def test_mpirun_job_runs_collectives(marker):
    script = write_script(marker, "job.py", """
        import torch
        torch.set_num_threads(1)
        import hvdlike.torch as hvd

        hvd.init()
        total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
        print(f"mpi rank={hvd.rank()} size={hvd.size()} local={hvd.local_rank()} sum={total:g}")
        hvd.shutdown()
    """)
    code, out, err, _ = run(["--mpi", "-np", "2", "--cycle-time-ms", "2", "python", script],
                            timeout=150)
    assert code == 0, err
    for rank in (0, 1):
        assert f"mpi rank={rank} size=2 local={rank} sum=3" in out
