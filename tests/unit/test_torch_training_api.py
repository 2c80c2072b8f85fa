"""hvdlike.torch training API in a one-rank job: argument checks and optimizer plumbing."""

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


@pytest.fixture(autouse=True)
def overlapped(monkeypatch):
    """Reductions start during backward, whatever this machine's cores (the auto rule
    and the deferred path: tests/unit/test_cpu_overlap.py, test_deferred_... below)."""
    monkeypatch.setattr(optimizer_module, "_overlaps_cpu", lambda: True)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))


def _loss(model):
    return F.mse_loss(model(torch.randn(5, 3)), torch.randn(5, 1))


@pytest.fixture
def bucket_per_gradient(monkeypatch):
    """A 1-byte bucket cap: every gradient skips buckets (one reduction, one handle each)."""
    monkeypatch.setattr(buckets_module, "BUCKET_CAP_BYTES", 1)


def test_rejects_a_non_optimizer():
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        hvd.DistributedOptimizer(object())


def test_rejects_duplicate_and_missing_names():
    m = _model()
    params = list(m.named_parameters())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    dup = [("w", params[0][1]), ("w", params[1][1])] + params[2:]
    with pytest.raises(ValueError, match="duplicate names: w"):
        hvd.DistributedOptimizer(opt, named_parameters=dup)
    with pytest.raises(ValueError, match="not in named_parameters"):
        hvd.DistributedOptimizer(opt, named_parameters=params[:2])
    with pytest.raises(TypeError, match="named_parameters must be"):
        hvd.DistributedOptimizer(opt, named_parameters=list(m.parameters()))


@pytest.mark.parametrize("kwargs, match", [
    ({"backward_passes_per_step": 0}, "backward_passes_per_step"),
    ({"backward_passes_per_step": "2"}, "backward_passes_per_step"),
    ({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, "gradient_predivide_factor"),
    ({"op": hvd.Max}, "op must be"),
    ({"groups": 0}, "groups must be a positive int or a list"),
    ({"groups": 1.5}, "groups must be a positive int or a list"),
])
def test_rejects_bad_arguments(kwargs, match):
    m = _model()
    with pytest.raises(ValueError, match=match):
        hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), **kwargs)


def test_rejects_bad_groups_and_compression():
    m = _model()
    ps = list(m.parameters())
    opt = torch.optim.SGD(ps, lr=0.1)
    with pytest.raises(ValueError, match="more than one group"):
        hvd.DistributedOptimizer(opt, groups=[ps[:2], ps[1:3]])
    with pytest.raises(ValueError, match="not a trainable parameter"):
        hvd.DistributedOptimizer(opt, groups=[[torch.zeros(2, requires_grad=True)]])
    with pytest.raises(TypeError, match="compress"):
        hvd.DistributedOptimizer(opt, compression="fp16")


def test_groups_as_an_int_splits_like_horovod_and_num_groups_is_deprecated():
    m = nn.Sequential(*[nn.Linear(2, 2) for _ in range(5)])  # 10 trainable tensors
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), groups=4)
    assert [len(g) for g in opt._hvd_groups] == [3, 3, 2, 2]
    ps = list(m.parameters())
    with pytest.warns(DeprecationWarning, match="num_groups is deprecated; pass groups=<int>"):
        opt = hvd.DistributedOptimizer(torch.optim.SGD(ps, lr=0.1), num_groups=2)
    assert [len(g) for g in opt._hvd_groups] == [5, 5]
    with pytest.warns(DeprecationWarning):  # groups, when given, wins (as in Horovod)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(ps, lr=0.1), num_groups=3,
                                       groups=[ps[:2]])
    assert [len(g) for g in opt._hvd_groups] == [2]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(ps, lr=0.1), groups=20)  # more than tensors
    assert [len(g) for g in opt._hvd_groups] == [1] * 10


def test_wrapping_twice_is_an_error():
    m = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="already distributed"):
        hvd.DistributedOptimizer(opt)


def test_too_many_backward_passes_is_a_clear_error():
    m = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters(),
                                   backward_passes_per_step=2)
    _loss(m).backward()
    _loss(m).backward()
    with pytest.raises(RuntimeError, match="more than backward_passes_per_step=2"):
        _loss(m).backward()


