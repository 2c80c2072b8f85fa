"""DistributedOptimizer's per-parameter hook runs after the user's, in a one-rank job.

The hook sits on each parameter's gradient accumulator node, whose post hooks
run after all of the tensor's post-accumulate-grad hooks: a hook the user
registers after wrapping still sees (and may change) the gradient before it is
counted in and reduced. The node is held by the optimizer and hooked again when
autograd replaces it (another dtype or device, other memory).
"""

import copy
import gc
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvdlike.torch as hvd
from hvdlike.torch import buckets as buckets_module
from hvdlike.torch import optimizer as optimizer_module


@pytest.fixture(scope="module", autouse=True)
def one_rank_job():
    hvd.init()
    yield
    hvd.shutdown()


@pytest.fixture(params=[True, False], ids=["overlap", "deferred"])
def overlap(request, monkeypatch):
    monkeypatch.setattr(optimizer_module, "_overlaps_cpu", lambda: request.param)
    return request.param


@pytest.fixture(params=[False, True], ids=["buckets", "one-per-gradient"])
def bucket_per_gradient(request, monkeypatch):
    if request.param:  # a 1-byte bucket cap: every gradient is reduced on its own
        monkeypatch.setattr(buckets_module, "BUCKET_CAP_BYTES", 1)
    return request.param


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _wrap(model, **options):
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), **options)


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 3, generator=g), torch.randn(5, 2, generator=g)


def _clip_in_place(p):
    p.grad.clamp_(-0.05, 0.05)


def test_a_user_hook_registered_after_wrapping_runs_before_the_reduction_starts(
        overlap, bucket_per_gradient):
    m = _model()
    opt = _wrap(m)
    seen = []

    def watch(p):
        # the optimizer's own record of p at the moment the user's hook runs
        where = opt._hvd_bucket_of.get(id(p))
        counted = where[0].marked[where[1]] if where else id(p) in opt._hvd_passes
        seen.append(counted or id(p) in opt._hvd_handles)
        _clip_in_place(p)

    for p in m.parameters():
        p.register_post_accumulate_grad_hook(watch)
    x, y = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "changed after backward" warning either
        F.mse_loss(m(x), y).backward()
        assert seen == [False] * 4
        opt.step()
    ref = _model()
    for p in ref.parameters():
        p.register_post_accumulate_grad_hook(_clip_in_place)
    F.mse_loss(ref(x), y).backward()
    for a, b in zip(m.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)  # one rank: the average is the clipped gradient


def test_hooks_run_after_the_users_with_several_passes_per_step(overlap):
    m = _model()
    opt = _wrap(m, backward_passes_per_step=2)
    counts = []

    def watch(p):  # the passes the optimizer counted for p when the user's hook runs
        counts.append(opt._hvd_passes.get(id(p), 0))
        _clip_in_place(p)

    for p in m.parameters():
        p.register_post_accumulate_grad_hook(watch)
    ref = _model()
    for p in ref.parameters():
        p.register_post_accumulate_grad_hook(_clip_in_place)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in (1, 2):
            x, y = _batch(seed)
            F.mse_loss(m(x), y).backward()
            F.mse_loss(ref(x), y).backward()
        assert counts == [0] * 4 + [1] * 4
        opt.step()
    for a, b in zip(m.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("change", ["double", "data", "set_"])
def test_a_replaced_gradient_accumulator_is_hooked_again(bucket_per_gradient, change,
                                                        monkeypatch):
    monkeypatch.setattr(optimizer_module, "_overlaps_cpu", lambda: True)
    m = _model()
    opt = _wrap(m)
    dtype = torch.float32
    if change == "double":  # another dtype: autograd makes new accumulator nodes
        m.double()
        dtype = torch.float64
    elif change == "data":
        for p in m.parameters():
            p.data = p.data.double()
        dtype = torch.float64
    else:
        with torch.no_grad():
            for p in m.parameters():
                p.set_(p.detach().clone())
    for p in m.parameters():
        p.register_post_accumulate_grad_hook(_clip_in_place)
    x, y = (t.to(dtype) for t in _batch())
    for _ in range(3):
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        opt.step()
    # From the round after the change on, the hooks start the reductions during backward.
    opt.zero_grad()
    F.mse_loss(m(x), y).backward()
    assert opt._hvd_open()
    if bucket_per_gradient:
        assert len(opt._hvd_handles) == 4
    else:
        assert all(b.pending == 0 for b in opt._hvd_buckets)
    opt.step()
    assert all(p.grad.abs().max() <= 0.05 for p in m.parameters())


def test_the_optimizer_holds_each_accumulator_and_a_dropped_one_goes_quiet():
    m = _model()
    opt = _wrap(m)
    nodes = [optimizer_module._grad_accumulator(p) for p in m.parameters()]
    assert [opt._hvd_hooks[id(p)].node for p in m.parameters()] == nodes
    gc.collect()  # no graph holds them, yet autograd's weak references still find them
    assert [optimizer_module._grad_accumulator(p) for p in m.parameters()] == nodes
    assert copy.deepcopy(opt) is not opt  # a copy drops the nodes instead of failing
    del opt, nodes
    gc.collect()
    calls = []
    for p in m.parameters():
        p.register_post_accumulate_grad_hook(lambda p: calls.append(p))
    F.mse_loss(m(_batch()[0]), _batch()[1]).backward()  # nothing left of the optimizer
    assert len(calls) == 4
    second = _wrap(m)
    second.zero_grad()
    F.mse_loss(m(_batch()[0]), _batch()[1]).backward()
    second.step()
