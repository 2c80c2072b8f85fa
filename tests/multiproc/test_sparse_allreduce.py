"""sparse_allreduce_async on real ranks against the dense sum."""

from tests.multiproc.harness import run_ranks


def _rows(rank):
    import torch

    # Ranks touch overlapping rows, and different numbers of them.
    rows = {0: [0], 1: [1, 0], 2: [2, 5, 0]}[rank]
    vals = torch.arange(1, 1 + 3 * len(rows), dtype=torch.float32).reshape(len(rows), 3)
    return torch.sparse_coo_tensor(torch.tensor([rows]), vals * (rank + 1), (6, 3))


def _sparse():
    import torch

    import hvdlike.torch as hvd
    from tests.multiproc.test_sparse_allreduce import _rows

    torch.set_num_threads(1)
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    dense_sum = sum(_rows(i).to_dense() for i in range(n))
    out = {}
    avg = hvd.synchronize(hvd.sparse_allreduce_async(_rows(r), name="emb", op=hvd.Average))
    out["avg_sparse"] = avg.layout == torch.sparse_coo
    out["avg"] = torch.allclose(avg.to_dense(), dense_sum / n)
    # as in Horovod: every rank's entries in rank order, not coalesced
    out["layout"] = (avg.is_coalesced(), avg._indices()[0].tolist())
    handle = hvd.sparse_allreduce_async(_rows(r), "emb.sum", hvd.Sum)
    total = handle()  # Horovod's handle is a callable
    out["sum"] = torch.allclose(total.to_dense(), dense_sum)
    try:
        hvd.sparse_allreduce_async(_rows(r), "bad", hvd.Max)
    except ValueError as exc:
        out["bad_op"] = str(exc)
    try:
        hvd.sparse_allreduce_async(torch.ones(2), "dense", hvd.Sum)
    except TypeError as exc:
        out["dense"] = str(exc)
    hvd.barrier()
    hvd.shutdown()
    return out


def test_sparse_allreduce_three_ranks():
    for out in run_ranks(_sparse, np=3, timeout=90):
        assert out["avg_sparse"] and out["avg"] and out["sum"]
        assert out["layout"] == (False, [0, 1, 0, 2, 5, 0]), out["layout"]
        assert "Average or Sum" in out["bad_op"]
        assert "sparse COO" in out["dense"]
