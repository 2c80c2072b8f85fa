"""Data-parallel training of a small MLP on scikit-learn's digits with hvdlike.torch.

Run on two ranks (or one, for comparison)::

    hvdlike-run -np 2 python examples/torch_digits.py
    python examples/torch_digits.py

The 8x8 digit images ship with scikit-learn (``pip install scikit-learn``),
so nothing is downloaded. Each rank trains on its own shard of the training
set; ``hvd.DistributedOptimizer`` averages the gradients, so the global batch
is ``--batch-size`` times the number of ranks and the learning rate is scaled
by the same factor, as in Horovod's recipe. Rank 0 shows a progress bar and
the last line reports the test accuracy over the whole test set (every rank
scores its share; the counts are summed with an allreduce).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

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


def shard(n: int, epoch: int, rank: int, size: int) -> torch.Tensor:
    """This rank's indices for ``epoch``: a shared shuffle, padded so every rank
    gets the same count (equal step counts keep the ranks in lockstep)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1000 + epoch))
    per_rank = math.ceil(n / size)
    order = torch.cat([order, order[:per_rank * size - n]])
    return order[rank::size]


class Progress:
    """A dependency-free progress bar, drawn on rank 0 only.

    On a terminal it redraws in place; through a pipe (``hvdlike-run``
    prefixes each rank's lines) it prints one line every ``every`` steps.
    """

    def __init__(self, total: int, enabled: bool, every: int, width: int = 30):
        self.total, self.enabled, self.every, self.width = total, enabled, every, width
        self.tty = sys.stdout.isatty()
        self.done = 0
        self.started = time.monotonic()

    def update(self, note: str) -> None:
        self.done += 1
        last = self.done == self.total
        if not self.enabled or not (self.tty or last or self.done % self.every == 0):
            return
        filled = int(self.width * self.done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.monotonic() - self.started
        line = f"[{bar}] {self.done}/{self.total} {note} {elapsed:5.1f}s"
        if self.tty:
            sys.stdout.write("\r" + line + ("\n" if last else ""))
        else:
            sys.stdout.write(line + "\n")
        sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="per rank; scaled by size")
    parser.add_argument("--fp16-allreduce", action="store_true")
    parser.add_argument("--sync-bn", action="store_true", help="use SyncBatchNorm")
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    (x_train, y_train), (x_test, y_test) = load_digits()

    torch.manual_seed(rank)  # different on purpose: broadcast_parameters aligns the ranks
    # SyncBatchNorm normalizes over the global batch, so every rank keeps the
    # same running statistics (a plain BatchNorm1d would drift apart per rank).
    norm = [hvd.SyncBatchNorm(64)] if args.sync_bn else []
    model = nn.Sequential(nn.Linear(64, 64), *norm, nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    steps_per_epoch = math.ceil(math.ceil(len(x_train) / size) / args.batch_size)
    progress = Progress(args.epochs * steps_per_epoch, enabled=rank == 0, every=steps_per_epoch)
    started = time.monotonic()
    for epoch in range(args.epochs):
        model.train()
        mine = shard(len(x_train), epoch, rank, size)
        for step in range(steps_per_epoch):
            idx = mine[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            optimizer.step()
            progress.update(f"epoch {epoch + 1}/{args.epochs} loss {loss.item():.3f}")
        scheduler.step()

    model.eval()
    with torch.no_grad():
        mine = torch.arange(rank, len(x_test), size)  # every test example exactly once
        correct = (model(x_test[mine]).argmax(1) == y_test[mine]).sum()
    counts = hvd.allreduce(torch.stack([correct, torch.tensor(len(mine))]).double(), op=hvd.Sum)
    accuracy = float(counts[0] / counts[1])
    elapsed = time.monotonic() - started
    if rank == 0:
        print(f"torch_digits: {size} rank(s), {args.epochs} epochs, "
              f"global batch {args.batch_size * size}, {elapsed:.1f}s training; "
              f"test accuracy {accuracy:.4f} on {int(counts[1])} images")
    hvd.shutdown()


if __name__ == "__main__":
    main()
