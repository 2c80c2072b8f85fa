"""SyncBatchNorm against BatchNorm on the concatenated batch; gradients of collectives.

Each rank rebuilds the whole computation of every rank in one process as the
oracle, so expected values never cross the wire.
"""

import pytest
import torch

from tests.multiproc.harness import run_ranks


def _run():
    import torch.nn as nn

    import hvdlike.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {}
    g = torch.Generator().manual_seed(5)

    # -- SyncBatchNorm: uneven batches, 2-D and 4-D inputs, two steps, then eval
    for label, shape_of, momentum in (("bn1d", lambda b: (b, 3), 0.3),
                                      ("bn2d", lambda b: (b, 3, 2, 2), 0.3),
                                      ("bn1d_cumulative", lambda b: (b, 3, 4), None)):
        sizes = [2 + q for q in range(n)]  # rank q holds 2 + q samples
        xs = [torch.randn(*shape_of(s), generator=g, dtype=torch.float64) for s in sizes]
        ws = [torch.randn(*shape_of(s), generator=g, dtype=torch.float64) for s in sizes]
        kind = nn.BatchNorm2d if label == "bn2d" else nn.BatchNorm1d
        torch.manual_seed(0)
        ref = kind(3, momentum=momentum).double()
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-0.5, 0.5)
        sync = hvd.SyncBatchNorm.convert_sync_batchnorm(
            nn.Sequential(kind(3, momentum=momentum).double()))[0]
        sync.load_state_dict(ref.state_dict())
        diffs = []
        for _ in range(2):
            x = xs[r].clone().requires_grad_()
            y = sync(x)
            (y * ws[r]).sum().backward()
            full = torch.cat(xs).requires_grad_()
            y_ref = ref(full)
            (y_ref * torch.cat(ws)).sum().backward()
            lo = sum(sizes[:r])
            diffs.append(float((y - y_ref[lo:lo + sizes[r]]).detach().abs().max()))
            diffs.append(float((x.grad - full.grad[lo:lo + sizes[r]]).abs().max()))
            # weight/bias grads are local sums; summed over ranks they are the global ones
            wsum = hvd.allreduce(sync.weight.grad, op=hvd.Sum)
            bsum = hvd.allreduce(sync.bias.grad, op=hvd.Sum)
            diffs.append(float((wsum - ref.weight.grad).abs().max()))
            diffs.append(float((bsum - ref.bias.grad).abs().max()))
            sync.zero_grad()
            ref.zero_grad()
        diffs.append(float((sync.running_mean - ref.running_mean).abs().max()))
        diffs.append(float((sync.running_var - ref.running_var).abs().max()))
        sync.eval()
        ref.eval()
        diffs.append(float((sync(xs[r]) - ref(xs[r])).detach().abs().max()))
        out[label] = max(diffs)
        out[f"{label}.type"] = type(sync).__name__
        out[f"{label}.tracked"] = int(sync.num_batches_tracked)

    # -- gradients of collectives: loss = sum over ranks of <out_r, c_r>. The
    # backward rules are Horovod's: allreduce, alltoall and grouped_allreduce give
    # the gradient of that sum; allgather and broadcast of its mean over ranks;
    # reducescatter (Average) n times the gradient of the sum.
    cs = [torch.randn(32, generator=g, dtype=torch.float64) for _ in range(n)]
    xs = [torch.randn(4, 2, generator=g, dtype=torch.float64) for _ in range(n)]

    def check(label, dist_fn, ref_fn, scale=1.0):
        x = xs[r].clone().requires_grad_()
        y = dist_fn(x)
        (y * cs_for(label, y)).sum().backward()
        full = [t.clone().requires_grad_() for t in xs]
        outs = ref_fn(full)
        sum((o * cs_for(label, o, q)).sum() for q, o in enumerate(outs)).backward()
        expected = full[r].grad if full[r].grad is not None else torch.zeros_like(x)
        out[label] = float((x.grad - expected * scale).abs().max())

    def cs_for(label, y, q=None):
        return cs[r if q is None else q][:y.numel()].reshape(y.shape)

    check("allreduce_sum", lambda x: hvd.allreduce(x, op=hvd.Sum),
          lambda f: [sum(f)] * n)
    check("allreduce_avg", lambda x: hvd.allreduce(x, name="avg", prescale_factor=2.0),
          lambda f: [sum(2 * t for t in f) / n] * n)
    check("allreduce_max", lambda x: hvd.allreduce(x, op=hvd.Max),
          lambda f: [torch.stack(f).amax(0)] * n)
    check("allgather", lambda x: hvd.allgather(x), lambda f: [torch.cat(f)] * n, 1.0 / n)
    check("broadcast", lambda x: hvd.broadcast(x, root_rank=1), lambda f: [f[1]] * n, 1.0 / n)
    check("reducescatter", lambda x: hvd.reducescatter(x, op=hvd.Average),
          lambda f: [(sum(f) / n)[q * 4 // n:(q + 1) * 4 // n] for q in range(n)], float(n))
    check("alltoall", lambda x: hvd.alltoall(x),
          lambda f: [torch.cat([f[s][q * 4 // n:(q + 1) * 4 // n] for s in range(n)])
                     for q in range(n)])
    check("alltoall_splits", lambda x: hvd.alltoall(x, splits=[1, 3])[0],
          lambda f: [torch.cat([f[s][:1] for s in range(n)]),
                     torch.cat([f[s][1:] for s in range(n)])])
    check("grouped_allreduce",
          lambda x: torch.cat(hvd.grouped_allreduce([x[:1], x[1:] * 2], op=hvd.Sum)),
          lambda f: [torch.cat([sum(t[:1] for t in f), sum(t[1:] * 2 for t in f)])] * n)
    out["no_grad_plain"] = not hvd.allreduce(torch.ones(2)).requires_grad

    # -- half precision: per-channel sums of dy far above float16's 65504
    gh = torch.Generator().manual_seed(9)
    full = torch.randn(4 * n, 2, 16, 16, generator=gh)
    dy_full = torch.randn(4 * n, 2, 16, 16, generator=gh) + 40.0  # sum(dy) ~ 40 * 1024 * n
    half = hvd.SyncBatchNorm(2, name="half").half()
    xh = full[4 * r:4 * (r + 1)].half().requires_grad_(True)
    half(xh).backward(dy_full[4 * r:4 * (r + 1)].half())
    xf = full.clone().requires_grad_(True)
    torch.nn.functional.batch_norm(xf, None, None, torch.ones(2), torch.zeros(2), True, 0.1,
                                   1e-5).backward(dy_full)
    out["half.finite"] = bool(torch.isfinite(xh.grad).all()
                              and torch.isfinite(half.weight.grad).all()
                              and torch.isfinite(half.bias.grad).all())
    out["half.dtypes"] = (xh.grad.dtype, half.weight.grad.dtype, half.bias.grad.dtype)
    out["half.err"] = float((xh.grad.float() - xf.grad[4 * r:4 * (r + 1)]).abs().max()
                            / xf.grad.abs().max())
    hvd.shutdown()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_run, np=2, timeout=120)


@pytest.mark.parametrize("label", ["bn1d", "bn2d", "bn1d_cumulative"])
def test_sync_batch_norm_equals_batch_norm_on_the_concatenated_batch(results, label):
    for out in results:
        assert out[label] < 1e-10, out[label]
        assert out[f"{label}.type"] == "SyncBatchNorm"
        assert out[f"{label}.tracked"] == 2


@pytest.mark.parametrize("label", ["allreduce_sum", "allreduce_avg", "allreduce_max",
                                   "allgather", "broadcast", "reducescatter", "alltoall",
                                   "alltoall_splits", "grouped_allreduce"])
def test_collective_gradients_match_single_process_autograd(results, label):
    for out in results:
        assert out[label] < 1e-12, (label, out[label])
    assert results[0]["no_grad_plain"]


def test_half_precision_backward_sums_in_float32(results):
    # The per-channel sums of dy reach ~80k here: taken in float16 they overflow
    # to inf and every input gradient became inf.
    for out in results:
        assert out["half.finite"], out
        assert out["half.dtypes"] == (torch.float16,) * 3
        assert out["half.err"] < 2e-2, out["half.err"]
