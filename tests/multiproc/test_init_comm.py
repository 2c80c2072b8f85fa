"""``init(comm=...)`` and ``ProcessSet(mpi_comm)``: runtimes on part of the launched ranks.

Horovod's ``init(comm=[ranks])`` runs on the listed ranks only, renumbered in
the list's order; an mpi4py communicator does the same under mpirun, and a
``ProcessSet`` made from a communicator registers the sets of every rank's
communicator. Real ranks on loopback (the harness, like hvdlike-run) and
under a real mpirun.
"""

import shutil

import pytest

from .harness import run_mpirun, run_ranks

# Launched rank -> the list it passes: ranks 2 and 0 form one runtime (2 is its
# rank 0), rank 1 runs alone.
LISTS = {0: [2, 0], 1: [1], 2: [2, 0]}


def _split_worlds(lists):
    import os

    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    launched = int(os.environ["HVDLIKE_RANK"])
    hvd.init(comm=lists[launched])
    out = {"rank": hvd.rank(), "size": hvd.size(), "local": (hvd.local_rank(), hvd.local_size()),
           "env": os.environ["HOROVOD_RANK"]}
    out["sum"] = hvd.allreduce(torch.tensor([float(launched)]), op=hvd.Sum).item()
    out["gathered"] = hvd.allgather(torch.tensor([launched])).tolist()
    out["root"] = hvd.broadcast(torch.tensor([launched]), root_rank=0).item()
    out["objects"] = hvd.allgather_object(launched)
    hvd.shutdown()
    # Afterwards every launched rank meets in one runtime again.
    hvd.init()
    out["after"] = (hvd.rank(), hvd.size(),
                    hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item())
    hvd.shutdown()
    return out


def test_listed_ranks_form_their_own_runtime_numbered_in_list_order():
    results = run_ranks(_split_worlds, np=3, args=(LISTS,), timeout=90)
    pair = {"size": 2, "sum": 2.0, "gathered": [2, 0], "root": 2, "objects": [2, 0],
            "local": None}
    for launched, out in enumerate(results):
        assert out["after"] == (launched, 3, 3.0), out
        if launched == 1:
            assert (out["rank"], out["size"], out["sum"], out["gathered"]) == (0, 1, 1.0, [1])
            continue
        expected_rank = LISTS[launched].index(launched)
        assert out["rank"] == expected_rank and out["env"] == str(expected_rank), out
        assert out["local"] == (expected_rank, 2), out  # both on this host
        for key, value in pair.items():
            if value is not None:
                assert out[key] == value, (key, out)


def _mismatch():
    import os

    import hvdlike.torch as hvd

    launched = int(os.environ["HVDLIKE_RANK"])
    lists = {0: [0, 1], 1: [1, 2], 2: [1, 2], 3: [3]}
    try:
        hvd.init(comm=lists[launched])
    except ValueError as exc:
        return ("ValueError", str(exc))
    size = hvd.size()
    hvd.shutdown()
    return ("ok", size)


def test_members_that_pass_different_lists_are_named_without_waiting_out_the_timeout():
    results = run_ranks(_mismatch, np=3, timeout=60,
                        env={"HVDLIKE_START_TIMEOUT": "40"})
    kind, message = results[0]
    assert kind == "ValueError", results
    assert "rank 1 called init(comm=[1, 2])" in message and "init(comm=[0, 1])" in message
    assert results[1] == ("ok", 2) and results[2] == ("ok", 2), results


def _bad_lists():
    import os

    import hvdlike.torch as hvd

    launched = int(os.environ["HVDLIKE_RANK"])
    found = {}
    for label, comm in (("outsider", [1]), ("too big", [0, 1, 5]), ("repeated", [0, 0]),
                        ("negative", [-1]), ("bool", [True]), ("string", "01"),
                        ("number", 3)):
        try:
            hvd.init(comm=comm)
        except (TypeError, ValueError) as exc:
            found[label] = f"{type(exc).__name__}: {exc}"
        else:
            found[label] = f"initialized as {hvd.rank()}/{hvd.size()}"
            hvd.shutdown()
    return found


def test_lists_that_cannot_work_are_refused_with_what_is_wrong():
    results = run_ranks(_bad_lists, np=2, timeout=60)
    found = results[0]
    assert "does not include this process (rank 0" in found["outsider"], found
    assert "names rank(s) [5]" in found["too big"], found
    assert found["repeated"].startswith("ValueError") and "more than once" in found["repeated"]
    assert found["negative"].startswith("ValueError") and "-1" in found["negative"]
    assert found["bool"].startswith("ValueError") and "True" in found["bool"]
    assert found["string"].startswith("TypeError") and "str" in found["string"]
    assert found["number"].startswith("TypeError") and "int" in found["number"]
    # Rank 1 passed [1] where rank 0 was refused: it runs alone.
    assert results[1]["outsider"] == "initialized as 0/1", results[1]