def test_zero_grad_while_reducing_is_a_clear_error_and_step_recovers():
    m = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters())
    _loss(m).backward()
    with pytest.raises(RuntimeError, match="before step"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in m.parameters())


def test_step_twice_reuses_the_reduced_gradients():
    m = _model()
    ref = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(1)
    x, y = torch.randn(5, 3), torch.randn(5, 1)
    for model, o in ((m, opt), (ref, ref_opt)):
        F.mse_loss(model(x), y).backward()
        o.step()
        o.step()
    for a, b in zip(m.parameters(), ref.parameters()):
        assert torch.allclose(a, b)


def test_user_subclass_scheduler_state_dict_and_add_param_group():
    class MySGD(torch.optim.SGD):
        def step(self, closure=None):
            self.calls = getattr(self, "calls", 0) + 1
            return super().step(closure)

    # Step hooks run exactly as often as on the unwrapped optimizer (torch runs
    # them once per hooked class in the MRO).
    plain_model = _model()
    plain = MySGD(plain_model.parameters(), lr=0.1)
    plain_calls = []
    plain.register_step_pre_hook(lambda *a: plain_calls.append(1))
    _loss(plain_model).backward()
    plain.step()
    per_step = len(plain_calls)

    m = _model()
    opt = hvd.DistributedOptimizer(MySGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters())
    assert isinstance(opt, MySGD) and type(opt).__name__ == "MySGD"
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    pre_hook_calls = []
    opt.register_step_pre_hook(lambda *a: pre_hook_calls.append(1))
    _loss(m).backward()
    opt.step()
    sched.step()
    assert opt.calls == 1 and len(pre_hook_calls) == per_step
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    extra = nn.Parameter(torch.ones(2))
    opt.add_param_group({"params": [extra], "lr": 1.0})
    opt.zero_grad()
    (_loss(m) + extra.sum()).backward()
    opt.step()
    assert torch.allclose(extra.detach(), torch.zeros(2))
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    _loss(m).backward()
    opt.step()  # still synchronizes after load_state_dict
    assert opt.calls == 3 and len(pre_hook_calls) == 3 * per_step


def test_closure_optimizers_see_reduced_gradients():
    m = _model()
    opt = hvd.DistributedOptimizer(torch.optim.LBFGS(m.parameters(), max_iter=3),
                                   named_parameters=m.named_parameters())
    x, y = torch.randn(5, 3), torch.randn(5, 1)

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(m(x), y)
        loss.backward()
        return loss

    first = float(closure().detach())
    opt.synchronize()
    opt.step(closure)
    assert float(F.mse_loss(m(x), y).detach()) < first


def test_frozen_and_unused_parameters():
    m = _model()
    m[0].weight.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters())
    F.mse_loss(m[0](torch.randn(2, 3)).sum(1, keepdim=True), torch.zeros(2, 1)).backward()
    opt.step()  # m[2] got no gradient here: it is reduced as zeros, no stall
    assert m[0].weight.grad is None
    assert torch.equal(m[2].weight.grad, torch.zeros_like(m[2].weight))


def test_broadcast_helpers_reject_bad_input():
    with pytest.raises(TypeError, match="state_dict"):
        hvd.broadcast_parameters(5, root_rank=0)
    with pytest.raises(TypeError, match="not a tensor"):
        hvd.broadcast_parameters({"a": 1.0}, root_rank=0)
    with pytest.raises(ValueError, match="appears twice"):
        hvd.broadcast_parameters([("a", torch.ones(1)), ("a", torch.ones(1))], root_rank=0)
    with pytest.raises(ValueError, match="out of range"):
        hvd.broadcast_parameters({"a": torch.ones(1)}, root_rank=3)
    with pytest.raises(TypeError, match="item 1 is neither a tensor nor a"):
        hvd.broadcast_parameters([torch.ones(1), 3.0], root_rank=0)
    with pytest.raises(TypeError, match="Optimizer"):
        hvd.broadcast_optimizer_state({}, root_rank=0)


