r"""Elastic training of the digits classifier: ranks may die or join mid-run.

Run elastically (2 to 4 ranks on this machine; see docs/elastic.md)::

    hvdlike-run -np 4 --min-np 2 --max-np 4 -H 127.0.0.1:2,127.0.0.2:2 \
        python examples/torch_elastic_digits.py

Kill a rank mid-run (``--kill-rank-at-step N`` makes the last rank SIGKILL
itself after N committed steps, once): the survivors restore the last commit,
re-form without the lost host and finish every epoch. The last line reports
the test accuracy and the number of committed steps.

The training loop is ``hvd.elastic.run`` around a loop over an
``ElasticSampler``: what an epoch has already processed is never dealt again
after a re-form, and the state (model, optimizer, sampler, epoch, step count)
is committed after every batch.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.nn as nn
import torch.nn.functional as F

import hvdlike.torch as hvd


def load_digits(test_size: int = 397):
    """Digits scaled to [0, 1], shuffled with a fixed seed, split train/test."""
    from sklearn.datasets import load_digits as sk_digits

    data = sk_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    return (x[test_size:], y[test_size:]), (x[:test_size], y[:test_size])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--kill-rank-at-step", type=int, default=0,
                        help="the last rank of the first generation SIGKILLs itself here")
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    (x_train, y_train), (x_test, y_test) = load_digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(range(len(x_train)), shuffle=True, seed=0)
    victim = os.environ.get("HVDLIKE_ELASTIC_WORKER") == f"w{hvd.size() - 1}"

    @hvd.elastic.run
    def train(state):
        while state.epoch < args.epochs:
            indices = list(state.sampler)
            batches = range(0, len(indices), args.batch_size)
            for batch_idx, start in enumerate(batches):
                if victim and args.kill_rank_at_step and state.steps == args.kill_rank_at_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                idx = torch.tensor(indices[start:start + args.batch_size])
                optimizer.zero_grad()
                F.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
                optimizer.step()
                state.sampler.record_batch(batch_idx, args.batch_size)
                state.steps += 1
                state.commit()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler,
                                   epoch=0, steps=0)
    state.register_reset_callbacks([lambda: hvd.rank() == 0 and print(
        f"torch_elastic_digits: re-formed with {hvd.size()} rank(s) at step {state.steps}",
        flush=True)])
    train(state)

    model.eval()
    with torch.no_grad():
        mine = torch.arange(hvd.rank(), len(x_test), hvd.size())
        correct = (model(x_test[mine]).argmax(1) == y_test[mine]).sum()
    counts = hvd.allreduce(torch.stack([correct, torch.tensor(len(mine))]).double(), op=hvd.Sum)
    if hvd.rank() == 0:
        print(f"torch_elastic_digits: {hvd.size()} rank(s) at the end, {args.epochs} epochs, "
              f"{state.steps} committed steps; test accuracy {float(counts[0] / counts[1]):.4f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
