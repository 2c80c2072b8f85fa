"""The ``floor`` workload: what any synchronous data-parallel step must add to compute.

``train_large``'s hvdlike step is compared with compute alone; this workload
measures, in the same rotating blocks and on the same model and batches, the
least a step that averages gradients across the ranks of one host can add,
with no runtime at all in the way:

* ``barrier``: compute, then one barrier on shared memory (every step waits
  for the slower rank, as any synchronous reduction must);
* ``copy``: compute, each gradient copied into a shared segment in its hook,
  while backward still runs (every gradient byte touched once);
* ``copy_barrier``: both;
* ``segment``: both, then every member averages its portion of every
  gradient in place across the members' copies in the segment and the
  gradients become views into it -- the whole reduction with nothing but
  tensor ops on shared memory, no negotiation, no fusion, no thread;
* ``hvdlike``: ``DistributedOptimizer``, as in ``train_large``.

All ranks must share one host (the segment is a file in ``/dev/shm``).
``segment`` and ``hvdlike`` take the same steps on the same batches, so their
parameters must agree: the result reports the largest difference.
"""

from __future__ import annotations

import copy
import mmap
import os
import secrets
import socket
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from bench_common import alternate, batch, make_model, summary, timed, train_step

LINE = 64          # bytes between two members' counters (one cache line each)
SPIN = 200         # yields before a waiting member starts sleeping
WAIT_SECONDS = 60  # a member that waits longer than this gives up


class _Segment:
    """One file in /dev/shm: a counter per member, then one gradient copy per member."""

    def __init__(self, members: int, me: int, numel: int):
        self.members, self.me, self.numel = members, me, numel
        header = LINE * members
        size = header + members * numel * 4
        name = [f"/dev/shm/hvdlike-bench-floor-{secrets.token_hex(8)}" if me == 0 else None]
        dist.broadcast_object_list(name, src=0)
        self.path = name[0]
        if me == 0:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)
        dist.barrier()
        if me != 0:
            fd = os.open(self.path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        dist.barrier()
        if me == 0:  # every member has it mapped: no exit path can leave the file behind
            os.unlink(self.path)
        self.counters = torch.frombuffer(self._mm, dtype=torch.int64, count=header // 8)
        self.copies = [torch.frombuffer(self._mm, dtype=torch.float32, count=numel,
                                        offset=header + m * numel * 4) for m in range(members)]
        self._arrived = 0

    def barrier(self) -> None:
        """Wait until every member has arrived as often as this one."""
        self._arrived += 1
        self.counters[self.me * LINE // 8] = self._arrived
        deadline = time.monotonic() + WAIT_SECONDS
        for m in range(self.members):
            spins = 0
            while int(self.counters[m * LINE // 8]) < self._arrived:
                spins += 1
                if spins < SPIN:
                    os.sched_yield()
                else:
                    time.sleep(50e-6)
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"floor: member {m} did not arrive within "
                                           f"{WAIT_SECONDS} s")

    def average_portion(self) -> None:
        """Average this member's portion across every member's copy, written to all."""
        step = -(-self.numel // self.members)
        lo, hi = self.me * step, min(self.numel, (self.me + 1) * step)
        if lo >= hi:
            return
        mine = self.copies[self.me][lo:hi]
        for m in range(self.members):
            if m != self.me:
                mine.add_(self.copies[m][lo:hi])
        mine.mul_(1.0 / self.members)
        for m in range(self.members):
            if m != self.me:
                self.copies[m][lo:hi].copy_(mine)

    def close(self) -> None:
        self.counters = self.copies = None
        self._mm.close()


def _floor_step(model, x, y, segment: _Segment, copy_in: bool, wait: bool,
                reduce: bool, lr: float):
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr)
    offsets, at = [], 0
    for p in params:
        offsets.append(at)
        at += p.numel()
    mine = segment.copies[segment.me]
    slots = [mine[o:o + p.numel()].view_as(p) for o, p in zip(offsets, params)]
    if copy_in:
        def copier(slot):
            def hook(p) -> None:
                slot.copy_(p.grad)
            return hook

        for p, slot in zip(params, slots):
            p.register_post_accumulate_grad_hook(copier(slot))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if wait:
            segment.barrier()
        if reduce:
            segment.average_portion()
            segment.barrier()
            for p, slot in zip(params, slots):
                p.grad = slot
        opt.step()
        if reduce:
            for p in params:
                p.grad = None  # the next backward must not accumulate into the segment

    return step


def floor(hvd, cfg, layers: int = 8, width: int = 1024, batch_size: int = 64) -> dict:
    from bench_workloads import _hvd_optimizer

    hosts: List[str] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    if len(set(hosts)) != 1:
        return {"skipped": f"the ranks span hosts {sorted(set(hosts))}; the floor's "
                           "segment needs them on one"}
    rank, size = dist.get_rank(), dist.get_world_size()
    x, y = batch(rank, batch_size, width)
    lr = 1e-4
    base = make_model(layers, width)
    numel = sum(p.numel() for p in base.parameters())
    segment = _Segment(size, rank, numel)
    try:
        models: Dict[str, torch.nn.Module] = {}
        contenders = {}
        for name, copy_in, wait, reduce in (("compute", False, False, False),
                                            ("barrier", False, True, False),
                                            ("copy", True, False, False),
                                            ("copy_barrier", True, True, False),
                                            ("segment", True, True, True)):
            models[name] = copy.deepcopy(base)
            contenders[name] = timed(_floor_step(models[name], x, y, segment, copy_in, wait,
                                                 reduce, lr))
        models["hvdlike"] = copy.deepcopy(base)
        opt_hvd, kind = _hvd_optimizer(hvd, models["hvdlike"], lr)
        contenders["hvdlike"] = timed(train_step(models["hvdlike"], opt_hvd, x, y))
        samples = alternate(contenders, cfg["reps"], cfg["steps"], cfg["warmup"])
        diff = max((a - b).abs().max().item() for a, b in
                   zip(models["segment"].parameters(), models["hvdlike"].parameters()))
        dist.barrier()
    finally:
        segment.close()
    return {"layers": layers, "width": width, "batch": batch_size, "params": numel,
            "hvdlike_optimizer": kind, "max_param_diff_segment_vs_hvdlike": diff,
            **{n: summary(v) for n, v in samples.items()}}

