"""DistributedOptimizer on real ranks, checked against one process on the whole batch.

One launch runs every scenario (process start-up dominates the cost); each
test asserts on its own scenario's results. Every rank also computes the
single-process reference itself, so no reference crosses the wire.
"""

import pytest
import torch

from tests.multiproc.harness import run_ranks

STEPS = 10
B = 3  # per-rank batch


def _scenarios():
    import torch.nn as nn
    import torch.nn.functional as F

    import hvdlike.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    r, n = hvd.rank(), hvd.size()
    out = {"rank": r}

    def mlp():
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def flat(model):
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def data(per_step):
        g = torch.Generator().manual_seed(7)
        return (torch.randn(STEPS, per_step, 4, generator=g),
                torch.randn(STEPS, per_step, 2, generator=g))

    def oracle(make_opt, compression=hvd.Compression.none, clip=None, sched=False, name="",
               sched_first=False, convert_at=None):
        # sched_first: the scheduler is built on the optimizer before it is wrapped;
        # convert_at: the model becomes float64 (module.double()) before that step.
        X, Y = data(n * B)
        results = []
        for distributed in (True, False):
            model = mlp()
            opt = make_opt(model.parameters())
            lr_sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5) if sched_first else None
            if distributed:
                opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                               compression=compression)
            if sched and not sched_first:
                lr_sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
            for t in range(STEPS):
                if t == convert_at:
                    model.double()
                x, y = (X[t, r * B:(r + 1) * B], Y[t, r * B:(r + 1) * B]) if distributed \
                    else (X[t], Y[t])
                x, y = x.to(next(model.parameters()).dtype), y.to(next(model.parameters()).dtype)
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                if clip is not None:
                    if distributed:
                        opt.synchronize()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                    if distributed:
                        with opt.skip_synchronize():
                            opt.step()
                    else:
                        opt.step()
                else:
                    opt.step()
                if lr_sched is not None:
                    lr_sched.step()
            results.append(flat(model).double())
            if distributed:
                out[f"{name}.class"] = (type(opt).__name__, isinstance(opt, type(make_opt(
                    mlp().parameters()))))
                out[f"{name}.lr"] = opt.param_groups[0]["lr"]
        dist_p, ref_p = results
        # Discrimination check: training on the local batch alone must differ.
        model = mlp()
        opt = make_opt(model.parameters())
        for t in range(STEPS):
            opt.zero_grad()
            F.mse_loss(model(X[t, r * B:(r + 1) * B]), Y[t, r * B:(r + 1) * B]).backward()
            opt.step()
        out[f"{name}.local_diff"] = float((flat(model).double() - ref_p).abs().max())
        out[f"{name}.diff"] = float((dist_p - ref_p).abs().max())
        out[f"{name}.params"] = dist_p

    oracle(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), sched=True, name="sgd")
    oracle(lambda ps: torch.optim.Adam(ps, lr=0.01), name="adam")
    oracle(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), hvd.Compression.fp16,
           name="fp16")
    oracle(lambda ps: torch.optim.SGD(ps, lr=0.5), clip=0.05, name="clip")
    oracle(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), sched=True, sched_first=True,
           name="sched_first")
    oracle(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), convert_at=3, name="double")

    # backward_passes_per_step=k: k local passes of B rows == one batch of n*k*B rows.
    k = 3
    X, Y = data(n * k * B)
    res = []
    for distributed in (True, False):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if distributed:
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           backward_passes_per_step=k)
        for t in range(STEPS):
            opt.zero_grad()
            if distributed:
                for j in range(k):
                    lo = (r * k + j) * B
                    (F.mse_loss(model(X[t, lo:lo + B]), Y[t, lo:lo + B]) / k).backward()
            else:
                F.mse_loss(model(X[t]), Y[t]).backward()
            opt.step()
        res.append(flat(model))
    out["accum.diff"] = float((res[0] - res[1]).abs().max())
    out["accum.params"] = res[0]

    # Each rank takes a different head each step; head "c" is never used.
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(2)
            self.trunk = nn.Linear(4, 6)
            self.a = nn.Linear(6, 2)
            self.b = nn.Linear(6, 2)
            self.c = nn.Linear(6, 2)

        def forward(self, x, use_a):
            h = torch.tanh(self.trunk(x))
            return self.a(h) if use_a else self.b(h)

    X, Y = data(n * B)
    res = []
    for distributed in (True, False):
        model = Branchy()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if distributed:
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        for t in range(STEPS):
            opt.zero_grad()
            if distributed:
                x, y = X[t, r * B:(r + 1) * B], Y[t, r * B:(r + 1) * B]
                F.mse_loss(model(x, (t + r) % 2 == 0), y).backward()
            else:
                loss = sum(F.mse_loss(model(X[t, q * B:(q + 1) * B], (t + q) % 2 == 0),
                                      Y[t, q * B:(q + 1) * B]) for q in range(n)) / n
                loss.backward()
            opt.step()
        res.append(flat(model))
    out["branch.diff"] = float((res[0] - res[1]).abs().max())
    out["branch.params"] = res[0]

    # Groups (num_groups and explicit) reduce the same numbers.
    for label, kwargs in (("groups2", {"num_groups": 2}), ("groups_explicit", None),
                          ("groups.ref", {})):
        X, Y = data(n * B)
        model = mlp()
        if kwargs is None:
            ps = list(model.parameters())
            kwargs = {"groups": [ps[:2], ps[2:3]]}
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), **kwargs)
        for t in range(STEPS):
            opt.zero_grad()
            F.mse_loss(model(X[t, r * B:(r + 1) * B]), Y[t, r * B:(r + 1) * B]).backward()
            opt.step()
        out[f"{label}.params"] = flat(model)

    # Sparse embedding gradients: allgather path and sparse_as_dense.
    def emb_model():
        torch.manual_seed(3)
        return nn.ModuleDict({"emb": nn.Embedding(10, 3, sparse=True), "out": nn.Linear(3, 1)})

    g = torch.Generator().manual_seed(11)
    idx = torch.randint(0, 10, (STEPS, n * B), generator=g)
    tgt = torch.randn(STEPS, n * B, 1, generator=g)
    for label, dense in (("sparse", False), ("sparse_dense", True)):
        res = []
        for distributed in (True, False):
            m = emb_model()
            opt = torch.optim.SGD(m.parameters(), lr=0.2)
            if distributed:
                opt = hvd.DistributedOptimizer(opt, named_parameters=m.named_parameters(),
                                               sparse_as_dense=dense)
            for t in range(STEPS):
                opt.zero_grad()
                i, y = (idx[t, r * B:(r + 1) * B], tgt[t, r * B:(r + 1) * B]) if distributed \
                    else (idx[t], tgt[t])
                F.mse_loss(m["out"](m["emb"](i)), y).backward()
                opt.step()
            res.append(torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
        out[f"{label}.diff"] = float((res[0] - res[1]).abs().max())
        out[f"{label}.params"] = res[0]

    # step() twice without a backward in between, and a step after only 1 of k passes.
    X, Y = data(n * B)
    res = []
    for distributed in (True, False):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if distributed:
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        x, y = (X[0, r * B:(r + 1) * B], Y[0, r * B:(r + 1) * B]) if distributed \
            else (X[0], Y[0])
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.step()
        res.append(flat(model))
    out["twice.diff"] = float((res[0] - res[1]).abs().max())
    model = mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=2)
    F.mse_loss(model(X[1, r * B:(r + 1) * B]), Y[1, r * B:(r + 1) * B]).backward()
    opt.step()  # early: reduces the one pass accumulated so far
    out["early.params"] = flat(model)

    # When reductions start: during backward (overlap) or at step() (deferred).
    model = mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    F.mse_loss(model(X[1, r * B:(r + 1) * B]), Y[1, r * B:(r + 1) * B]).backward()
    out["after_backward"] = (len(opt._hvd_handles), len(opt._hvd_deferred))
    try:
        opt.zero_grad()
        out["zero_grad_early"] = "no error"
    except RuntimeError as exc:
        out["zero_grad_early"] = str(exc)
    opt.step()
    out["after_step"] = (len(opt._hvd_handles), len(opt._hvd_deferred))
    out["timing.params"] = flat(model)

    # Which thread runs the reductions on the shared-memory plane: held back
    # to step(), the thread that waits for them (Runtime.cycles_here).
    import threading

    from hvdlike.core import api as core_api

    plane = core_api.runtime().process_sets[0].groups.cpu_plane
    out["plane"] = type(plane).__name__
    threads = []
    if hasattr(plane, "_allreduce"):
        plain = plane._allreduce

        def recorded(*args, **kwargs):
            threads.append(threading.get_ident())
            return plain(*args, **kwargs)

        plane._allreduce = recorded  # an instance attribute, removed below
    # A gradient too large to ride on the negotiation's vote (Executor.offer).
    wide = nn.Linear(128, 1024)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(wide.parameters(), lr=0.1),
                                   named_parameters=wide.named_parameters())
    # The first wait comes late, long after the background thread was woken
    # by the submissions: held back to step(), it must still not take them.
    import time

    from hvdlike.torch import ops

    real_synchronize = ops.synchronize

    def late_synchronize(handle):
        time.sleep(0.05)
        return real_synchronize(handle)

    ops.synchronize = late_synchronize
    try:
        for t in range(3):
            opt.zero_grad()
            wide(torch.randn(B, 128)).pow(2).mean().backward()
            opt.step()
    finally:
        ops.synchronize = real_synchronize
        if threads is not None and plane is not None:
            vars(plane).pop("_allreduce", None)
    main = threading.get_ident()
    out["reduced_by"] = (sum(t == main for t in threads), sum(t != main for t in threads))

    # state_dict round trip and zero_grad(set_to_none=False)
    model = mlp()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    F.mse_loss(model(X[2, r * B:(r + 1) * B]), Y[2, r * B:(r + 1) * B]).backward()
    opt.step()
    sd = opt.state_dict()
    opt.zero_grad(set_to_none=False)
    out["zero_grad_zeros"] = all(float(p.grad.abs().sum()) == 0 for p in model.parameters())
    opt.load_state_dict(sd)
    out["state_steps"] = [float(s["step"]) for s in opt.state.values()]
    F.mse_loss(model(X[3, r * B:(r + 1) * B]), Y[3, r * B:(r + 1) * B]).backward()
    opt.step()
    out["after_load.params"] = flat(model)

    # Two optimizers whose models share parameter names, reduced in the same backward.
    X, Y = data(n * B)
    res = []
    for distributed in (True, False):
        gen, disc = mlp(), nn.Sequential(nn.Linear(2, 1))
        opts = [torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(),
                                                                           lr=0.1)]
        if distributed:
            opts = [hvd.DistributedOptimizer(o, named_parameters=m.named_parameters())
                    for o, m in zip(opts, (gen, disc))]
        for t in range(3):
            for o in opts:
                o.zero_grad()
            x = X[t, r * B:(r + 1) * B] if distributed else X[t]
            disc(gen(x)).pow(2).mean().backward()
            for o in opts:
                o.step()
        res.append(torch.cat([flat(gen), flat(disc)]))
    out["two_opts.diff"] = float((res[0] - res[1]).abs().max())

    # Bucketed gradients as views, copied back, and one reduction per gradient
    # give identical parameters, over steps that alternate zero_grad modes and
    # leave a head unused on each rank (bucket members without a gradient).
    from hvdlike.torch import buckets as bucket_module

    X, Y = data(n * B)
    for label in ("views", "copies", "unbucketed"):
        cap = bucket_module.BUCKET_CAP_BYTES
        if label == "unbucketed":
            bucket_module.BUCKET_CAP_BYTES = 1
        try:
            model = Branchy()
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                           momentum=0.9),
                                           named_parameters=model.named_parameters(),
                                           gradient_as_bucket_view=label == "views")
        finally:
            bucket_module.BUCKET_CAP_BYTES = cap
        views = 0
        for t in range(STEPS):
            opt.zero_grad(set_to_none=t % 3 != 1)
            x, y = X[t, r * B:(r + 1) * B], Y[t, r * B:(r + 1) * B]
            F.mse_loss(model(x, (t + r) % 2 == 0), y).backward()
            opt.step()
            views += sum(p.grad is b.views[i] for b in opt._hvd_buckets
                         for i, p in enumerate(b.members))
        out[f"buckets.{label}.params"] = flat(model)
        out[f"buckets.{label}.views"] = views
        out[f"buckets.{label}.count"] = len(opt._hvd_buckets)

    hvd.shutdown()
    return out