def test_broadcast_optimizer_state_on_one_rank_keeps_state():
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    _loss(m).backward()
    opt.step()
    before = {k: v.clone() for k, v in opt.state[m[0].weight].items()}
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for k, v in before.items():
        assert torch.equal(opt.state[m[0].weight][k], v)


def test_sparse_allreduce_checks_and_single_rank_value():
    with pytest.raises(TypeError, match="sparse COO"):
        hvd.sparse_allreduce_async(torch.ones(3))
    t = torch.sparse_coo_tensor(torch.tensor([[0, 2, 0]]), torch.tensor([1.0, 2.0, 3.0]), (4,),
                                check_invariants=True)
    with pytest.raises(ValueError, match="Average or Sum"):
        hvd.sparse_allreduce_async(t, op=hvd.Max)
    out = hvd.synchronize(hvd.sparse_allreduce_async(t, name="sp"))
    assert torch.equal(out.to_dense(), torch.tensor([4.0, 0.0, 2.0, 0.0]))


def test_sync_batch_norm_on_one_rank_is_batch_norm():
    torch.manual_seed(0)
    x = torch.randn(6, 3, 2)
    ref = nn.BatchNorm1d(3)
    sync = hvd.SyncBatchNorm(3)
    assert torch.allclose(sync(x), ref(x))
    assert torch.allclose(sync.running_var, ref.running_var)
    with pytest.raises(ValueError, match="4 channels"):
        sync(torch.randn(2, 4))
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        sync(torch.randn(3))


def test_reductions_start_during_backward_not_at_step(bucket_per_gradient):
    m = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters())
    launched_during_backward = []

    def probe(_grad):
        # Runs when the first layer's weight gradient is computed, which is
        # after the last layer's gradients are complete: those are in flight.
        launched_during_backward.append(len(opt._hvd_handles))

    m[0].weight.register_hook(probe)
    _loss(m).backward()
    assert launched_during_backward and launched_during_backward[0] >= 2
    assert len(opt._hvd_handles) == 4  # every gradient was submitted before step()
    opt.step()
    assert opt._hvd_handles == {}


@pytest.mark.parametrize("k", [1, 2])
def test_deferred_reductions_start_at_step_in_hook_order(bucket_per_gradient, monkeypatch, k):
    monkeypatch.setattr(optimizer_module, "_overlaps_cpu", lambda: False)
    m, ref = _model(), _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters(),
                                   backward_passes_per_step=k)
    plain = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.manual_seed(3)
    batches = [(torch.randn(5, 3), torch.randn(5, 1)) for _ in range(k)]
    for x, y in batches:
        F.mse_loss(m(x), y).backward()
        F.mse_loss(ref(x), y).backward()
    assert opt._hvd_handles == {}
    # backward produces the last layer's gradients first; they are started first
    assert [entry[1] for entry in opt._hvd_deferred] == [m[2].bias, m[2].weight, m[0].bias, m[0].weight]
    with pytest.raises(RuntimeError, match="before step"):
        opt.zero_grad()
    opt.step()
    plain.step()
    assert opt._hvd_handles == {} and opt._hvd_deferred == []
    for a, b in zip(m.parameters(), ref.parameters()):
        assert torch.equal(a, b)  # one rank: the average is the gradient itself


def test_an_elastic_restore_forgets_reductions_noted_but_not_started(bucket_per_gradient,
                                                                     monkeypatch):
    from hvdlike.torch.elastic.state import _forget_pending_reduction

    monkeypatch.setattr(optimizer_module, "_overlaps_cpu", lambda: False)
    m = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters())
    _loss(m).backward()  # then, say, a collective of the user's fails: the round is retried
    assert len(opt._hvd_deferred) == 4
    _forget_pending_reduction(opt)
    assert opt._hvd_deferred == [] and opt._hvd_handles == {}
    opt.zero_grad()
    _loss(m).backward()
    opt.step()  # each gradient reduced once: a second submission of a name would fail
    assert opt._hvd_deferred == [] and opt._hvd_handles == {}


