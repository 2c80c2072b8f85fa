"""Rank side of the two-host benchmark (started by ``examples/bench_two_hosts.py``).

Each of the 4 ranks (2 network-namespace hosts x 2) holds a default Gloo group
over the hosts' ``eth0`` (raw Gloo and DDP contenders) and a hvdlike runtime.
hvdlike's global set is hierarchical; its ``flat`` contender switches the
set's data plane to the flat Gloo ring between blocks (same runtime, same
negotiation, only the transfer differs), at the same point on every rank.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench_common import (alternate, batch, faults_counted, faults_per_step,  # noqa: E402
                          loadavg, make_model, summary, timed, train_step)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", cfg.get("iface", "eth0"))
    import hvdlike.torch as hvd
    from hvdlike.core import api

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    dist.init_process_group("gloo", init_method=cfg["init_method"], rank=rank, world_size=size)
    plane = api.runtime().process_sets[0].groups.cpu_plane
    hier = type(plane).__name__ == "HierarchicalGroup"

    def as_flat(flag: bool):
        def switch():
            if hier:
                plane.hierarchical_allreduce = not flag
        return switch

    results = {"allreduce": {}, "plane": type(plane).__name__}
    for nbytes in cfg["sizes"]:
        a, b, c = (torch.ones(nbytes // 4) for _ in range(3))
        name = f"two.{nbytes}"

        def hv(t=a):
            hvd.allreduce_(t, op=hvd.Sum, name=name)

        contenders = {"hvdlike_hierarchical": (as_flat(False), timed(hv)),
                      "hvdlike_flat": (as_flat(True), timed(lambda: hv(c))),
                      "gloo": (None, timed(lambda: dist.all_reduce(b)))}
        samples = _alternate_switching(contenders, cfg)
        row = {}
        for n, v in samples.items():
            s = summary(v)
            s["busbw_GBps"] = 2 * (size - 1) / size * nbytes / s["median"] / 1e9
            row[n] = s
        results["allreduce"][str(nbytes)] = row
    as_flat(False)()
    for key, (layers, width) in (("train_large", (8, 1024)), ("train_small", (200, 64))):
        if key not in cfg["training"]:
            continue
        from torch.nn.parallel import DistributedDataParallel as DDP

        x, y = batch(rank, 64, width)
        base = make_model(layers, width)
        m_hvd, m_ddp = copy.deepcopy(base), copy.deepcopy(base)
        opt_hvd = hvd.DistributedOptimizer(torch.optim.SGD(m_hvd.parameters(), lr=1e-4),
                                           named_parameters=m_hvd.named_parameters())
        ddp = DDP(m_ddp)
        opt_ddp = torch.optim.SGD(ddp.parameters(), lr=1e-4)
        faults = {"hvdlike": [], "ddp": []}
        samples = alternate(
            {"hvdlike": timed(faults_counted(train_step(m_hvd, opt_hvd, x, y), faults["hvdlike"])),
             "ddp": timed(faults_counted(train_step(ddp, opt_ddp, x, y), faults["ddp"]))},
            cfg["reps"], cfg["steps"], cfg["warmup"])
        per_step = faults_per_step(faults)
        diff = max((p - q).abs().max().item()
                   for p, q in zip(m_hvd.parameters(), m_ddp.parameters()))
        results[key] = {n: dict(summary(v), minor_faults_per_step=per_step[n])
                        for n, v in samples.items()}
        results[key]["max_param_diff_vs_ddp"] = diff
    if rank == 0:
        results["meta"] = {"np": size, "loadavg_end": loadavg(), "finished": time.time()}
        with open(cfg["json"], "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    hvd.shutdown()


def _alternate_switching(contenders, cfg):
    """:func:`bench_common.alternate`, each hvdlike contender setting its plane first.

    The switch runs before every step: every rank runs the same steps in the
    same order, and a synchronous allreduce is launched only after its own
    rank's switch, so all ranks launch it on the same plane.
    """
    steps = {}
    for name, (switch, step) in contenders.items():
        steps[name] = step if switch is None else _switched(switch, step)
    return alternate(steps, cfg["reps"], cfg["steps"], cfg["warmup"])


def _switched(switch, step):
    def run():
        switch()
        return step()
    return run


if __name__ == "__main__":
    main()