# Every scenario three times: CPU reductions started during backward, all at
# step(), and all at step() on Gloo (whose work completes on the finisher
# thread, not on the thread that runs the cycle).
@pytest.fixture(scope="module", params=["1", "0", "0-gloo"],
                ids=["overlap", "at_step", "at_step_gloo"])
def results(request):
    env = {"HVDLIKE_CPU_OVERLAP": request.param[0]}
    if request.param.endswith("gloo"):
        env["HVDLIKE_SHM"] = "0"
    res = run_ranks(_scenarios, np=2, timeout=150, env=env)
    for out in res:
        out["overlap"] = request.param == "1"
        out["gloo"] = request.param.endswith("gloo")
    return res


def test_reductions_start_during_backward_or_at_step_as_configured(results):
    for out in results:
        # 4 gradients in one bucket: one reduction in flight, or held back until step()
        assert out["after_backward"] == ((1, 0) if out["overlap"] else (0, 1))
        assert out["after_step"] == (0, 0)
        assert "before step() or synchronize()" in out["zero_grad_early"]
    assert torch.equal(results[0]["timing.params"], results[1]["timing.params"])
    for out in results:
        main, other = out["reduced_by"]
        if out["gloo"]:
            assert out["plane"] != "ShmDataGroup" and (main, other) == (0, 0)
            continue
        assert out["plane"] == "ShmDataGroup"
        assert main + other >= 3  # one bucket per step at least
        if not out["overlap"]:  # held back to step(): all on the thread that waits
            assert other == 0, out["reduced_by"]


