import torch

from tests.multiproc.harness import run_ranks


def _basic():
    import hvdlike.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {
        "sum": hvd.allreduce(torch.full((3,), float(r + 1)), op=hvd.Sum).tolist(),
        "gather": hvd.allgather(torch.full((r + 1, 2), float(r))).tolist(),
        "bcast": hvd.broadcast(torch.arange(3) * (r + 1), root_rank=1).tolist(),
    }
    hvd.shutdown()
    return out


def test_basic_two_ranks():
    res = run_ranks(_basic, np=2, timeout=60)
    for out in res:
        assert out["sum"] == [3.0, 3.0, 3.0]
        assert out["gather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert out["bcast"] == [0, 2, 4]