def _communicator_outside_mpirun():
    import hvdlike.torch as hvd

    try:
        from mpi4py import MPI
    except ImportError:
        return "no mpi4py"
    try:
        hvd.init(comm=MPI.COMM_SELF)
    except ValueError as exc:
        return str(exc)
    return "initialized"


def test_a_communicator_outside_mpirun_is_refused():
    pytest.importorskip("mpi4py", reason="needs mpi4py (pip install 'hvdlike[mpi]')")
    for message in run_ranks(_communicator_outside_mpirun, np=2, timeout=60):
        assert "was not started by mpirun" in message and "list of ranks" in message, message


def _comm_set_outside_mpirun():
    from mpi4py import MPI

    import hvdlike.torch as hvd

    try:
        hvd.init(process_sets=[hvd.ProcessSet(MPI.COMM_SELF)])
    except ValueError as exc:
        return str(exc)
    hvd.shutdown()
    return "initialized"


def test_a_communicator_process_set_outside_mpirun_fails_every_rank():
    pytest.importorskip("mpi4py", reason="needs mpi4py (pip install 'hvdlike[mpi]')")
    for message in run_ranks(_comm_set_outside_mpirun, np=2, timeout=60):
        assert "process_sets[0] is made from an MPI communicator" in message, message
        assert "rank 0" in message and "rank 1" in message, message


# -- under mpirun --------------------------------------------------------------


def _under_mpirun():
    import torch
    from mpi4py import MPI

    import hvdlike.torch as hvd
    from hvdlike.core import api

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    me = world.Get_rank()
    out = {}
    # A communicator: launched ranks 0 and 1 together, 2 alone.
    sub = world.Split(color=int(me == 2), key=me)
    hvd.init(comm=sub)
    out["split"] = (hvd.rank(), hvd.size(), api.runtime().engines,
                    hvd.allreduce(torch.tensor([float(me)]), op=hvd.Sum).item(),
                    hvd.global_process_set.mpi_comm is sub)
    hvd.shutdown()
    # A list, in an order other than COMM_WORLD's.
    hvd.init(comm=[2, 0] if me != 1 else [1])
    out["list"] = (hvd.rank(), hvd.size(), api.runtime().engines,
                   hvd.allgather(torch.tensor([me])).tolist())
    hvd.shutdown()
    # Sets from communicators: each rank passes its own; all are registered.
    pair = world.Split(color=int(me == 2), key=me)
    mine, first = hvd.ProcessSet(pair), hvd.ProcessSet([0])
    before = (mine.ranks, mine.included(), mine.size())
    hvd.init(process_sets=[first, mine])
    out["sets"] = (before, mine.ranks, mine.process_set_id, first.process_set_id,
                   api.runtime().sets.ranks,
                   hvd.allreduce(torch.tensor([float(me)]), op=hvd.Sum,
                                 process_set=mine).item())
    try:
        hvd.add_process_set(hvd.ProcessSet(pair))
    except NotImplementedError as exc:
        out["dynamic"] = str(exc)
    hvd.barrier()  # shutdown() on one rank ends the job: not while a set still reduces
    hvd.shutdown()
    # The same objects again after a shutdown (their ranks are known by now).
    hvd.init(process_sets=[first, mine])
    out["again"] = (mine.process_set_id, api.runtime().sets.ranks,
                    hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, process_set=mine).item())
    hvd.barrier()
    hvd.shutdown()
    return out


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (pip install mpich)")
def test_under_mpirun_communicators_and_lists_make_runtimes_and_sets():
    pytest.importorskip("mpi4py", reason="needs mpi4py (pip install 'hvdlike[mpi]')")
    results = run_mpirun(_under_mpirun, np=3, timeout=150)
    for me, out in enumerate(results):
        rank, size, engines, total, kept = out["split"]
        if me == 2:
            assert (rank, size, total) == (0, 1, 2.0), out
        else:
            assert (rank, size, total) == (me, 2, 1.0) and engines == ("mpi", "mpi"), out
        assert kept, out
        rank, size, engines, gathered = out["list"]
        if me == 1:
            assert (rank, size, gathered) == (0, 1, [1]), out
        else:
            assert (rank, size, gathered) == ([2, 0].index(me), 2, [2, 0]), out
            assert engines == ("mpi", "mpi"), out
        before, ranks, set_id, first_id, table, total = out["sets"]
        assert before == (None, None, None), out
        # Horovod's ids: communicators' sets first (sorted), then the listed ones.
        assert table == {0: [0, 1, 2], 1: [0, 1], 2: [2], 3: [0]}, out
        assert ranks == ([2] if me == 2 else [0, 1]) and first_id == 3, out
        assert set_id == (2 if me == 2 else 1), out
        assert total == (2.0 if me == 2 else 1.0), out
        assert "only be registered by init" in out["dynamic"], out
        assert out["again"] == (set_id, table, float(len(ranks))), out
