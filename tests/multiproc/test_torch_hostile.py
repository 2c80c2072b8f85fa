"""Ranks that disagree, seen through hvdlike.torch: every rank gets a clear error (or
the right answer) in bounded time, and the job goes on."""

from tests.multiproc.harness import run_ranks

# A divergence these tests are meant to prevent must not cost the default 30 s.
FAST_DEADLOCK = {"HVDLIKE_DEADLOCK_TIME_SECONDS": "5"}


def _outcome(fn):
    try:
        fn()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank saw
        return f"{type(exc).__name__}: {exc}"


def _misfit_optimizers():
    import torch
    import torch.nn as nn

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r = hvd.rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    params = list(model.parameters())
    report = {}
    # fewer parameters on rank 1
    opt = torch.optim.SGD(params if r == 0 else params[:3], lr=0.1, momentum=0.9)
    report["sizes"] = _outcome(lambda: hvd.broadcast_optimizer_state(opt, root_rank=0))
    # another optimizer class on rank 1 (its state would not fit: KeyError at load)
    opt = (torch.optim.SGD(params, lr=0.1, momentum=0.9) if r == 0
           else torch.optim.Adam(params, lr=0.1))
    report["class"] = _outcome(lambda: hvd.broadcast_optimizer_state(opt, root_rank=0))
    # another model on rank 1: the root's momentum would be loaded for wrong shapes
    other = nn.Linear(3, 2 + r)
    opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    report["shapes"] = _outcome(lambda: hvd.broadcast_optimizer_state(opt, root_rank=0))
    # the job is still in step: a collective right after works on both ranks
    report["after"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after").item()
    hvd.shutdown()
    return report


def test_optimizers_that_do_not_fit_the_roots_fail_on_every_rank():
    results = run_ranks(_misfit_optimizers, np=2, timeout=120, env=FAST_DEADLOCK)
    assert results[0] == results[1], results  # the same error everywhere, root included
    report = results[0]
    assert report["sizes"] == (
        "ValueError: broadcast_optimizer_state: rank 1's optimizer has parameter groups of "
        "sizes [3], rank 0's has [4]; build the same optimizer for the same model on every "
        "rank"), report
    assert report["class"].startswith(
        "ValueError: broadcast_optimizer_state: rank 1's optimizer has a "
        "torch.optim.adam.Adam, rank 0's is a torch.optim.sgd.SGD"), report
    assert report["shapes"].startswith(
        "ValueError: broadcast_optimizer_state: rank 1's optimizer has "
        "param_groups[0]['params'][0] of shape [3, 3], rank 0's is [2, 3]"), report
    assert report["after"] == 2.0


def _state_init_fails_on_one_rank():
    import torch
    import torch.nn as nn

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()

    class Fragile(torch.optim.SGD):
        def step(self, closure=None):
            if hvd.rank() == 1:
                raise ArithmeticError("no step on this rank")
            return super().step(closure)

    model = nn.Linear(3, 1)
    opt = Fragile(model.parameters(), lr=0.1, momentum=0.9)
    outcome = _outcome(lambda: hvd.broadcast_optimizer_state(opt, root_rank=0))
    after = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after").item()
    hvd.shutdown()
    return outcome, after


def test_a_rank_that_cannot_prepare_its_state_fails_every_rank():
    results = run_ranks(_state_init_fails_on_one_rank, np=2, timeout=120, env=FAST_DEADLOCK)
    assert results[0] == ("RuntimeError: broadcast_optimizer_state failed on rank 1: "
                          "ArithmeticError: no step on this rank", 2.0), results
    assert results[1] == ("ArithmeticError: no step on this rank", 2.0), results


def _lbfgs_root_stepped_other_fresh():
    import torch
    import torch.nn as nn

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1 * (hvd.rank() + 1))
    x, y = torch.randn(8, 3), torch.randn(8, 1)

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    if hvd.rank() == 0:
        opt.step(closure)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    state = opt.state_dict()
    summary = (state["param_groups"][0]["lr"], state["state"][0]["n_iter"],
               round(float(state["state"][0]["d"].sum()), 6))
    hvd.shutdown()
    return summary