# sched_first: a scheduler built before wrapping used to replace step() on the
# wrapped optimizer too (the ranks trained apart); double: the model converted
# after the first steps used to leave its gradients out of their buckets.
@pytest.mark.parametrize("name", ["sgd", "adam", "sched_first", "double"])
def test_matches_one_process_on_the_whole_batch(results, name):
    for out in results:
        assert out[f"{name}.diff"] < 1e-5, out[f"{name}.diff"]
        assert out[f"{name}.local_diff"] > 1e-3  # the oracle can tell the difference
    assert torch.equal(results[0][f"{name}.params"], results[1][f"{name}.params"])


def test_result_is_an_instance_of_the_wrapped_class_and_schedulers_work(results):
    assert results[0]["sgd.class"] == ("SGD", True)
    assert results[0]["adam.class"] == ("Adam", True)
    assert results[0]["sgd.lr"] == pytest.approx(0.1 * 0.5 ** 3)
    assert results[0]["sched_first.lr"] == pytest.approx(0.1 * 0.5 ** 3)


def test_backward_passes_per_step_equals_one_big_batch(results):
    for out in results:
        assert out["accum.diff"] < 1e-5
    assert torch.equal(results[0]["accum.params"], results[1]["accum.params"])


def test_different_branch_per_rank_stays_identical_and_exact(results):
    for out in results:
        assert out["branch.diff"] < 1e-5
    assert torch.equal(results[0]["branch.params"], results[1]["branch.params"])


