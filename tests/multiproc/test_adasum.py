"""Adasum allreduce on real ranks against the single-process reference."""

import pytest

from tests.multiproc.harness import run_ranks


def _inputs(rank, shape, dtype=None):
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(*shape, generator=g, dtype=dtype or torch.float32)


def _adasum(np_):
    import torch

    import hvdlike.torch as hvd
    from hvdlike.core.adasum import reference
    from tests.multiproc.test_adasum import _inputs

    torch.set_num_threads(1)
    sub = hvd.ProcessSet([0, np_ - 1])
    hvd.init(process_sets=[sub])
    r, n = hvd.rank(), hvd.size()
    out = {}

    def check(key, got, want, atol=1e-5):
        out[key] = float((got.double() - want.double()).abs().max())
        assert got.shape == want.shape and got.dtype == want.dtype, key
        assert out[key] <= atol, (key, out[key])

    a = _inputs(r, (5,))
    check("plain", hvd.allreduce(a, op=hvd.Adasum),
          reference([_inputs(i, (5,)) for i in range(n)]))
    b = _inputs(r, (3, 2), torch.float64)
    grouped = hvd.grouped_allreduce([a, b], op=hvd.Adasum)
    check("grouped0", grouped[0], reference([_inputs(i, (5,)) for i in range(n)]))
    check("grouped1", grouped[1], reference([_inputs(i, (3, 2), torch.float64) for i in range(n)]),
          1e-12)
    inplace = a.clone()
    assert hvd.allreduce_(inplace, op=hvd.Adasum) is inplace
    check("inplace", inplace, reference([_inputs(i, (5,)) for i in range(n)]))
    scaled = hvd.allreduce(a, op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.25)
    check("scaled", scaled, reference([2 * _inputs(i, (5,)) for i in range(n)]) * 0.25)
    # Changes this small keep the coefficient 1 (Horovod's 1e-8 threshold on the
    # squared norm): equal tiny vectors add up instead of averaging.
    tiny = torch.full((4,), 1e-5, dtype=torch.float64)
    check("tiny", hvd.allreduce(tiny, op=hvd.Adasum), tiny * n, 1e-18)
    half = hvd.allreduce(a.half(), op=hvd.Adasum)
    check("half", half, reference([_inputs(i, (5,)).half() for i in range(n)]), 5e-3)
    # Every rank holds the same bits.
    gathered = hvd.allgather(hvd.allreduce(a, op=hvd.Adasum).unsqueeze(0))
    out["identical"] = all(torch.equal(gathered[0], row) for row in gathered)
    if sub.included():
        check("subset", hvd.allreduce(a, op=hvd.Adasum, process_set=sub),
              reference([_inputs(i, (5,)) for i in sub.ranks]))
    try:
        hvd.allreduce(torch.ones(3, dtype=torch.int32), op=hvd.Adasum)
    except TypeError as exc:
        out["int"] = str(exc)

    # DistributedOptimizer(op=Adasum) combines each gradient with Adasum.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    grads = []  # every rank's gradients, computed locally before the hooks exist
    for i in range(n):
        model.zero_grad()
        model(_inputs(i, (3, 4))).pow(2).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    model(_inputs(r, (3, 4))).pow(2).sum().backward()
    opt.step()
    for k, (p, p0) in enumerate(zip(model.parameters(), before)):
        check(f"optimizer{k}", p.detach(), p0 - reference([g[k] for g in grads]))
    hvd.barrier()
    hvd.shutdown()
    return out


@pytest.mark.parametrize("np_", [2, 3])
def test_adasum_matches_reference(np_):
    results = run_ranks(_adasum, np=np_, args=(np_,), timeout=120)
    for out in results:
        assert out["identical"]
        assert "Adasum needs a floating-point tensor" in out["int"]
    assert "subset" in results[0] and "subset" in results[-1]