def test_rewrapping_the_same_parameters_leaves_one_active_hook(bucket_per_gradient):
    m = _model()
    first = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                     named_parameters=m.named_parameters())
    second = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                      named_parameters=m.named_parameters())
    _loss(m).backward()
    assert first._hvd_handles == {} and len(second._hvd_handles) == 4
    second.step()
    # Stepping the old one would step on local gradients: refused, naming why,
    # before it moves anything.
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(RuntimeError, match="newer DistributedOptimizer wrapped around the same"):
        first.step()
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before))


def test_amp_grad_scaler_recipe():
    m = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = [p.detach().clone() for p in m.parameters()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _loss(m)
    scaler.scale(loss).backward()
    opt.synchronize()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=1e-3)
    with opt.skip_synchronize():
        scaler.step(opt)
    scaler.update()
    assert float(norm) > 1e-3  # the clip was active, on unscaled gradients
    moved = max(float((p.detach() - b).abs().max()) for p, b in zip(m.parameters(), before))
    assert 0 < moved <= 0.1 * 1e-3 + 1e-7  # lr * clipped norm bounds every change


def test_set_backward_passes_per_step(bucket_per_gradient):
    m = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    opt.set_backward_passes_per_step(2)
    _loss(m).backward()
    assert opt._hvd_handles == {}  # first of two passes: nothing sent yet
    with pytest.raises(RuntimeError, match="during an accumulation"):
        opt.set_backward_passes_per_step(1)
    _loss(m).backward()
    assert len(opt._hvd_handles) == 4
    opt.step()
    with pytest.raises(ValueError, match=">= 1"):
        opt.set_backward_passes_per_step(0)


def test_gradients_travel_in_one_bucket_and_come_back_to_each_parameter():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1), nn.Linear(2, 2))
    m[3].weight.requires_grad_(False)  # frozen: stays without a gradient
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters())
    assert len(opt._hvd_buckets) == 1
    bucket = opt._hvd_buckets[0]
    # Reverse registration order; the frozen weight is not in the bucket.
    assert bucket.members == [m[3].bias, m[2].bias, m[2].weight, m[0].bias, m[0].weight]
    _loss(m[:3]).backward()  # m[3] unused: its bias gets no gradient this step
    expected = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert list(opt._hvd_handles) == []  # one gradient (m[3].bias) still missing
    opt.synchronize()
    for n, p in m.named_parameters():
        if n in expected:
            assert torch.equal(p.grad, expected[n]), n  # one rank: the average is itself
    assert torch.equal(m[3].bias.grad, torch.zeros(2)) and m[3].weight.grad is None
    opt.zero_grad()
    _loss(m[:3]).backward()
    with pytest.raises(RuntimeError, match="before step"):
        opt.zero_grad()
    opt.step()


def _bucketed():
    m = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters())
    assert len(opt._hvd_buckets) == 1
    return m, opt, opt._hvd_buckets[0]


def _are_views(bucket):
    return [p.grad is view for p, view in zip(bucket.members, bucket.views)]


def test_gradients_become_bucket_views_and_survive_zero_grad(monkeypatch):
    m, opt, bucket = _bucketed()
    copied = []
    copy_all = buckets_module._copy_all
    monkeypatch.setattr(buckets_module, "_copy_all",
                        lambda dst, src: (copied.append(len(dst)) if dst else None,
                                          copy_all(dst, src)))
    _loss(m).backward()
    expected = [p.grad.clone() for p in bucket.members]
    opt.step()
    assert copied == [4]  # the fresh gradients went in once; nothing came back out
    assert all(_are_views(bucket))
    assert all(torch.equal(p.grad, e) for p, e in zip(bucket.members, expected))

    opt.zero_grad(set_to_none=False)
    assert all(_are_views(bucket)) and not bucket.flat.any()
    torch.manual_seed(3)
    loss = _loss(m)
    expected = torch.autograd.grad(loss, bucket.members, retain_graph=True)
    copied.clear()
    loss.backward()  # accumulates into the views: the bucket needs no copy
    opt.synchronize()
    assert copied == [] and all(_are_views(bucket))
    assert all(torch.equal(p.grad, e) for p, e in zip(bucket.members, expected))
    with opt.skip_synchronize():
        opt.step()

    opt.zero_grad()  # set_to_none=True, torch's default: gradients are gone
    assert all(p.grad is None for p in m.parameters())
    _loss(m).backward()
    fresh = [p.grad.clone() for p in bucket.members]
    opt.step()
    assert all(_are_views(bucket))
    assert all(torch.equal(p.grad, e) for p, e in zip(bucket.members, fresh))


