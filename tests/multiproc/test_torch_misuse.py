"""Misuse across ranks ends in a clear error on every rank, never a hang."""

from tests.multiproc.harness import run_ranks


def _one_rank_skips_backward():
    import torch
    import torch.nn as nn

    import hvdlike.torch as hvd

    hvd.init()
    model = nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    if hvd.rank() == 0:
        model(torch.randn(2, 3)).sum().backward()
    opt.step()  # rank 1 has nothing to reduce; rank 0 waits for its gradients
    hvd.barrier()


def test_a_rank_stepping_without_backward_is_reported_by_the_stall_inspector():
    codes, outputs = run_ranks(
        _one_rank_skips_backward, np=2, timeout=90, expect_failure=True,
        env={"HVDLIKE_STALL_CHECK_TIME_SECONDS": "2",
             "HVDLIKE_STALL_SHUTDOWN_TIME_SECONDS": "4"})
    assert codes == [1, 1]
    for out in outputs.values():
        assert "StallError" in out
    # rank 0 learns which gradients rank 1 never sent (one bucket: bias and weight)
    assert "'allreduce.DistributedOptimizer.bucket.0.bias..weight': waited" in outputs[0]
    assert "missing rank(s) 1" in outputs[0]


def _step_fails_then_training_goes_on():
    import torch

    import hvdlike.torch as hvd

    hvd.init()
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 + hvd.rank()))
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    hvd.shutdown()
    opt.zero_grad()
    model(x).sum().backward()
    try:
        opt.step()  # the runtime is gone: the step fails
        failed = None
    except Exception as exc:  # noqa: BLE001 - recorded for the parent
        failed = type(exc).__name__
    hvd.init()
    opt.zero_grad()  # used to refuse: "gradients are still being reduced"
    model(x).sum().backward()
    opt.step()
    weights = hvd.allgather(model.weight.detach().reshape(1, -1))
    hvd.shutdown()
    return failed, bool(torch.equal(weights[0], weights[1]))


def test_a_failed_step_leaves_the_optimizer_ready_for_the_next_round():
    for failed, identical in run_ranks(_step_fails_then_training_goes_on, np=2, timeout=90):
        assert failed == "NotInitializedError"
        assert identical


def _clip_after_backward_without_synchronize():
    import torch

    import hvdlike.torch as hvd

    hvd.init()
    model = torch.nn.Linear(3, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(2, 3)).sum().backward()  # reductions start here (overlap on)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)  # too late for them
    try:
        opt.step()
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    # The documented recipe, then training goes on.
    opt.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with opt.skip_synchronize():
        opt.step()
    hvd.shutdown()
    return refused


def test_a_gradient_changed_while_its_reduction_runs_is_refused_not_lost():
    for refused in run_ranks(_clip_after_backward_without_synchronize, np=2, timeout=90,
                             env={"HVDLIKE_CPU_OVERLAP": "1"}):
        assert "was changed after backward()" in refused and "skip_synchronize" in refused
