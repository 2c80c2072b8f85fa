"""Complex tensors move (allgather, broadcast, alltoall) on every data plane.

Gloo's allgather and alltoall refuse complex dtypes; before they were moved as
pairs of reals, a complex allgather with shared memory off failed with
"Invalid scalar type" and took the runtime down with it.
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
