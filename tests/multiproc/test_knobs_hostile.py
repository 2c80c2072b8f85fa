"""Knobs set on some ranks only, under a real mpirun."""

import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("mpi4py", reason="needs mpi4py (pip install 'hvdlike[mpi]')")
if shutil.which("mpirun") is None:
    pytest.skip("needs mpirun (pip install mpich)", allow_module_level=True)

from .harness import ROOT, _kill_all  # noqa: E402

RANK_ONE = ("import os\n"
            "if (os.environ.get('PMI_RANK') or os.environ.get('OMPI_COMM_WORLD_RANK')) == '1':\n"
            "    os.environ['HOROVOD_MPI_THREADS_DISABLE'] = '1'\n")


def test_mpi_without_threads_on_one_rank_fails_init_on_every_rank_naming_it(tmp_path):
    # Rank 1 would negotiate on Gloo while rank 0 negotiates on MPI; each then
    # waited for the other's group until a timeout that did not name the cause.
    script = tmp_path / "job.py"
    script.write_text(RANK_ONE + (
        "import time\n"
        "import hvdlike.torch as hvdlike\n"
        "from hvdlike.core.errors import ConfigError\n"
        "started = time.monotonic()\n"
        "try:\n"
        "    hvdlike.init()\n"
        "    print('init passed', flush=True)\n"
        "except ConfigError as exc:\n"
        "    print(f'after {time.monotonic() - started:.0f}s: {exc}', flush=True)\n"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVDLIKE_", "HOROVOD_"))}
    env.update({"PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", ""),
                "OMP_NUM_THREADS": "1", "HVDLIKE_START_TIMEOUT": "20"})
    proc = subprocess.Popen([shutil.which("mpirun"), "-np", "2", sys.executable, str(script)],
                            cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        _kill_all([proc])
        pytest.fail("mpirun did not finish: the job hung")
    finally:
        _kill_all([proc])
    assert "init passed" not in output, output[-3000:]
    lines = [line for line in output.splitlines() if "the ranks disagree" in line]
    assert len(lines) == 2, output[-3000:]  # every rank, with the same message
    assert "HVDLIKE_MPI_THREADS_DISABLE (or HOROVOD_MPI_THREADS_DISABLE): rank 0 False, " \
           "rank 1 True" in output, output[-3000:]
    for line in lines:
        assert int(line.split("after ")[1].split("s:")[0]) < 20, line  # not after a timeout