def test_lbfgs_state_reaches_a_rank_whose_optimizer_never_stepped():
    results = run_ranks(_lbfgs_root_stepped_other_fresh, np=2, timeout=120, env=FAST_DEADLOCK)
    assert results[0] == results[1], results
    assert results[0][0] == 0.1 and results[0][1] >= 1, results


def _param_groups_in_another_order():
    import torch
    import torch.nn as nn

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r = hvd.rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    named = list(model.named_parameters())
    weights = [p for n, p in named if n.endswith("weight")]
    biases = [p for n, p in named if n.endswith("bias")]
    # the same parameters, listed differently on each rank (as built from a set would be)
    groups = ([{"params": weights}, {"params": biases, "lr": 0.0}] if r == 0
              else [{"params": biases[::-1], "lr": 0.0}, {"params": weights[::-1]}])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1),
                                   named_parameters=model.named_parameters())
    torch.manual_seed(1 + r)
    x = torch.randn(5, 3)
    model(x).sum().backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    reduced = {n: p.grad.clone() for n, p in model.named_parameters()}
    hvd.shutdown()
    return local, reduced


def test_ranks_listing_parameters_in_different_orders_still_agree():
    # Horovod matches gradients by name; buckets used to follow the param_groups order
    # and such ranks waited on differently named buckets until the deadlock check.
    results = run_ranks(_param_groups_in_another_order, np=2, timeout=120, env=FAST_DEADLOCK)
    (local0, reduced0), (local1, reduced1) = results
    for name in local0:
        expected = (local0[name] + local1[name]) / 2
        assert reduced0[name].allclose(expected), name
        assert reduced1[name].allclose(expected), name


def _sparse_shapes_differ():
    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r = hvd.rank()
    # rank 1's index 6 lies outside rank 0's dense size 4
    t = torch.sparse_coo_tensor(torch.tensor([[1 + 5 * r]]), torch.tensor([1.0]), (4 + 6 * r,))
    outcome = _outcome(lambda: hvd.synchronize(hvd.sparse_allreduce_async(t, name="sp")))
    same = torch.sparse_coo_tensor(torch.tensor([[r]]), torch.tensor([1.0]), (3,))
    total = hvd.synchronize(hvd.sparse_allreduce_async(same, name="sp2", op=hvd.Sum))
    hvd.shutdown()
    return outcome, total.to_dense().tolist()


def test_sparse_allreduce_of_different_dense_shapes_is_a_mismatch_on_every_rank():
    results = run_ranks(_sparse_shapes_differ, np=2, timeout=120, env=FAST_DEADLOCK)
    for outcome, total in results:
        assert outcome.startswith("MismatchError: ranks disagree on the shape beyond the first "
                                  "dimension of collective 'allgather.sp.dense_shape'"), outcome
        assert "uint8 0x4" in outcome and "uint8 0x10" in outcome, outcome
        assert total == [1.0, 1.0, 0.0]


def _meta_tensors():
    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)  # built for deferred initialization
    outcome = _outcome(lambda: hvd.broadcast_parameters(model.state_dict(), root_rank=0))
    after = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after").item()
    hvd.shutdown()
    return outcome, after


def test_meta_tensors_are_refused_before_they_reach_the_data_plane():
    results = run_ranks(_meta_tensors, np=2, timeout=120, env=FAST_DEADLOCK)
    for outcome, after in results:
        assert outcome.startswith("TypeError: broadcast: cannot communicate a tensor on device "
                                  "'meta'"), outcome
        assert after == 2.0


