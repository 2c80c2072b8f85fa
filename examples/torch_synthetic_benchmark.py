"""Synthetic-data training throughput with hvdlike.torch (images/sec per rank and total).

Run::

    hvdlike-run -np 2 python examples/torch_synthetic_benchmark.py
    hvdlike-run -np 2 python examples/torch_synthetic_benchmark.py --model mlp --fp16-allreduce

Every rank trains the same small model on random images that never change,
so the numbers measure compute plus gradient communication, not data
loading. After ``--num-warmup-batches`` untimed steps, ``--num-iters``
iterations of ``--num-batches-per-iter`` steps are timed; each rank reports
its mean images/sec (with a 95% interval over the iterations) and rank 0
prints the total over all ranks.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import hvdlike.torch as hvd


def make_model(kind: str, image_size: int, classes: int) -> nn.Module:
    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * image_size * image_size, 256),
                             nn.ReLU(), nn.Linear(256, classes))
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * (image_size // 4) ** 2, 128), nn.ReLU(),
        nn.Linear(128, classes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("cnn", "mlp"), default="cnn")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--num-warmup-batches", type=int, default=3)
    parser.add_argument("--num-batches-per-iter", type=int, default=5)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--fp16-allreduce", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(args.threads)
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = make_model(args.model, args.image_size, 10)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01 * size, momentum=0.9),
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, 10, (args.batch_size,))

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"model {args.model} ({params} parameters), batch {args.batch_size} per rank, "
              f"{size} rank(s), fp16 allreduce: {args.fp16_allreduce}", flush=True)
    for _ in range(args.num_warmup_batches):
        step()
    rates = []
    for i in range(args.num_iters):
        started = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            step()
        rate = args.batch_size * args.num_batches_per_iter / (time.perf_counter() - started)
        rates.append(rate)
        if rank == 0:
            print(f"iter {i}: {rate:.1f} img/sec on rank 0", flush=True)
    mean = statistics.fmean(rates)
    spread = 1.96 * statistics.stdev(rates) if len(rates) > 1 else 0.0
    per_rank = hvd.allgather_object((mean, spread))
    if rank == 0:
        for r, (m, s) in enumerate(per_rank):
            print(f"rank {r}: {m:.1f} +-{s:.1f} img/sec")
        total = sum(m for m, _ in per_rank)
        total_spread = sum(s for _, s in per_rank)
        print(f"total on {size} rank(s): {total:.1f} +-{total_spread:.1f} img/sec", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
