"""Horovod's library options on real ranks: thread affinity, MPI without threads."""

import os
import shutil

import pytest

from .harness import run_mpirun, run_ranks


def _affinity():
    import os

    import torch

    import hvdlike.torch as hvd
    from hvdlike.core import api

    hvd.init()
    background = api.runtime()._thread.native_id
    # Every rank reads its own before any rank may shut the job down.
    cores = sorted(os.sched_getaffinity(background)), sorted(os.sched_getaffinity(0))
    hvd.allreduce(torch.ones(1), name="after.read")
    hvd.shutdown()
    return cores


def test_thread_affinity_pins_each_rank_background_thread_only():
    allowed = sorted(os.sched_getaffinity(0))
    cores = f"{allowed[-1]},{allowed[0]}"  # local rank 0 on the last core, 1 on the first
    results = run_ranks(_affinity, np=2, env={"HOROVOD_THREAD_AFFINITY": cores}, timeout=60)
    assert results[0][0] == [allowed[-1]] and results[1][0] == [allowed[0]], results
    for _, main in results:
        assert main == allowed, results  # the training thread is left alone


def _without_threads():
    import torch

    import hvdlike.torch as hvd
    from hvdlike.core import api

    hvd.init()
    out = (api.runtime().engines, hvd.mpi_threads_supported(),
           hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item())
    hvd.shutdown()
    return out


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (pip install mpich)")
def test_mpi_threads_disable_keeps_negotiation_and_tensors_on_gloo():
    pytest.importorskip("mpi4py", reason="needs mpi4py (pip install 'hvdlike[mpi]')")
    for engines, threads, total in run_mpirun(_without_threads, np=2, timeout=120,
                                              env={"HOROVOD_MPI_THREADS_DISABLE": "1"}):
        assert engines == ("gloo", "gloo") and threads is False and total == 1.0