def test_gradients_a_view_replaces_live_until_zero_grad_or_the_next_pack():
    m, opt, bucket = _bucketed()
    _loss(m).backward()
    fresh = [p.grad for p in bucket.members]
    opt.step()
    assert all(_are_views(bucket))
    # Held, not dropped at the reduction: the same tensors, not copies.
    assert len(bucket.retired) == 4 and all(r is f for r, f in zip(bucket.retired, fresh))
    opt.zero_grad()
    assert bucket.retired == []
    # A loop that zeroes through the model, not the optimizer: the next pack drops them.
    _loss(m).backward()
    opt.step()
    assert len(bucket.retired) == 4
    m.zero_grad()
    _loss(m).backward()  # the bucket left in the last hook: its pack dropped them
    assert bucket.retired == []
    opt.synchronize()
    assert len(bucket.retired) == 4  # this round's fresh gradients, replaced by the views
    assert all(r is not view for r, view in zip(bucket.retired, bucket.views))
    with opt.skip_synchronize():
        opt.step()
    # Accumulating into the views replaces nothing.
    opt.zero_grad(set_to_none=False)
    _loss(m).backward()
    opt.step()
    assert bucket.retired == []


def test_bucket_view_fallbacks_keep_every_gradient_right():
    m, opt, bucket = _bucketed()
    _loss(m).backward()
    opt.step()
    # A parameter frozen since keeps its own gradient, untouched by later rounds.
    frozen = m[0].weight
    frozen.requires_grad_(False)
    kept = frozen.grad.clone()
    for p in m.parameters():
        if p.requires_grad:
            p.grad = None
    # A gradient the user replaced is accumulated into, travels and comes back.
    m[2].bias.grad = torch.full_like(m[2].bias, 7.0)
    loss = _loss(m)
    others = [p for p in bucket.members if p.requires_grad and p is not m[2].bias]
    expected = torch.autograd.grad(loss, others + [m[2].bias], retain_graph=True)
    loss.backward()
    opt.step()
    assert frozen.grad is not bucket.views[opt._hvd_bucket_of[id(frozen)][1]]
    assert torch.equal(frozen.grad, kept)
    for p, e in zip(others, expected):
        assert torch.equal(p.grad, e)
    assert torch.equal(m[2].bias.grad, expected[-1] + 7.0)
    assert all(p.grad is bucket.views[opt._hvd_bucket_of[id(p)][1]] for p in others)


def test_gradient_as_bucket_view_false_copies_into_own_tensors():
    m = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters(),
                                   gradient_as_bucket_view=False)
    bucket = opt._hvd_buckets[0]
    _loss(m).backward()
    own = [p.grad for p in bucket.members]
    opt.step()
    assert not any(_are_views(bucket))
    assert all(p.grad is g for p, g in zip(bucket.members, own))


# -- gradients changed between backward and the reduction ---------------------------------

def _half_step(m, opt, scaler):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _loss(m)
    scaler.scale(loss).backward()


@pytest.mark.parametrize("buckets", [True, False])
def test_plain_grad_scaler_step_is_refused_once_reductions_run(buckets, monkeypatch):
    # Reductions started in backward carry the scaled gradients; GradScaler's
    # unscale_ then changes the local ones without bumping their versions, and
    # the reduced (still scaled) values would replace them: a step scale times
    # too large. Refused before anything moves.
    if not buckets:
        monkeypatch.setattr(buckets_module, "LARGE_GRADIENT_BYTES", 0)
    m = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    _half_step(m, opt, scaler)
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(RuntimeError, match="a step scale times too large"):
        scaler.step(opt)
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before))


def test_plain_grad_scaler_step_is_refused_where_reductions_wait_for_step_too(monkeypatch):
    # Held back to step(), the reduction would average unscaled gradients, but a
    # rank whose own gradients overflowed skips step() while the others wait; and
    # whether a reduction already started differs between ranks: refused alike.
    monkeypatch.setattr(optimizer_module, "_overlaps_cpu", lambda: False)
    m = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(_loss(m)).backward()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(RuntimeError, match="optimizer.synchronize\\(\\); scaler.unscale_"):
        scaler.step(opt)
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before))


