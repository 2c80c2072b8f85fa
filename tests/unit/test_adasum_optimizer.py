"""DistributedOptimizer(op=Adasum) in a one-rank job.

With one rank the factory keeps the gradient optimizer, as Horovod does. The Adasum
optimizer itself (local step per parameter during backward, Adasum of the changes at
step()) is exercised here by making the factory believe there are more ranks: the Adasum
of a single change is that change, so the result must equal the plain optimizer's.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvdlike.torch as hvd
from hvdlike.torch import adasum_optimizer
from hvdlike.torch.adasum_optimizer import _DistributedAdasum
from hvdlike.torch.elastic.state import _forget_pending_reduction
from hvdlike.torch.optimizer import _Distributed


@pytest.fixture(scope="module", autouse=True)
def one_rank_job():
    torch.set_num_threads(1)
    hvd.init()
    yield
    hvd.shutdown()


@pytest.fixture
def delta_path(monkeypatch):
    """Choose the Adasum optimizer although the job has one rank."""
    monkeypatch.setattr(adasum_optimizer, "_one_rank", lambda: False)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _loss(model, step):
    g = torch.Generator().manual_seed(step)
    return F.mse_loss(model(torch.randn(6, 3, generator=g)), torch.randn(6, 2, generator=g))


def _adasum(model, make, **kwargs):
    return hvd.DistributedOptimizer(make(model.parameters()),
                                    named_parameters=model.named_parameters(), op=hvd.Adasum,
                                    **kwargs)


def test_one_rank_keeps_the_gradient_optimizer_as_horovod_does():
    model = _model()
    opt = _adasum(model, lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert isinstance(opt, _Distributed) and not isinstance(opt, _DistributedAdasum)
    _loss(model, 0).backward()
    opt.synchronize()
    with opt.skip_synchronize():  # works there: gradients are what is reduced
        opt.step()


def _two_groups(params):
    return torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 0.02}],
                             lr=0.01)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    lambda ps: torch.optim.Adam(ps, lr=0.01),
    lambda ps: _two_groups(list(ps)),
])
def test_one_change_combined_is_the_plain_step(delta_path, make):
    model, plain = _model(), _model()
    opt, ref = _adasum(model, make), make(plain.parameters())
    assert isinstance(opt, _DistributedAdasum) and isinstance(opt, type(ref))
    for step in range(3):
        for o, m in ((opt, model), (ref, plain)):
            o.zero_grad()
            _loss(m, step).backward()
            o.step()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert opt.state_dict()["state"].keys() == ref.state_dict()["state"].keys() == {0, 1, 2, 3}


def test_local_steps_run_in_backward_and_parameters_keep_their_values(delta_path):
    model = _model()
    opt = _adasum(model, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model, 0).backward()
    assert len(opt._hvd_handles) == 4  # every change is being combined already
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert len(opt.state) == 4  # the momentum buffers exist: the local steps ran
    opt.synchronize()  # nothing to do
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.step()
    assert opt._hvd_handles == {} and not opt._hvd_round_open
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_misuse_is_a_clear_error_and_the_step_still_works(delta_path):
    model = _model()
    opt = _adasum(model, lambda ps: torch.optim.SGD(ps, lr=0.1), backward_passes_per_step=2)
    _loss(model, 0).backward()
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) was called after backward\(\)"):
        opt.zero_grad()  # as in Horovod, also in the middle of an accumulation
    _loss(model, 1).backward()
    with pytest.raises(RuntimeError, match="backward_passes_per_step=2"):
        _loss(model, 2).backward()
    with pytest.raises(RuntimeError, match=r"skip_synchronize\(\) is not supported"):
        with opt.skip_synchronize():
            pass
    with pytest.raises(RuntimeError, match="during an accumulation"):
        opt.set_backward_passes_per_step(1)
    opt.step()
    opt.zero_grad()
    opt.set_backward_passes_per_step(1)
    _loss(model, 3).backward()
    opt.step()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(gradient_predivide_factor=2.0), ValueError, "gradient_predivide_factor needs op=Average"),
    (dict(backward_passes_per_step=0), ValueError, "backward_passes_per_step must be an int"),
    (dict(compression=object()), TypeError, "compression needs compress"),
    (dict(groups=[[torch.ones(1)]]), ValueError, r"groups\[0\] holds a tensor"),
    (dict(num_groups=-1), ValueError, "num_groups must be a non-negative int"),
])
def test_bad_arguments_are_named(delta_path, kwargs, error, match):
    model = _model()
    with pytest.raises(error, match=match):
        _adasum(model, lambda ps: torch.optim.SGD(ps, lr=0.1), **kwargs)


def test_bad_names_lbfgs_and_double_wrapping_are_refused(delta_path):
    model = _model()
    with pytest.raises(ValueError, match="duplicate names"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("w", p) for p in model.parameters()],
                                 op=hvd.Adasum)
    with pytest.raises(TypeError, match=r"\(name, parameter\) pairs"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=list(model.parameters()), op=hvd.Adasum)
    with pytest.raises(ValueError, match="LBFGS, whose step\\(\\) needs a closure"):
        hvd.DistributedOptimizer(torch.optim.LBFGS(model.parameters()), op=hvd.Adasum)
    opt = _adasum(model, lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(TypeError, match="already distributed"):
        hvd.DistributedOptimizer(opt, op=hvd.Adasum)


def test_parameters_without_gradients_frozen_and_added_ones(delta_path):
    model = _model()
    extra = nn.Parameter(torch.ones(2))
    opt = _adasum(model, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    model[2].bias.requires_grad_(False)
    frozen = model[2].bias.detach().clone()
    opt.add_param_group({"params": [extra], "lr": 0.5})
    assert opt._parameter_names[extra] == "DistributedOptimizer.noname.1.0"
    opt.zero_grad()
    (_loss(model, 0) + extra.sum()).backward()
    assert id(extra) in opt._hvd_handles  # hooked when it was added
    opt.step()
    assert torch.equal(extra.detach(), torch.full((2,), 0.5))  # 1 - 0.5 * 1
    assert torch.equal(model[2].bias.detach(), frozen)
    # A step without a backward: no gradients, no change (every name is still reduced).
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_step_hooks_closure_and_state_broadcast(delta_path):
    model = _model()
    opt = _adasum(model, lambda ps: torch.optim.Adam(ps, lr=0.01))
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # a fresh state: one local step
    assert len(opt.state) == 4
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))

    def closure():
        loss = _loss(model, 0)
        loss.backward()
        return loss

    opt.zero_grad()
    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and calls == ["pre", "post"]


def test_an_elastic_reset_forgets_the_round(delta_path):
    model = _model()
    opt = _adasum(model, lambda ps: torch.optim.SGD(ps, lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model, 0).backward()
    for _, handle, _, _ in opt._hvd_handles.values():
        hvd.synchronize(handle)  # the runtime would have failed them
    _forget_pending_reduction(opt)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.zero_grad()  # allowed again: no round is open
    _loss(model, 0).backward()
    opt.step()