def test_fp16_compression_stays_close(results):
    for out in results:
        assert out["fp16.diff"] < 5e-3
    assert torch.equal(results[0]["fp16.params"], results[1]["fp16.params"])


def test_clipping_recipe_matches_clipping_the_global_gradient(results):
    for out in results:
        assert out["clip.diff"] < 1e-5
    assert torch.equal(results[0]["clip.params"], results[1]["clip.params"])


def test_groups_reduce_the_same_as_single_tensors(results):
    for label in ("groups2", "groups_explicit"):
        for out in results:
            assert torch.allclose(out[f"{label}.params"], results[0][f"{label}.params"])
    # SGD without momentum on identical data: groups give the same as ungrouped training
    assert torch.equal(results[0]["groups2.params"], results[1]["groups2.params"])
    for label in ("groups2", "groups_explicit"):
        assert torch.equal(results[0][f"{label}.params"], results[0]["groups.ref.params"])


@pytest.mark.parametrize("label", ["sparse", "sparse_dense"])
def test_sparse_gradients(results, label):
    for out in results:
        assert out[f"{label}.diff"] < 1e-5
    assert torch.equal(results[0][f"{label}.params"], results[1][f"{label}.params"])


def test_step_twice_and_early_step_do_not_hang_and_agree(results):
    for out in results:
        assert out["twice.diff"] < 1e-6
    assert torch.equal(results[0]["early.params"], results[1]["early.params"])


def test_state_dict_round_trip_and_zero_grad(results):
    for out in results:
        assert out["zero_grad_zeros"]
        assert out["state_steps"] == [1.0] * 4
    assert torch.equal(results[0]["after_load.params"], results[1]["after_load.params"])


def test_two_optimizers_with_the_same_parameter_names(results):
    for out in results:
        assert out["two_opts.diff"] < 1e-6


def test_bucket_views_copies_and_single_gradients_train_identically(results):
    for out in results:
        assert out["buckets.views.count"] == out["buckets.copies.count"] == 1
        assert out["buckets.unbucketed.count"] == 0
        # every one of the 8 gradients is its bucket's view after every step
        assert out["buckets.views.views"] == 8 * STEPS
        assert out["buckets.copies.views"] == 0
        for label in ("copies", "unbucketed"):
            assert torch.equal(out["buckets.views.params"], out[f"buckets.{label}.params"])
    assert torch.equal(results[0]["buckets.views.params"], results[1]["buckets.views.params"])
    # and the same as the per-rank branch oracle above, which checks the sum itself
    assert torch.allclose(results[0]["buckets.views.params"], results[0]["branch.params"])
