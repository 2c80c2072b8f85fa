"""Rank side of the side-by-side benchmark (started by ``examples/benchmark.py`` via torchrun).

Each workload returns a JSON-ready dict of per-contender summaries (seconds).
Contenders of one workload are alternated in rotating blocks (see
:func:`bench_common.alternate`) on identical models, batches and threads.

Run directly only through torchrun, e.g.::

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        examples/bench_workloads.py '{"quick": true, "json": "/tmp/b.json"}'
"""

from __future__ import annotations

import copy
import json
import os
import platform
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from bench_common import (alternate, batch, fastest_rank, faults_counted, faults_per_step,
                          loadavg, make_model, rss_bytes, slowest_rank, summary,
                          thread_cpu_seconds, threads_named, timed, train_step)

KIB = 1024
MIB = 1024 * 1024


def _hvd_optimizer(hvd, model, lr):
    """hvdlike's DistributedOptimizer when the build has it, else a minimal hook loop."""
    base = torch.optim.SGD(model.parameters(), lr=lr)
    factory = getattr(hvd, "DistributedOptimizer", None)
    if factory is None:
        try:
            from hvdlike.torch.optimizer import DistributedOptimizer as factory
        except ImportError:
            factory = None
    if factory is not None:
        return factory(base, named_parameters=model.named_parameters()), "DistributedOptimizer"
    return _HookLoop(hvd, model, base), "hook-loop"


class _HookLoop:
    """Fallback: per-parameter hooks start allreduce_async_, step() synchronizes."""

    def __init__(self, hvd, model, base):
        self.hvd, self.base, self.handles = hvd, base, []
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(
                lambda p, name=name: self.handles.append(
                    hvd.allreduce_async_(p.grad, name=f"hook.{name}")))

    def zero_grad(self, set_to_none=True):
        self.base.zero_grad(set_to_none=set_to_none)

    def step(self):
        for h in self.handles:
            self.hvd.synchronize(h)
        self.handles = []
        self.base.step()


