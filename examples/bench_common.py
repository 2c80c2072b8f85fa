"""Shared pieces of the side-by-side benchmark: alternation, models, CPU and memory probes.

Everything here runs inside one rank started by ``torchrun``; the same
process holds the default torch.distributed Gloo group (DDP and raw Gloo
contenders) and a hvdlike runtime (its own private groups), so contenders
can be alternated step block by step block on identical inputs.
"""

from __future__ import annotations

import os
import resource
import statistics
import threading
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

Step = Callable[[], float]  # runs one timed step, returns its seconds


def alternate(contenders: Dict[str, Step], reps: int, steps: int, warmup: int) -> Dict[str, list]:
    """Run every contender ``reps`` times for ``steps`` timed steps, rotating the order.

    Rotation spreads the machine's background noise (other processes on a
    shared host) over all contenders instead of letting it land on one. Each
    block starts with a barrier and ``warmup`` untimed steps (more on the
    first block) so caches and negotiation are warm when timing starts.

    Returns:
        contender -> per-step seconds, where each step's time is the slowest
        rank's (a data-parallel step is over when every rank is done).
    """
    names = list(contenders)
    samples: Dict[str, List[float]] = {n: [] for n in names}
    for rep in range(reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            step = contenders[name]
            dist.barrier()
            for _ in range(warmup * 3 if rep == 0 else warmup):
                step()
            dist.barrier()
            samples[name].extend(step() for _ in range(steps))
    return {n: slowest_rank(v) for n, v in samples.items()}


def slowest_rank(values: List[float]) -> List[float]:
    """Element-wise maximum of ``values`` over ranks."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def fastest_rank(values: List[float]) -> List[float]:
    """Element-wise minimum of ``values`` over ranks."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.tolist()


def median(values: List[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summary(values: List[float]) -> dict:
    """Median, quartiles and count of a list of seconds."""
    if not values:
        return {"median": float("nan"), "p25": float("nan"), "p75": float("nan"), "n": 0}
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "p25": q[0], "p75": q[2], "n": len(values)}


def minor_faults() -> int:
    """Minor page faults of this whole process so far (every thread's)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def faults_counted(fn: Callable[[], object], sink: List[int]) -> Callable[[], None]:
    """``fn``, appending to ``sink`` the minor page faults the process took during each call.

    A step whose buffers the allocator maps afresh (and the kernel zeroes)
    pays a fault per 4 KiB page touched first; reported next to the step
    times so a contender slowed by that is visible as such.
    """
    def step() -> None:
        before = minor_faults()
        fn()
        sink.append(minor_faults() - before)

    return step


def faults_per_step(faults: Dict[str, List[int]]) -> Dict[str, float]:
    """Per contender, the median of :func:`faults_counted`'s counts on the busiest rank."""
    return dict(zip(faults, slowest_rank([float(median(v)) for v in faults.values()])))


def timed(fn: Callable[[], object]) -> Step:
    def step() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return step


# -- models -------------------------------------------------------------------

def mlp(layers: int, width: int) -> torch.nn.Module:
    """``layers`` Linear(width, width) with ReLU between (2 tensors per layer)."""
    mods: List[torch.nn.Module] = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i != layers - 1:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)


def make_model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(1234)  # every contender and every rank starts from the same weights
    return mlp(layers, width)


def batch(rank: int, size: int, width: int):
    gen = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(size, width, generator=gen), torch.randn(size, width, generator=gen))


def train_step(model, optimizer, x, y) -> Callable[[], None]:
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()

    return step


# -- probes -------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def thread_cpu_seconds(native_id: int) -> float:
    """user+system CPU seconds of one thread of this process (Linux /proc)."""
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def threads_named(prefix: str) -> List[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.native_id]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def loadavg() -> Optional[List[float]]:
    try:
        return list(os.getloadavg())
    except OSError:
        return None
