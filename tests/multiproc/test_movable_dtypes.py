"""Dtypes that are moved but never reduced: complex, and unsigned integers wider
than a byte, on every data plane.

Gloo's allgather and alltoall refuse complex dtypes; before they were moved as
pairs of reals, a complex allgather with shared memory off failed with
"Invalid scalar type" and took the runtime down with it. Wide unsigned
integers were carried as the signed type of the same width by the array front
ends, so a rank passing uint32 and one passing int32 were paired silently.
"""

import pytest

from tests.multiproc.harness import run_ranks


def _move_complex():
    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    found = {}
    for dtype in (torch.complex64, torch.complex128):
        key = str(dtype).split(".")[1]
        rows = torch.arange(2 * (r + 1), dtype=torch.float64).reshape(r + 1, 2)
        mine = torch.complex(rows, -rows - 10 * r).to(dtype)  # r + 1 rows: uneven
        found[key + " allgather"] = hvd.allgather(mine).tolist()
        found[key + " broadcast"] = hvd.broadcast(mine[:1] * (r + 1), root_rank=n - 1).tolist()
        # rank r sends r + 1 rows to each peer; the source carries a lazy conjugate
        source = torch.complex(torch.ones(n * (r + 1), 3), torch.full((n * (r + 1), 3), r + 0.5))
        sent = source.to(dtype).conj()
        got, received = hvd.alltoall(sent, splits=torch.tensor([r + 1] * n))
        found[key + " received"] = received.tolist()
        found[key + " alltoall"] = got.tolist()
    found["after"] = hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist()
    return found


@pytest.mark.parametrize("shm", ["1", "0"])
def test_complex_allgather_broadcast_alltoall_match_their_definitions(shm):
    import torch

    n = 2
    results = run_ranks(_move_complex, np=n, timeout=90, env={"HVDLIKE_SHM": shm})
    for dtype in ("complex64", "complex128"):
        gathered = []
        for r in range(n):
            rows = torch.arange(2 * (r + 1), dtype=torch.float64).reshape(r + 1, 2)
            gathered += torch.complex(rows, -rows - 10 * r).tolist()
        last = torch.complex(torch.tensor([0.0, 1.0], dtype=torch.float64),
                             torch.tensor([-10.0 * (n - 1), -1.0 - 10 * (n - 1)],
                                          dtype=torch.float64)) * n
        for me, found in enumerate(results):
            assert found[dtype + " allgather"] == gathered, (dtype, me)
            assert found[dtype + " broadcast"] == [last.tolist()], (dtype, me)
            expected = [[complex(1, -(s + 0.5))] * 3 for s in range(n) for _ in range(s + 1)]
            assert found[dtype + " alltoall"] == expected, (dtype, me)
            assert found[dtype + " received"] == [s + 1 for s in range(n)]
            assert found["after"] == [float(n), float(n)]


def _unsigned(signed_on_rank_1):
    import numpy as np
    import torch

    import hvdlike.numpy as hnp
    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r = hvd.rank()
    found = {}
    for bits in (16, 32, 64):
        dtype = getattr(torch, f"uint{bits}")
        top = 2 ** bits - 1 - r  # beyond the signed range: a sign slip shows
        row = [top, top]
        tensor = torch.tensor(np.array([row] * (r + 1), dtype=f"uint{bits}"))
        assert tensor.dtype == dtype
        got = hvd.allgather(tensor)
        found[f"torch uint{bits}"] = (str(got.dtype), np.asarray(got.numpy()).tolist())
        got = hnp.broadcast(np.array(row, dtype=f"uint{bits}"), root_rank=1)
        found[f"numpy uint{bits} broadcast"] = (str(got.dtype), got.tolist())
    wrong = np.array([7], np.int32 if (signed_on_rank_1 and r == 1) else np.uint32)
    try:
        found["paired"] = hnp.allgather(wrong, name="u32").tolist()
    except hvd.HorovodInternalError as exc:
        found["paired"] = f"{type(exc).__name__}: {exc}"
    return found


@pytest.mark.parametrize("shm", ["1", "0"])
def test_wide_unsigned_integers_move_as_themselves_and_a_signed_peer_is_refused(shm):
    import torch
    if not hasattr(torch, "uint32"):
        pytest.skip(f"torch {torch.__version__} has no uint32 (2.3 and up)")
    n = 2
    for signed in (False, True):
        results = run_ranks(_unsigned, np=n, args=(signed,), timeout=90,
                            env={"HVDLIKE_SHM": shm})
        for me, found in enumerate(results):
            for bits in (16, 32, 64):
                gathered = [[2 ** bits - 1 - r] * 2 for r in range(n) for _ in range(r + 1)]
                assert found[f"torch uint{bits}"] == (f"torch.uint{bits}", gathered), me
                assert found[f"numpy uint{bits} broadcast"] == (
                    f"uint{bits}", [2 ** bits - 2] * 2), me
            if signed:
                assert found["paired"].startswith(
                    "MismatchError: ranks disagree on the dtype of collective 'allgather.u32'")
                assert "rank 0: allgather uint32 1 cpu" in found["paired"]
                assert "rank 1: allgather int32 1 cpu" in found["paired"]
            else:
                assert found["paired"] == [7, 7]
