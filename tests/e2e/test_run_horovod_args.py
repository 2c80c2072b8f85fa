"""hvdlike.run called as horovod.run: hostfile, output files, the response-cache switch,
the interpreter, mpirun, and elastic jobs whose size changes while they run."""

import os
import sys

import pytest

import hvdlike
from hvdlike.launcher.api import RankError

from .. import engines


def _allreduce_rank_sum(scale):
    import torch

    torch.set_num_threads(1)
    import hvdlike.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
    return hvd.rank(), hvd.size(), total * scale


def _report_environment():
    print(f"hello from rank {os.environ['HVDLIKE_RANK']}", flush=True)
    return (os.environ.get("HVDLIKE_CACHE_CAPACITY"), os.environ.get("HVDLIKE_GLOO_IFACE"),
            sys.executable)


def test_a_horovod_run_call_runs_unchanged():
    # pytorch_mnist.py's own call, with its defaults for hosts and communication.
    results = hvdlike.run(_allreduce_rank_sum, args=(2,), num_proc=2, hosts=None,
                          use_gloo=True, use_mpi=False)
    assert results == [(0, 2, 2.0), (1, 2, 2.0)]


def test_hostfile_output_filename_disable_cache_interfaces_and_executable(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    logs = tmp_path / "logs"
    results = hvdlike.run(_report_environment, hostfile=str(hostfile), output_filename=str(logs),
                          disable_cache=True, network_interfaces=["lo"],
                          executable=sys.executable)
    # disable_cache is horovodrun's launcher-side cache of host checks: the
    # ranks' response cache stays on (no capacity variable set).
    assert results == [(None, "lo", sys.executable)] * 2
    for rank in (0, 1):
        with open(logs / f"rank.{rank}" / "stdout") as handle:
            assert f"hello from rank {rank}" in handle.read()


def _mpi_rank():
    import torch

    torch.set_num_threads(1)
    import hvdlike.torch as hvd

    leaked = [k for k in os.environ if k.startswith("HVDLIKE_RUN_")]
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    mpi_rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK"))
    print(f"hello from MPI rank {mpi_rank}", flush=True)
    return hvd.rank(), int(mpi_rank), total, leaked


@pytest.mark.parametrize("engine", ["mpich", "openmpi"])
def test_use_mpi_starts_the_ranks_with_mpirun_and_writes_each_ranks_output(
        engine, tmp_path, monkeypatch):
    env = engines.mpi_env(engine)
    monkeypatch.setenv("PATH", env["PATH"])
    # output_filename is applied under MPICH's mpirun only (Open MPI's own
    # option lays files out differently, so hvdlike-run leaves it to mpi_args).
    logs = tmp_path / "logs"
    output = {"output_filename": str(logs)} if engine == "mpich" else {}
    results = hvdlike.run(_mpi_rank, num_proc=2, use_mpi=True, mpi_args=[], **output)
    assert results == [(0, 0, 3.0, []), (1, 1, 3.0, [])], f"ranks started by mpirun: {results}"
    for rank in (0, 1) if output else ():
        with open(logs / f"rank.{rank}" / "stdout") as handle:
            assert f"hello from MPI rank {rank}" in handle.read(), f"output file of rank {rank}"


def _mpi_rank_one_raises():
    if os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK")) == "1":
        raise KeyError("no such shard")
    return "ok"


def test_use_mpi_names_the_rank_that_raised():
    env = engines.mpi_env("mpich")
    os.environ["PATH"], old = env["PATH"], os.environ["PATH"]
    try:
        with pytest.raises(RankError, match=r"rank 1 \(host localhost\) raised KeyError: "
                                            r"'no such shard'") as info:
            hvdlike.run(_mpi_rank_one_raises, num_proc=2, use_mpi=True)
    finally:
        os.environ["PATH"] = old
    assert isinstance(info.value.__cause__, KeyError)


def test_an_elastic_run_returns_the_results_of_the_generation_that_completed():
    # Three slots for two ranks: the launcher grows the job to three while the
    # function runs. Either the first two ranks complete before the third could
    # join (their results), or all three run it (theirs): one generation's
    # results, every rank of it, in rank order.
    results = hvdlike.run(_allreduce_rank_sum, args=(1,), num_proc=2, min_num_proc=2,
                          max_num_proc=3, hosts="localhost:3")
    size = len(results)
    assert size in (2, 3), results
    assert results == [(rank, size, float(sum(range(size)))) for rank in range(size)]


def _elastic_training():
    import torch

    torch.set_num_threads(1)
    import hvdlike.torch as hvd

    hvd.init()
    state = hvd.elastic.ObjectState(step=0, sums=[])

    @hvd.elastic.run
    def train(state):
        while state.step < 4:
            if (os.environ["HVDLIKE_ELASTIC_GENERATION"] == "1" and hvd.rank() == 2
                    and state.step == 2):
                os._exit(5)  # this rank's host fails mid-training
            total = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
            state.sums.append(int(total))
            state.step += 1
            state.commit()
        return hvd.rank(), hvd.size(), state.sums

    return train(state)


def test_an_elastic_run_carries_on_after_a_rank_is_lost():
    results = hvdlike.run(_elastic_training, num_proc=3, min_num_proc=2,
                          hosts="127.0.0.1:1,127.0.0.2:1,127.0.0.3:1",
                          env={"HVDLIKE_GLOO_TIMEOUT_SECONDS": "10"})
    assert [r[:2] for r in results] == [(0, 2), (1, 2)], results
    sums = {tuple(r[2]) for r in results}
    assert len(sums) == 1, results
    (steps,) = sums
    assert len(steps) == 4 and steps[:2] == (3, 3) and steps[-1] == 2, results


def _raises_everywhere():
    raise RuntimeError("bad configuration")


def test_an_elastic_run_whose_function_raises_names_the_error():
    with pytest.raises(RankError, match=r"raised RuntimeError: bad configuration"):
        hvdlike.run(_raises_everywhere, num_proc=2, min_num_proc=2, hosts="localhost:2")
