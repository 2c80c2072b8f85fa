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
