"""Two-host benchmark: flat Gloo vs hierarchical hvdlike vs DDP on 2 hosts x 2 ranks.

Usage (root, with ``ip`` and ``sshd``; builds two network-namespace hosts with
``tests/netns.py`` and removes them afterwards)::

    python examples/bench_two_hosts.py                  # allreduce 4 KiB .. 16 MiB, training
    python examples/bench_two_hosts.py --quick          # smoke-sized

The 4 ranks are started by the real ``hvdlike-run -H ip1:2,ip2:2`` over ssh.
Contenders, alternated in rotating blocks (see ``bench_common.alternate``):

* ``allreduce``, one fp32 sum per size: raw Gloo (``dist.all_reduce`` on a
  4-rank default group, a flat ring over both hosts), hvdlike hierarchical
  (shared memory inside each host, one Gloo pair across), and hvdlike with
  the same runtime's data plane switched to its flat Gloo ring; time and bus
  bandwidth ``2(p-1)/p * bytes / time``, p = 4;
* ``train_large`` / ``train_small``: hvdlike ``DistributedOptimizer`` vs DDP
  (and each one's page faults per step).

The ranks start with glibc's thresholds fixed, as in ``benchmark.py``
(``--allocator``, see ``bench_allocator``).

The hosts are namespaces of one machine: "between hosts" is a veth pair
through a bridge (kernel TCP, no wire), so this shows the algorithms' costs
in CPU and copies, not a network's bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import bench_allocator  # noqa: E402

KIB, MIB = 1024, 1024 * 1024


def table(data: dict) -> str:
    lines = [f"two-host benchmark  2 hosts x 2 ranks  plane {data['plane']}  load "
             f"{data['meta'].get('loadavg_start')} -> {data['meta'].get('loadavg_end')}", "",
             "allreduce (fp32 sum)  hier ms   flat ms   gloo ms   hier/gloo  hier/flat   "
             "busbw GB/s hier / flat / gloo"]
    for nbytes, row in sorted(data["allreduce"].items(), key=lambda kv: int(kv[0])):
        h, f, g = row["hvdlike_hierarchical"], row["hvdlike_flat"], row["gloo"]
        size = f"{int(nbytes) // MIB} MiB" if int(nbytes) >= MIB else f"{int(nbytes) // KIB} KiB"
        lines.append(f"  {size:>8}        {1e3 * h['median']:8.3f} {1e3 * f['median']:8.3f} "
                     f"{1e3 * g['median']:8.3f}   {h['median'] / g['median']:8.3f}  "
                     f"{h['median'] / f['median']:8.3f}   {h['busbw_GBps']:.3f} / "
                     f"{f['busbw_GBps']:.3f} / {g['busbw_GBps']:.3f}")
    for key in ("train_large", "train_small"):
        t = data.get(key)
        if t:
            lines.append(f"{key}: hvdlike {1e3 * t['hvdlike']['median']:.1f} ms  ddp "
                         f"{1e3 * t['ddp']['median']:.1f} ms  hvdlike/ddp "
                         f"{t['hvdlike']['median'] / t['ddp']['median']:.3f}  (max |param diff| "
                         f"{t['max_param_diff_vs_ddp']:.1e})")
            if "minor_faults_per_step" in t["hvdlike"]:
                lines.append(f"  page faults per step (median, busiest rank)  hvdlike "
                             f"{t['hvdlike']['minor_faults_per_step']:.0f}  ddp "
                             f"{t['ddp']['minor_faults_per_step']:.0f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and step counts")
    parser.add_argument("--json", default="bench_two_hosts.json", help="where to write results")
    parser.add_argument("--training", default="train_large,train_small",
                        help="training workloads to run (comma list, or none)")
    parser.add_argument("--timeout", type=float, default=1800)
    bench_allocator.add_argument(parser)
    args = parser.parse_args(argv)
    from tests import netns

    why = netns.why_unavailable()
    if why:
        print(f"bench_two_hosts: cannot build the namespace hosts here: {why}", file=sys.stderr)
        return 2
    sizes = [4 * KIB, 1 * MIB] if args.quick else [4 * KIB * 4 ** i for i in range(7)]
    out = os.path.abspath(args.json)
    cluster = netns.Cluster(2).setup()
    try:
        cfg = {"sizes": sizes, "json": out, "iface": "eth0",
               "reps": 2 if args.quick else 3, "steps": 3 if args.quick else 5,
               "warmup": 1 if args.quick else 2,
               "training": [] if args.training == "none" else args.training.split(","),
               "init_method": f"tcp://{cluster.ips[0]}:{random.randint(30000, 60000)}"}
        if os.path.exists(out):
            os.remove(out)
        env, allocator = bench_allocator.environment(
            args.allocator, OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, "-m", "hvdlike.launcher.cli", "-np", "4", "-H",
               f"{cluster.ips[0]}:2,{cluster.ips[1]}:2", *cluster.ssh_options(),
               sys.executable, os.path.join(HERE, "bench_two_hosts_rank.py"), json.dumps(cfg)]
        load = list(os.getloadavg())
        started = time.time()
        proc = subprocess.run(cmd, env=env, timeout=args.timeout)
        if proc.returncode != 0 or not os.path.exists(out):
            print(f"bench_two_hosts: ranks failed (exit {proc.returncode})", file=sys.stderr)
            return 1
    finally:
        cluster.teardown()
    with open(out) as f:
        data = json.load(f)
    data["meta"].update(loadavg_start=load, seconds=time.time() - started, allocator=allocator,
                        started_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                        command=" ".join(["python", "examples/bench_two_hosts.py"]
                                         + (sys.argv[1:] if argv is None else list(argv))))
    with open(out, "w") as f:
        json.dump(data, f, indent=1)
    print(table(data))
    print(f"\nwritten {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