def _unpicklable_objects():
    import threading

    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r = hvd.rank()
    report = {
        # rank 1 cannot pickle its object: everyone must fail, not wait for its bytes
        "gather": _outcome(lambda: hvd.allgather_object(threading.Lock() if r == 1 else r)),
        # the root cannot pickle what it broadcasts
        "broadcast": _outcome(lambda: hvd.broadcast_object(
            threading.Lock() if r == 0 else None, root_rank=0)),
        # and the job goes on: the next calls work on both ranks
        "after": hvd.allgather_object({"rank": r}),
        "after_broadcast": hvd.broadcast_object("fine" if r == 1 else None, root_rank=1),
    }
    hvd.shutdown()
    return report


def test_an_object_one_rank_cannot_pickle_fails_every_rank_and_the_job_goes_on():
    results = run_ranks(_unpicklable_objects, np=2, timeout=120, env=FAST_DEADLOCK)
    lock = "TypeError: cannot pickle '_thread.lock' object"
    assert results[1]["gather"] == lock, results
    assert results[0]["gather"] == ("RuntimeError: allgather_object: rank 1 could not pickle "
                                    f"its object ({lock})"), results
    assert results[0]["broadcast"] == lock, results
    assert results[1]["broadcast"] == ("RuntimeError: broadcast_object: rank 0 could not "
                                       f"pickle its object ({lock})"), results
    for report in results:
        assert report["after"] == [{"rank": 0}, {"rank": 1}], results
        assert report["after_broadcast"] == "fine", results


