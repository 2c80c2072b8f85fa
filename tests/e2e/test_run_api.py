"""hvdlike.run(fn): results per rank, errors naming the rank, refused payloads."""

import os

import pytest

import hvdlike
from hvdlike.launcher.api import TASK_MODULE, RankError
from hvdlike.launcher.hosts import HostSlots
from hvdlike.launcher.job import Job
from hvdlike.launcher.launch_config import LaunchConfig
from hvdlike.launcher.monitor import Output
from hvdlike.launcher.payload import PAYLOAD_KEY, seal

from .conftest import launcher_env


def _allreduce_rank_sum(scale):
    import torch

    torch.set_num_threads(1)
    import hvdlike.torch as hvd

    hvd.init()
    try:
        total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
        return hvd.rank(), hvd.size(), total * scale
    finally:
        hvd.shutdown()


def _fails_on_rank_one():
    if os.environ["HVDLIKE_RANK"] == "1":
        raise ValueError("shard 1 is corrupt")
    return "fine"


def test_run_returns_results_in_rank_order():
    assert hvdlike.run(_allreduce_rank_sum, args=(10,), np=2) == [(0, 2, 10.0), (1, 2, 10.0)]


def test_exception_on_a_rank_is_raised_naming_it():
    with pytest.raises(RankError, match=r"rank 1 \(host localhost\) raised ValueError: shard 1 is corrupt") as info:
        hvdlike.run(_fails_on_rank_one, np=2)
    assert info.value.rank == 1
    assert isinstance(info.value.__cause__, ValueError)
    assert "_fails_on_rank_one" in info.value.remote_traceback


def test_rank_dying_without_result_is_named():
    with pytest.raises(RankError, match=r"rank 0 \(host localhost\) was killed by signal 9"):
        hvdlike.run(lambda: os.kill(os.getpid(), 9), np=1)


@pytest.mark.parametrize("forge", ["wrong secret"])  # tampering: tests/unit/test_launcher_payload.py
def test_forged_payload_is_refused_by_every_rank(forge, capsys):
    import sys

    config = LaunchConfig(command=[sys.executable, "-m", TASK_MODULE],
                          hosts=[HostSlots("localhost", 2)], np=2, environ=launcher_env())
    job = Job(config, output=Output())
    with job:
        if forge == "wrong secret":
            blob = seal("not-the-job-secret", "payload", (print, ("pwned",), {}))
        else:
            blob = bytearray(seal(job.secret, "payload", (print, ("hello",), {})))
            blob[-3] ^= 1
            blob = bytes(blob)
        job.store.client().set(PAYLOAD_KEY, blob)
        result = job.run()
    err = capsys.readouterr().err
    assert result.exit_code == 3
    assert "refused its payload" in err and "authentication failed" in err
    assert "pwned" not in err


def _rank_one_leaves_without_a_word():
    import torch

    torch.set_num_threads(1)
    import hvdlike.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        os._exit(0)
    return hvd.allreduce(torch.ones(1)).item()


def test_the_rank_that_left_is_named_not_the_peer_it_stranded():
    # Rank 0's own error (its peer died) is a consequence; rank 1 is the cause.
    with pytest.raises(RankError, match=r"rank 1 \(host localhost\) exited with code 0 "
                                        r"without a result") as info:
        hvdlike.run(_rank_one_leaves_without_a_word, np=2)
    assert info.value.rank == 1


def test_closures_kwargs_big_blobs_and_knobs_reach_the_ranks():
    # Three independent checks of one job, each with its own message:
    # - a closure ships with its kwargs;
    # - the store refuses a message above 8 MiB, so an argument and a result
    #   that are bigger travel in pieces;
    # - knobs given by field reach the ranks in the unit of their variable.
    offset = 100
    big = bytes(range(256)) * (40 << 12)  # 10 MiB

    def on_rank(data, a, b=0):
        return (int(os.environ["HVDLIKE_RANK"]) + a + b + offset, data[::-1] + b"!",
                (os.environ.get("HVDLIKE_SHM"), os.environ.get("HVDLIKE_FUSION_THRESHOLD")))

    results = hvdlike.run(on_rank, args=(big, 1), kwargs={"b": 2}, np=2,
                          knobs={"shm": False, "fusion_threshold": 4096})
    assert len(results) == 2, "one result per rank"
    assert [r[0] for r in results] == [103, 104], \
        f"closure and kwargs: {[r[0] for r in results]}"
    assert [r[1] == big[::-1] + b"!" for r in results] == [True, True], \
        f"big blobs: lengths {[len(r[1]) for r in results]}"
    assert [r[2] for r in results] == [("0", "4096")] * 2, f"knobs: {[r[2] for r in results]}"
