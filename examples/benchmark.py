"""Side-by-side benchmark: hvdlike vs torch DDP vs raw Gloo, in one invocation.

Usage::

    python examples/benchmark.py --np 2                 # full run (several minutes)
    python examples/benchmark.py --np 2 --quick         # seconds; smoke-test sized
    python examples/benchmark.py --np 2 --rss-steps 2000 --workloads none

Starts ``--np`` ranks with torchrun (``python -m torch.distributed.run``);
every rank creates the default Gloo group (DDP and raw Gloo contenders) and a
hvdlike runtime, sets one torch thread, and runs each workload with its
contenders alternated in rotating blocks on identical models and batches:

* ``train_large``: training step, 8 x Linear(1024,1024), batch 64 --
  hvdlike ``DistributedOptimizer`` vs DDP vs single-process compute;
* ``train_small``: the same with 200 x Linear(64,64);
* ``allreduce``: one allreduce per size, 4 KiB .. 64 MiB, hvdlike vs Gloo;
* ``many_small``: 500 x 4 KiB async then synchronized, hvdlike vs per-tensor
  Gloo vs one hand-flattened Gloo allreduce;
* ``overhead``: negotiation time per cycle with 400 cached tensors vs one
  1-element Gloo allreduce, and the runtime threads' CPU while idle.
* ``floor`` (only when named): ``train_large``'s step alone vs the least a
  synchronous gradient average adds to it (see ``bench_floor.py``).

``--rss-steps N`` adds a resident-memory check over N hvdlike training steps.
The ranks run with glibc's trim and mmap thresholds fixed
(``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``; values the caller set
win): freed gradient and activation buffers are then reused rather than
unmapped and faulted in again the next step. Left to glibc's adaptive
thresholds (``--allocator default``), whether a contender pays that -- ~8,000
page faults and 8-14 ms per 8 x Linear(1024) step on the test machine -- comes
and goes with the order of its frees, differently for each contender and
run. The training rows report page faults per step either way.
Prints a table of medians and ratios and writes everything to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_allocator  # noqa: E402
from bench_report import table  # noqa: E402

ALL = ("train_large", "train_small", "allreduce", "many_small", "overhead")
OPTIONAL = ("floor",)  # run only when named: see examples/bench_floor.py
KIB, MIB = 1024, 1024 * 1024


def settings(args) -> dict:
    workloads = [] if args.workloads == "none" else args.workloads.split(",")
    bad = [w for w in workloads if w not in ALL + OPTIONAL]
    if bad:
        raise SystemExit(f"--workloads: unknown {bad}; choose from "
                         f"{', '.join(ALL + OPTIONAL)} or none")
    if args.quick:
        cfg = {"reps": 2, "steps": 3, "warmup": 1, "sizes": [4 * KIB, 1 * MIB],
               "many_count": 100, "cached_count": 400, "idle_seconds": 0.3}
    else:
        cfg = {"reps": 4, "steps": 5, "warmup": 2,
               "sizes": [4 * KIB * 4 ** i for i in range(8)],  # 4 KiB .. 64 MiB
               "many_count": 500, "cached_count": 400, "idle_seconds": 2.0}
    for key in ("reps", "steps"):
        value = getattr(args, key)
        if value is not None:
            if value < 1:
                raise SystemExit(f"--{key}: must be at least 1, got {value}")
            cfg[key] = value
    if args.warmup is not None:
        if args.warmup < 0:
            raise SystemExit(f"--warmup: must be 0 or more, got {args.warmup}")
        cfg["warmup"] = args.warmup
    if args.np < 1:
        raise SystemExit(f"--np: must be at least 1, got {args.np}")
    if args.rss_steps < 0:
        raise SystemExit(f"--rss-steps: must be 0 (off) or more, got {args.rss_steps}")
    cfg.update(workloads=workloads, rss_steps=args.rss_steps, json=os.path.abspath(args.json),
               quick=args.quick)
    return cfg


def rank_environment(args, base=None) -> tuple:
    """(environment of the ranks, what their allocator settings are) for ``args``."""
    return bench_allocator.environment(args.allocator, base, OMP_NUM_THREADS="1")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--np", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and step counts")
    parser.add_argument("--reps", type=int, help="alternation rounds per workload")
    parser.add_argument("--steps", type=int, help="timed steps per contender per round")
    parser.add_argument("--warmup", type=int,
                        help="untimed steps before each block, three times that before a "
                             "workload's first round (default 2, 1 with --quick)")
    parser.add_argument("--workloads", default=",".join(ALL),
                        help=f"comma list from {','.join(ALL + OPTIONAL)}, or none "
                             f"(default: all but {','.join(OPTIONAL)})")
    parser.add_argument("--rss-steps", type=int, default=0,
                        help="also train this many hvdlike steps and report RSS growth")
    parser.add_argument("--json", default="benchmark.json", help="where to write the results")
    bench_allocator.add_argument(parser)
    parser.add_argument("--timeout", type=float, default=3600, help="kill the run after this")
    parser.add_argument("--launcher", choices=("torchrun", "mpirun"), default="torchrun",
                        help="start the ranks with torchrun (hvdlike on Gloo) or mpirun "
                             "(hvdlike negotiates and moves CPU tensors on MPI; DDP and the "
                             "raw Gloo contenders stay on Gloo)")
    args = parser.parse_args(argv)
    cfg = settings(args)
    env, cfg["allocator"] = rank_environment(args)
    script = [os.path.join(HERE, "bench_workloads.py"), json.dumps(cfg)]
    if args.launcher == "mpirun":
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            print("benchmark: --launcher mpirun needs mpirun on PATH (pip install mpi4py mpich)",
                  file=sys.stderr)
            return 2
        # The default group of the DDP/Gloo contenders rendezvous through env://.
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        cmd = [mpirun, "-np", str(args.np), sys.executable] + script
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.np}"] + script
    if os.path.exists(cfg["json"]):
        os.remove(cfg["json"])
    started = time.time()
    try:
        proc = subprocess.run(cmd, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"benchmark: ranks did not finish within {args.timeout:g} s", file=sys.stderr)
        return 1
    if proc.returncode != 0 or not os.path.exists(cfg["json"]):
        print(f"benchmark: ranks failed (exit {proc.returncode})", file=sys.stderr)
        return 1
    with open(cfg["json"]) as f:
        data = json.load(f)
    data["meta"]["command"] = " ".join(
        ["python", "examples/benchmark.py"] + (sys.argv[1:] if argv is None else list(argv)))
    data["meta"]["wall_seconds"] = time.time() - started
    from bench_report import ratios, targets

    data["ratios"] = ratios(data["results"])
    data["targets"] = [{"target": t, "measured": v, "met": ok}
                       for t, v, ok in targets(data["results"])]
    with open(cfg["json"], "w") as f:
        json.dump(data, f, indent=1)
    print(table(data))
    print(f"\nwritten {cfg['json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