def training(hvd, cfg, layers: int, width: int, batch_size: int) -> dict:
    """One training step: hvdlike DistributedOptimizer vs DDP vs compute alone."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    x, y = batch(rank, batch_size, width)
    lr = 1e-4
    base = make_model(layers, width)
    m_hvd, m_ddp, m_cpu = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    opt_hvd, kind = _hvd_optimizer(hvd, m_hvd, lr)
    ddp = DDP(m_ddp)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=lr)
    opt_cpu = torch.optim.SGD(m_cpu.parameters(), lr=lr)
    faults: Dict[str, List[int]] = {"hvdlike": [], "ddp": [], "compute": []}
    contenders = {
        "hvdlike": timed(faults_counted(train_step(m_hvd, opt_hvd, x, y), faults["hvdlike"])),
        "ddp": timed(faults_counted(train_step(ddp, opt_ddp, x, y), faults["ddp"])),
        "compute": timed(faults_counted(train_step(m_cpu, opt_cpu, x, y), faults["compute"])),
    }
    samples = alternate(contenders, cfg["reps"], cfg["steps"], cfg["warmup"])
    per_step = faults_per_step(faults)  # warm-up steps included
    # Same start, same batches, same number of steps: hvdlike and DDP must agree.
    diff = max((a - b).abs().max().item() for a, b in zip(m_hvd.parameters(), m_ddp.parameters()))
    params = sum(p.numel() for p in base.parameters())
    tensors = len(list(base.parameters()))
    return {"layers": layers, "width": width, "batch": batch_size, "params": params,
            "tensors": tensors, "hvdlike_optimizer": kind, "max_param_diff_vs_ddp": diff,
            **{n: dict(summary(v), minor_faults_per_step=per_step[n])
               for n, v in samples.items()}}


def allreduce_sizes(hvd, cfg) -> dict:
    """One allreduce per size: hvdlike vs raw Gloo, time and bus bandwidth."""
    size = dist.get_world_size()
    rows = {}
    for nbytes in cfg["sizes"]:
        a = torch.ones(nbytes // 4)
        b = torch.ones(nbytes // 4)
        src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        name = f"bench.allreduce.{nbytes}"
        contenders = {
            "hvdlike": timed(lambda: hvd.allreduce_(a, op=hvd.Sum, name=name)),
            "gloo": timed(lambda: dist.all_reduce(b)),
            # The physical floor inside a host: one copy of the same bytes.
            "memcpy": timed(lambda: dst.copy_(src)),
        }
        big = nbytes >= 16 * MIB
        # Calls of a few microseconds: four times the samples (still one call
        # each), so a median is not decided by a few blocks that started with
        # both ranks on one core.
        steps = max(3, cfg["steps"] // 2) if big else cfg["steps"] * (4 if nbytes < MIB else 1)
        samples = alternate(contenders, cfg["reps"], steps, 1 if big else cfg["warmup"])
        row = {}
        for n, v in samples.items():
            s = summary(v)
            s["busbw_GBps"] = 2 * (size - 1) / size * nbytes / s["median"] / 1e9
            row[n] = s
        rows[str(nbytes)] = row
    return rows


def many_small(hvd, cfg) -> dict:
    """500 x 4 KiB submitted asynchronously, then synchronized."""
    count, numel = cfg["many_count"], 4 * KIB // 4
    t_hvd = [torch.ones(numel) for _ in range(count)]
    t_gloo = [torch.ones(numel) for _ in range(count)]
    t_flat = [torch.ones(numel) for _ in range(count)]

    def run_hvd():
        handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"bench.many.{i}")
                   for i, t in enumerate(t_hvd)]
        for h in handles:
            hvd.synchronize(h)

    def run_gloo():
        works = [dist.all_reduce(t, async_op=True) for t in t_gloo]
        for w in works:
            w.wait()

    def run_flat():
        flat = torch.cat(t_flat)
        dist.all_reduce(flat)
        for t, part in zip(t_flat, flat.split(numel)):
            t.copy_(part)

    contenders = {"hvdlike": timed(run_hvd), "gloo_per_tensor": timed(run_gloo),
                  "gloo_flattened": timed(run_flat)}
    samples = alternate(contenders, cfg["reps"], cfg["steps"], cfg["warmup"])
    return {"count": count, "bytes_each": 4 * KIB, **{n: summary(v) for n, v in samples.items()}}


def overhead(hvd, cfg) -> dict:
    """Negotiation per cycle with N cached tensors, and background CPU while idle."""
    from hvdlike.core import api

    state = api.runtime().process_sets[0]
    ctl = state.controller
    cycles: List[tuple] = []
    original = ctl.cycle

    def cycle(entries, *args, **kwargs):
        start = time.perf_counter()
        result = original(entries, *args, **kwargs)
        cycles.append((time.perf_counter() - start, len(result.work), ctl.last_control_seconds))
        return result

    ctl.cycle = cycle  # instance attribute: timing wrapper, removed below
    n = cfg["cached_count"]
    tensors = [torch.ones(1) for _ in range(n)]
    one = torch.zeros(1)
    try:
        def run_hvd():
            hvd.synchronize(hvd.grouped_allreduce_async_(tensors, op=hvd.Sum,
                                                         name="bench.cached"))

        contenders = {"hvdlike_group": timed(run_hvd),
                      "gloo_1_element": timed(lambda: dist.all_reduce(one))}
        cycles.clear()
        samples = alternate(contenders, cfg["reps"], cfg["steps"] * 2, cfg["warmup"])
        full = [(t, c) for t, w, c in cycles if w == n]
    finally:
        del ctl.cycle
    keep = full[-min(len(full), cfg["reps"] * cfg["steps"]):]
    # A cycle's control collective also holds the time one rank waits for the
    # other to arrive; the last rank to arrive sees the collective's own cost.
    negotiation = slowest_rank([t for t, _ in keep])
    control = fastest_rank([c for _, c in keep])
    bookkeeping = slowest_rank([t - c for t, c in keep])
    out = {"cached_tensors": n,
           "fast_cycles": ctl.fast_cycles, "cycles": ctl.cycles,
           "negotiation_cycle": summary(negotiation),
           "control_collectives": summary(control),
           "bookkeeping": summary(bookkeeping),
           "gloo_1_element": summary(samples["gloo_1_element"]),
           "hvdlike_group_roundtrip": summary(samples["hvdlike_group"])}
    out["idle_cpu"] = idle_cpu(cfg["idle_seconds"])
    return out


def idle_cpu(seconds: float) -> dict:
    """CPU fraction the runtime's threads use while this rank only computes or sleeps."""
    threads = threads_named("hvdlike-")
    out = {}
    for mode in ("sleeping", "computing"):
        dist.barrier()
        before = {t.name: thread_cpu_seconds(t.native_id) for t in threads}
        start = time.perf_counter()
        if mode == "sleeping":
            time.sleep(seconds)
        else:
            a = torch.randn(256, 256)
            while time.perf_counter() - start < seconds:
                a = torch.tanh(a @ a)
        wall = time.perf_counter() - start
        used = {t.name: thread_cpu_seconds(t.native_id) - before[t.name] for t in threads}
        total = torch.tensor([sum(used.values()) / wall], dtype=torch.float64)
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        out[mode] = {"cpu_fraction_max_rank": total.item(),
                     "per_thread_rank0": {k: v / wall for k, v in used.items()}}
    return out