def test_grad_scaler_recipe_neither_warns_nor_raises(recwarn):
    m = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    _half_step(m, opt, scaler)
    opt.synchronize()
    scaler.unscale_(opt)
    with opt.skip_synchronize():
        scaler.step(opt)
    scaler.update()
    assert not [w for w in recwarn if "DistributedOptimizer" in str(w.message)]


def test_clipping_before_the_held_back_reduction_warns(monkeypatch, recwarn):
    # Held back to step() (no idle core), the reduction averages the clipped
    # gradients: not what clipping the average gives, and refused elsewhere.
    monkeypatch.setattr(optimizer_module, "_overlaps_cpu", lambda: False)
    m = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters())
    _loss(m).backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=1e-3)
    with pytest.warns(UserWarning, match="changed after backward\\(\\) and before") as rec:
        opt.step()
    assert rec[0].filename == __file__
    # The recipe: synchronize first, then clip -- no warning.
    opt.zero_grad()
    _loss(m).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=1e-3)
    with opt.skip_synchronize():
        opt.step()
    assert not [w for w in recwarn if "changed after backward" in str(w.message)]


# -- small fidelity points -------------------------------------------------------------------

def test_backward_passes_per_step_is_readable_as_in_horovod():
    m = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters(),
                                   backward_passes_per_step=3)
    assert opt.backward_passes_per_step == 3
    opt.set_backward_passes_per_step(2)
    assert opt.backward_passes_per_step == 2


def test_average_argument_warns_as_deprecated_at_the_callers_line():
    with pytest.warns(DeprecationWarning, match="average argument is deprecated") as rec:
        out = hvd.allreduce(torch.ones(2), average=False, name="deprecated.avg")
    assert rec[0].filename == __file__
    assert torch.equal(out, torch.ones(2))


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.5),
    lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.5),
])
def test_broadcast_optimizer_state_does_not_move_parameters(make):
    # A fresh optimizer gets its state from one local step on zero gradients;
    # with weight decay that step shrank the parameters, so on a rank resuming
    # next to a root that loaded its state they no longer matched the root's.
    m = _model()
    opt = hvd.DistributedOptimizer(make(m.parameters()), named_parameters=m.named_parameters())
    before = [p.detach().clone() for p in m.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before))
    assert len(opt.state_dict()["state"]) == len(before)  # the state exists now


@pytest.mark.parametrize("overlap", [True, False])
def test_plain_grad_scaler_step_of_a_fused_optimizer_is_refused(overlap, monkeypatch, recwarn):
    # GradScaler.step calls an optimizer that unscales in its fused kernel
    # directly, having checked this rank's own gradients for inf: ranks would
    # decide alone whether to skip the update. The recipe still works.
    monkeypatch.setattr(optimizer_module, "_overlaps_cpu", lambda: overlap)
    m = _model()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=0.1, fused=True),
                                   named_parameters=m.named_parameters())
    assert getattr(opt, "_step_supports_amp_scaling", False)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(_loss(m)).backward()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(RuntimeError, match="checked for inf\\) each rank's own gradients"):
        scaler.step(opt)
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before))
    opt.synchronize()
    scaler.unscale_(opt)
    with opt.skip_synchronize():
        scaler.step(opt)
    scaler.update()
    assert not all(torch.equal(p, b) for p, b in zip(m.parameters(), before))


def test_step_warnings_name_the_users_line_not_hvdlikes():
    # Both warnings of step() were attributed to the collectives' compile guard.
    m = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters())
    _loss(m).backward()
    opt.synchronize()
    with pytest.warns(UserWarning, match="second synchronization is a no-op") as rec:
        opt.step()
    assert rec[0].filename == __file__
    opt.zero_grad()
    _loss(m).backward()
    with pytest.warns(UserWarning, match="backward pass that was not synchronized") as rec:
        with opt.skip_synchronize():
            opt.step()
    assert rec[0].filename == __file__