def _grouped_mismatches():
    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r = hvd.rank()
    report = {}
    # the same group first agrees a few times: its responses are cached
    report["cached"] = [[t.tolist() for t in hvd.grouped_allreduce(
        [torch.ones(2), torch.ones(3)], op=hvd.Sum, name="g")] for _ in range(3)]
    # the second member differs: the first had been held back for the group, for good
    # (cached, the rank whose member still agreed kept waiting on its cache slot)
    report["second"] = _outcome(lambda: hvd.grouped_allreduce(
        [torch.ones(2), torch.ones(3 if r == 0 else 4)], op=hvd.Sum, name="g"))
    # lists of different lengths: the extra member stayed in flight, stalling the job
    report["length"] = _outcome(lambda: hvd.grouped_allreduce(
        [torch.ones(2)] * (2 + r), op=hvd.Sum, name="h"))
    report["dtype"] = _outcome(lambda: hvd.grouped_allgather(
        [torch.ones(2, 3), torch.ones(2, 3 + r)], name="a"))
    # the names are free again and the job goes on
    report["again"] = [t.tolist() for t in hvd.grouped_allreduce(
        [torch.ones(2), torch.ones(3)], op=hvd.Sum, name="g")]
    report["after"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after").item()
    hvd.shutdown()
    return report


def test_a_group_failing_in_any_member_fails_on_every_rank_and_frees_its_names():
    results = run_ranks(_grouped_mismatches, np=2, timeout=120, env=FAST_DEADLOCK)
    for r, report in enumerate(results):
        assert report["second"].startswith("MismatchError: "), report
        assert "ranks disagree on the shape of collective 'g.1'" in report["second"] or \
            "member of group" in report["second"], report
        assert report["length"].startswith("MismatchError: "), report
        assert "of 2)" in report["length"] and "of 3)" in report["length"], report
        assert report["dtype"].startswith("MismatchError: "), report
        assert report["cached"] == [[[2.0, 2.0], [2.0, 2.0, 2.0]]] * 3, report
        assert report["again"] == [[2.0, 2.0], [2.0, 2.0, 2.0]], report
        assert report["after"] == 2.0, report


def _in_place_on_tensors_that_require_grad():
    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r = hvd.rank()
    report = {}
    t = torch.full((3,), 1.0 + r, requires_grad=True)
    out = hvd.allreduce_(t, op=hvd.Sum, name="x")
    report["in_place"] = (out is t, t.tolist(), t.requires_grad)
    handles = [hvd.allreduce_async_(torch.full((5,), 1.0 + i, requires_grad=True),
                                    op=hvd.Sum, name=f"y{i}") for i in range(3)]
    report["async"] = [hvd.synchronize(h)[0].item() for h in handles]
    grouped = hvd.grouped_allreduce_([torch.ones(2, requires_grad=True),
                                      torch.ones(3, requires_grad=True)], op=hvd.Sum, name="g")
    report["grouped"] = [x.tolist() for x in grouped]
    b = torch.full((2,), float(r), requires_grad=True)
    hvd.broadcast_(b, root_rank=1, name="b")
    report["broadcast"] = b.tolist()
    report["after"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after").item()
    hvd.shutdown()
    return report


def test_in_place_collectives_write_into_tensors_that_require_grad():
    # As Horovod's do (a parameter reduced in place); the shared-memory plane's
    # out= reductions failed on them, killing the runtime on every rank.
    results = run_ranks(_in_place_on_tensors_that_require_grad, np=2, timeout=120,
                        env=FAST_DEADLOCK)
    for report in results:
        assert report == {"in_place": (True, [3.0, 3.0, 3.0], True), "async": [2.0, 4.0, 6.0],
                          "grouped": [[2.0, 2.0], [2.0, 2.0, 2.0]], "broadcast": [1.0, 1.0],
                          "after": 2.0}, report


def _init_with_knobs():
    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    try:
        hvd.init()
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank saw
        return f"{type(exc).__name__}: {exc}"
    r = hvd.rank()
    handles = [hvd.allreduce_async(torch.ones(4) * (r + 1) * (j + 1), op=hvd.Sum, name=f"k{j}")
               for j in range(5)]
    sums = [hvd.synchronize(h)[0].item() for h in handles]
    hvd.shutdown()
    return sums


def test_ranks_whose_shared_settings_differ_fail_init_alike():
    # Different fusion thresholds fused different buffers: rank 1 got wrong sums
    # without an error. Now init() fails on every rank, naming the variable.
    results = run_ranks(_init_with_knobs, np=2, timeout=120, per_rank_env=lambda r: {
        "HVDLIKE_FUSION_THRESHOLD": "0" if r == 0 else "134217728"})
    assert results[0] == results[1], results
    assert results[0] == (
        "ConfigError: init: the ranks disagree on settings every rank of a job must share "
        "(set them alike on every rank, or only in the launcher's environment):\n"
        "  HVDLIKE_FUSION_THRESHOLD (or HOROVOD_FUSION_THRESHOLD): rank 0 0, rank 1 134217728")
    # Alike through either name: no error, the right sums.
    results = run_ranks(_init_with_knobs, np=2, timeout=120, per_rank_env=lambda r: {
        ("HVDLIKE_FUSION_THRESHOLD" if r == 0 else "HOROVOD_FUSION_THRESHOLD"): "1000"})
    assert results == [[3.0, 6.0, 9.0, 12.0, 15.0]] * 2, results


def _one_rank_shuts_down_early():
    import time

    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r = hvd.rank()
    hvd.allreduce(torch.ones(1), name="a")
    if r == 1:
        hvd.shutdown()
        time.sleep(3)
        return "left"
    time.sleep(1.5)
    return _outcome(lambda: hvd.allreduce(torch.ones(1), name="x"))


def test_a_call_after_a_peer_shut_the_job_down_names_the_peer():
    results = run_ranks(_one_rank_shuts_down_early, np=2, timeout=120)
    assert results[1] == "left"
    assert results[0].startswith("HvdlikeInternalError: cannot submit 'allreduce.x': hvdlike has shut "
                                 "down: rank 1 on "), results
    assert "shut down (called shutdown() or its script ended)" in results[0], results


class _FailsToRebuild:
    def __reduce__(self):
        return (int, ("not a number",))


def _objects_that_do_not_unpickle():
    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r = hvd.rank()
    report = {
        "broadcast": _outcome(lambda: hvd.broadcast_object(
            _FailsToRebuild() if r == 0 else None, root_rank=0)),
        "allgather": _outcome(lambda: hvd.allgather_object(_FailsToRebuild() if r == 1 else r)),
        "after": hvd.allgather_object(r),
    }
    mine = {"k": [1, 2]}
    back = hvd.broadcast_object(mine if r == 0 else None, root_rank=0)
    # The root gets its own object back (Horovod's identity), the others an equal copy.
    report["root object"] = back is mine if r == 0 else back == mine
    hvd.shutdown()
    return report


def test_an_object_that_cannot_be_rebuilt_is_named_as_such_on_every_rank():
    # It surfaced as the unpickler's bare ValueError, saying nothing of where it came from.
    results = run_ranks(_objects_that_do_not_unpickle, np=2, timeout=120)
    for report in results:
        assert report == {
            "broadcast": "RuntimeError: broadcast_object: rank 0's object could not be "
                         "unpickled on this rank: ValueError: invalid literal for int() with "
                         "base 10: 'not a number'",
            "allgather": "RuntimeError: allgather_object: rank 1's object could not be "
                         "unpickled on this rank: ValueError: invalid literal for int() with "
                         "base 10: 'not a number'",
            "after": [0, 1], "root object": True}, report


def _differing_state_dicts():
    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r = hvd.rank()
    torch.manual_seed(r)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    state = model.state_dict()
    if r == 1:  # a rank that built its model differently: one key more, one less
        state["extra.weight"] = torch.zeros(1)
        del state["0.bias"]
    outcome = _outcome(lambda: hvd.broadcast_parameters(state, root_rank=0))
    # Same names in another order are fine, and the values then agree.
    items = list(model.state_dict().items())
    hvd.broadcast_parameters(items[::-1] if r == 1 else items, root_rank=0)
    weights = hvd.allgather(model[0].weight.detach().reshape(1, -1), name="weights")
    hvd.shutdown()
    return outcome, bool((weights[0] == weights[1]).all())


def test_broadcast_parameters_with_different_names_fails_on_every_rank_naming_them():
    # Before, rank 0 returned and rank 1 waited for 'extra.weight' until the
    # deadlock check ended the job.
    results = run_ranks(_differing_state_dicts, np=2, timeout=120,
                        env={"HVDLIKE_DEADLOCK_TIME_SECONDS": "300"})
    for outcome, same in results:
        assert outcome == ("ValueError: broadcast_parameters: the ranks pass different names "
                           "(root rank 0): rank 1 has 'extra.weight' that rank 0 lacks and "
                           "lacks '0.bias'; pass the same model's parameters on every rank"), \
            outcome
        assert same


def _models_that_differ(kind):
    import torch
    from torch import nn

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r = hvd.rank()
    if kind == "transposed":  # the same number of elements: the bucket's length agrees
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)) if r == 0 else \
            nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 8))
    else:  # one layer one row wider on rank 1: the lengths differ too
        model = nn.Sequential(nn.Linear(4, 8 + r), nn.Linear(8 + r, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(2, model[0].in_features)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        opt.step()
        outcome = "stepped"
    except hvd.HorovodInternalError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    hvd.shutdown()
    return outcome, unchanged


def test_ranks_whose_models_differ_in_shape_fail_their_step_showing_the_shapes():
    # The transposed pair used to train silently on mismatched tensors: a bucket
    # was negotiated by its flat length alone.
    for kind, disagree, shapes in (
            ("transposed", "the member shapes (the ranks' models differ)",
             ("average holding 4,4x8,8,8x4", "average holding 8,8x4,4,4x8")),
            ("wider", "the shape", ("allreduce float32 76 cpu average holding 4,4x8,8,8x4",
                                    "allreduce float32 85 cpu average holding 4,4x9,9,9x4"))):
        for outcome, unchanged in run_ranks(_models_that_differ, np=2, args=(kind,),
                                            timeout=90):
            assert outcome.startswith(f"MismatchError: ranks disagree on {disagree} of "
                                      "collective 'allreduce.DistributedOptimizer.bucket."), outcome
            assert "rank 0: allreduce float32" in outcome and shapes[0] in outcome, outcome
            assert shapes[1] in outcome, outcome
            assert unchanged