def rss(hvd, cfg) -> dict:
    """Resident memory over many hvdlike training steps (the small-tensor model)."""
    rank = dist.get_rank()
    x, y = batch(rank, 64, 64)
    model = make_model(200, 64)
    opt, kind = _hvd_optimizer(hvd, model, 1e-4)
    step = train_step(model, opt, x, y)
    steps = cfg["rss_steps"]
    mark = max(10, steps // 10)
    trace = []
    for i in range(steps):
        step()
        if i + 1 == mark or (i + 1) % max(1, steps // 20) == 0:
            trace.append((i + 1, rss_bytes()))
    start = next(b for s, b in trace if s >= mark)
    growth = torch.tensor([(trace[-1][1] - start) / start], dtype=torch.float64)
    dist.all_reduce(growth, op=dist.ReduceOp.MAX)
    return {"steps": steps, "measured_from_step": mark, "hvdlike_optimizer": kind,
            "growth_fraction_max_rank": growth.item(), "trace_rank0": trace}


def main(cfg: dict) -> None:
    torch.set_num_threads(1)
    for rank_var, size_var in (("PMI_RANK", "PMI_SIZE"),
                               ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank_var in os.environ and "RANK" not in os.environ:  # started by mpirun
            os.environ.update(RANK=os.environ[rank_var], WORLD_SIZE=os.environ[size_var])
    dist.init_process_group("gloo")
    import hvdlike.torch as hvd

    hvd.init()
    from hvdlike.core import api as core_api

    controller, cpu_operations = getattr(core_api.runtime(), "engines", ("gloo", "gloo"))
    state = core_api.runtime().process_sets[0]
    if type(state.controller.control).__name__.startswith("Shm"):
        controller = "shm"  # negotiation on shared memory (core/shm_control.py)
    if type(state.groups.cpu_plane).__name__.startswith("Shm"):
        cpu_operations = "shm"  # CPU tensors on shared memory (core/shm_plane.py)
    try:  # when DistributedOptimizer starts CPU reductions (see HVDLIKE_CPU_OVERLAP)
        from hvdlike.torch.optimizer import _overlaps_cpu
        cpu_overlap = "during backward" if _overlaps_cpu() else "at step()"
    except ImportError:  # a build without the rule: always during backward
        cpu_overlap = "during backward"
    started = time.time()
    load0 = loadavg()
    results: Dict[str, object] = {}
    workloads = cfg["workloads"]
    if "train_large" in workloads:
        results["train_large"] = training(hvd, cfg, 8, 1024, 64)
    if "train_small" in workloads:
        results["train_small"] = training(hvd, cfg, 200, 64, 64)
    if "allreduce" in workloads:
        results["allreduce"] = allreduce_sizes(hvd, cfg)
    if "many_small" in workloads:
        results["many_small"] = many_small(hvd, cfg)
    if "overhead" in workloads:
        results["overhead"] = overhead(hvd, cfg)
    if "floor" in workloads:
        from bench_floor import floor
        results["floor"] = floor(hvd, cfg)
    if cfg.get("rss_steps"):
        results["rss"] = rss(hvd, cfg)
    meta = {"np": dist.get_world_size(), "torch": torch.__version__,
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "started_utc": time.strftime(
                "%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "seconds": time.time() - started, "loadavg_start": load0, "loadavg_end": loadavg(),
            "settings": cfg, "hvdlike_controller": controller,
            "hvdlike_cpu_operations": cpu_operations, "hvdlike_cpu_overlap": cpu_overlap,
            "allocator": cfg.get("allocator", "default")}
    hvd.shutdown()
    dist.barrier()
    if dist.get_rank() == 0:
        with open(cfg["json"], "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
