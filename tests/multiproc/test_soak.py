"""Soak: 2,000 training steps with threads and resident memory stable.

Marked ``soak``: excluded from the default run, run on demand with
``python -m pytest -m soak tests/multiproc/test_soak.py``.
"""

import pytest

from tests.multiproc.harness import run_ranks


def _train(steps):
    import threading

    import psutil
    import torch

    import hvdlike.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    proc = psutil.Process()
    samples = {}
    gen = torch.Generator().manual_seed(hvd.rank())
    for step in range(steps):
        x = torch.randn(16, 32, generator=gen)
        y = torch.randint(0, 4, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step in (steps // 4, steps - 1):
            samples[step] = (threading.active_count(), proc.memory_info().rss)
    hvd.shutdown()
    return samples


@pytest.mark.soak
def test_two_thousand_steps_stable():
    steps = 2000
    for samples in run_ranks(_train, np=2, args=(steps,), timeout=900):
        (threads_a, rss_a), (threads_b, rss_b) = samples[steps // 4], samples[steps - 1]
        assert threads_a == threads_b
        assert rss_b <= rss_a * 1.01 + 1024 * 1024, (rss_a, rss_b)
