"""Min and max of floating tensors holding NaN, on real ranks: one rule on every plane.

torch's rule: an element is NaN when any rank's element is NaN, otherwise the
true min/max. Checked on three ranks on the shared-memory plane, on flat Gloo
(``HVDLIKE_SHM=0``) and hierarchically (ranks 0, 1 on "host A", rank 2 on
"host B", simulated on one machine as in ``test_shm_hierarchy.py``), and on
two ranks under mpirun when it is there. Where both zeros occur, every plane
but the shared-memory one returns -0.0 for min and +0.0 for max; torch, and so
that plane, may return either.
"""

import shutil

import pytest
import torch

from tests.multiproc.harness import run_mpirun, run_ranks

DTYPES = ["float32", "float64", "float16", "bfloat16"]
OPS = ["Min", "Max"]
NAN = float("nan")
INF = float("inf")


def _columns(rank, size):
    """Rank ``rank``'s row: every column a case, each rank holding ``rank - 10``
    where the case leaves it alone."""
    row = [float(rank - 10)] * (size + 6)
    row[rank] = NAN  # column j: NaN on rank j alone
    # column size: no NaN at all
    row[size + 1] = NAN  # NaN on every rank
    if rank == 0:
        row[size + 2] = INF  # +inf on the first rank, NaN on the last
    if rank == size - 1:
        row[size + 2] = NAN
        row[size + 3] = -INF  # -inf on the last rank, NaN on the first
    if rank == 0:
        row[size + 3] = NAN
    row[size + 4] = -0.0 if rank == 0 else 0.0  # both zeros, -0.0 on the first rank
    row[size + 5] = 0.0 if rank == 0 else -0.0  # both zeros, +0.0 on the first rank
    return row


def _input(rank, size, dtype, repeat=1):
    return torch.tensor(_columns(rank, size) * repeat, dtype=getattr(torch, dtype))


def _plane(hvd):
    from hvdlike.core import api

    plane = api.runtime().process_sets[0].groups.cpu_plane
    if plane is None:
        return "gloo"
    # Not getattr(): the planes hand unknown names to their Gloo group, making it.
    return type(plane).__name__, vars(plane).get("hierarchical_allreduce")


def _reductions():
    import torch

    torch.set_num_threads(1)
    import hvdlike.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {"plane": _plane(hvd)}
    for dtype in DTYPES:
        for op in OPS:
            key = f"{dtype}.{op}"
            # Alone, one tensor per collective.
            out[("alone", dtype, op)] = hvd.allreduce(_input(r, n, dtype), op=getattr(hvd, op),
                                                      name=f"alone.{key}")
            # Scaled before and after (exactly, for these values).
            out[("scaled", dtype, op)] = hvd.allreduce(
                _input(r, n, dtype), op=getattr(hvd, op), prescale_factor=4.0,
                postscale_factor=0.25, name=f"scaled.{key}")
            # In place.
            t = _input(r, n, dtype)
            hvd.allreduce_(t, op=getattr(hvd, op), name=f"inplace.{key}")
            out[("inplace", dtype, op)] = t
            # Several at once (fused into one buffer), one of them larger than a
            # shared-memory allreduce of one sync point (256 KiB).
            handles = [hvd.allreduce_async(_input(r, n, dtype, repeat), op=getattr(hvd, op),
                                           name=f"batch{i}.{key}")
                       for i, repeat in enumerate((1, 3, 2, 12000))]
            out[("batch", dtype, op)] = [hvd.synchronize(h) for h in handles]
    hvd.shutdown()
    return out


def _check(results, size, zeros_signed):
    """Every rank's every result against torch's rule (``zeros_signed``: the
    signs of zeros as the integer image gives them)."""
    for dtype in DTYPES:
        inputs = [_input(r, size, dtype) for r in range(size)]
        for op in OPS:
            fn = torch.minimum if op == "Min" else torch.maximum
            want = inputs[0]
            for other in inputs[1:]:
                want = fn(want, other)
            nan = want.isnan()
            assert nan[:size].all() and nan[size + 1:size + 4].all()
            for rank, res in enumerate(results):
                batch = res[("batch", dtype, op)]
                got = [res[("alone", dtype, op)], res[("scaled", dtype, op)],
                       res[("inplace", dtype, op)], batch[0],
                       *(b.reshape(k, -1) for b, k in zip(batch[1:], (3, 2, 12000)))]
                for i, g in enumerate(got):
                    g = g.reshape(-1, want.numel())
                    where = (rank, dtype, op, i)
                    assert g.dtype == want.dtype, where
                    assert torch.equal(g.isnan(), nan.expand_as(g)), (where, g[0], want)
                    assert torch.equal(g[:, ~nan], want[~nan].expand(g.shape[0], -1)), (
                        where, g[0], want)
                    zeros = g[:, size + 4:size + 6]
                    if zeros_signed:
                        negative = torch.signbit(zeros)
                        assert bool(negative.all() if op == "Min" else (~negative).all()), (
                            where, zeros)


def _hosts(rank):
    """Ranks 0, 1 on host A, rank 2 on host B."""
    if rank < 2:
        return {"HVDLIKE_HOSTNAME": "host-a", "HVDLIKE_LOCAL_RANK": str(rank),
                "HVDLIKE_LOCAL_SIZE": "2", "HVDLIKE_CROSS_RANK": "0",
                "HVDLIKE_CROSS_SIZE": "2" if rank == 0 else "1"}
    return {"HVDLIKE_HOSTNAME": "host-b", "HVDLIKE_LOCAL_RANK": "0", "HVDLIKE_LOCAL_SIZE": "1",
            "HVDLIKE_CROSS_RANK": "1", "HVDLIKE_CROSS_SIZE": "2"}


def test_one_host_shared_memory_and_flat_gloo_agree_with_torch():
    shm = run_ranks(_reductions, np=3, timeout=240)
    assert {res["plane"] for res in shm} == {("ShmDataGroup", None)}
    _check(shm, 3, zeros_signed=False)
    flat = run_ranks(_reductions, np=3, env={"HVDLIKE_SHM": "0"}, timeout=240)
    assert {res["plane"] for res in flat} == {"gloo"}
    _check(flat, 3, zeros_signed=True)


def test_hierarchical_across_two_hosts_agrees_with_torch():
    results = run_ranks(_reductions, np=3, per_rank_env=_hosts, timeout=240)
    assert {res["plane"] for res in results} == {("HierarchicalGroup", True)}
    _check(results, 3, zeros_signed=True)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (pip install mpich)")
def test_mpi_plane_agrees_with_torch():
    pytest.importorskip("mpi4py", reason="needs mpi4py (pip install 'hvdlike[mpi]')")
    results = run_mpirun(_reductions, np=2, timeout=240)
    assert {res["plane"] for res in results} == {("MpiDataGroup", None)}
    _check(results, 2, zeros_signed=True)
