"""Tables, ratios and target checks for the side-by-side benchmark's JSON."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

KIB = 1024
MIB = 1024 * 1024


FLOOR = ("barrier", "copy", "copy_barrier", "segment", "hvdlike")


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")


def _size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def ratios(results: dict) -> Dict[str, float]:
    """The headline ratios (hvdlike / peer unless named otherwise)."""
    out: Dict[str, float] = {}
    for key in ("train_large", "train_small"):
        r = results.get(key)
        if r:
            out[f"{key}.hvdlike/ddp"] = _ratio(r["hvdlike"]["median"], r["ddp"]["median"])
            out[f"{key}.hvdlike/compute"] = _ratio(r["hvdlike"]["median"], r["compute"]["median"])
            out[f"{key}.ddp/compute"] = _ratio(r["ddp"]["median"], r["compute"]["median"])
    for nbytes, row in (results.get("allreduce") or {}).items():
        out[f"allreduce.{nbytes}.hvdlike/gloo"] = _ratio(row["hvdlike"]["median"],
                                                         row["gloo"]["median"])
        if "memcpy" in row:
            out[f"allreduce.{nbytes}.hvdlike/memcpy"] = _ratio(row["hvdlike"]["median"],
                                                               row["memcpy"]["median"])
    f = results.get("floor")
    if f and "skipped" not in f:
        for name in FLOOR:
            out[f"floor.{name}/compute"] = _ratio(f[name]["median"], f["compute"]["median"])
    m = results.get("many_small")
    if m:
        out["many_small.gloo_per_tensor/hvdlike"] = _ratio(m["gloo_per_tensor"]["median"],
                                                           m["hvdlike"]["median"])
        out["many_small.hvdlike/gloo_flattened"] = _ratio(m["hvdlike"]["median"],
                                                          m["gloo_flattened"]["median"])
    o = results.get("overhead")
    if o:
        out["overhead.negotiation/gloo_1_element"] = _ratio(o["negotiation_cycle"]["median"],
                                                            o["gloo_1_element"]["median"])
        if "control_collectives" in o:
            out["overhead.control/gloo_1_element"] = _ratio(o["control_collectives"]["median"],
                                                            o["gloo_1_element"]["median"])
    return out


def targets(results: dict) -> List[Tuple[str, str, Optional[bool]]]:
    """(target, measured, met) for every target of the issue the results cover."""
    r = ratios(results)
    rows: List[Tuple[str, str, Optional[bool]]] = []

    def add(label, key, ok):
        if key in r:
            rows.append((label, f"{r[key]:.3f}", ok(r[key])))

    add("train_large hvdlike/DDP <= 0.85", "train_large.hvdlike/ddp", lambda v: v <= 0.85)
    add("train_small hvdlike/DDP <= 0.85", "train_small.hvdlike/ddp", lambda v: v <= 0.85)
    add("train_large hvdlike/compute <= 1.10", "train_large.hvdlike/compute",
        lambda v: v <= 1.10)
    sizes = sorted(int(k) for k in results.get("allreduce") or {})
    if 4 * KIB in sizes:
        add("allreduce 4 KiB hvdlike/gloo <= 0.10", f"allreduce.{4 * KIB}.hvdlike/gloo",
            lambda v: v <= 0.10)
    if sizes:
        big = sizes[-1]
        add(f"allreduce {_size(big)} hvdlike/gloo <= 0.60", f"allreduce.{big}.hvdlike/gloo",
            lambda v: v <= 0.60)
    add("500x4KiB per-tensor gloo/hvdlike >= 20", "many_small.gloo_per_tensor/hvdlike",
        lambda v: v >= 20)
    add("500x4KiB hvdlike/flattened <= 1.0", "many_small.hvdlike/gloo_flattened",
        lambda v: v <= 1.0)
    add("control plane per cycle / 1-elem gloo <= 1.5", "overhead.control/gloo_1_element",
        lambda v: v <= 1.5)
    add("whole negotiation cycle / 1-elem gloo <= 1.5", "overhead.negotiation/gloo_1_element",
        lambda v: v <= 1.5)
    if "rss" in results:
        g = results["rss"]["growth_fraction_max_rank"]
        rows.append((f"RSS growth over {results['rss']['steps']} steps <= 1%",
                     f"{100 * g:+.2f}%", g <= 0.01))
    return rows


def _ms(s: dict) -> str:
    return f"{1e3 * s['median']:9.3f}"


def table(data: dict) -> str:
    """The human-readable report printed at the end of a run."""
    res, meta = data["results"], data["meta"]
    r = ratios(res)
    lines = [f"hvdlike benchmark  np={meta['np']}  torch {meta['torch']}  "
             f"threads/rank={meta['torch_threads']}  cpus={meta['cpus']}  "
             f"started {meta['started_utc']}  ({meta['seconds']:.0f} s, load "
             f"{meta['loadavg_start']} -> {meta['loadavg_end']})",
             f"hvdlike control plane {meta.get('hvdlike_controller', 'gloo')}, CPU data plane "
             f"{meta.get('hvdlike_cpu_operations', 'gloo')}; DDP and raw contenders on Gloo"
             + (f"; DistributedOptimizer reduces CPU gradients {meta['hvdlike_cpu_overlap']}"
                if "hvdlike_cpu_overlap" in meta else "")
             + (f"; allocator {meta['allocator']}" if "allocator" in meta else ""), ""]
    for key, title in (("train_large", "training step"), ("train_small", "training step")):
        t = res.get(key)
        if not t:
            continue
        lines.append(f"{title}: {t['layers']} x Linear({t['width']},{t['width']}), batch "
                     f"{t['batch']}, {t['tensors']} tensors, {t['params'] / 1e6:.2f} M params "
                     f"[{t['hvdlike_optimizer']}, n={t['hvdlike']['n']}]")
        lines.append(f"  median ms   hvdlike {_ms(t['hvdlike'])}   ddp {_ms(t['ddp'])}   "
                     f"compute {_ms(t['compute'])}")
        lines.append(f"  hvdlike/ddp {r[key + '.hvdlike/ddp']:.3f}   hvdlike/compute "
                     f"{r[key + '.hvdlike/compute']:.3f}   ddp/compute "
                     f"{r[key + '.ddp/compute']:.3f}   (max |param diff| "
                     f"{t['max_param_diff_vs_ddp']:.1e})")
        if "minor_faults_per_step" in t["hvdlike"]:
            lines.append("  page faults per step (median, busiest rank)   " + "   ".join(
                f"{n} {t[n]['minor_faults_per_step']:.0f}" for n in ("hvdlike", "ddp", "compute")))
        lines.append("")
    if res.get("allreduce"):
        lines.append("allreduce (fp32 sum)    hvdlike ms   gloo ms   ratio   busbw GB/s hvd/gloo"
                     "   memcpy ms  hvd/memcpy")
        for nbytes, row in sorted(res["allreduce"].items(), key=lambda kv: int(kv[0])):
            copy = (f"   {_ms(row['memcpy'])}  {r[f'allreduce.{nbytes}.hvdlike/memcpy']:9.2f}"
                    if "memcpy" in row else "")
            lines.append(f"  {_size(int(nbytes)):>8}           {_ms(row['hvdlike'])} "
                         f"{_ms(row['gloo'])}   {r[f'allreduce.{nbytes}.hvdlike/gloo']:.3f}   "
                         f"{row['hvdlike']['busbw_GBps']:.3f} / {row['gloo']['busbw_GBps']:.3f}"
                         f"{copy}")
        lines.append("")
    m = res.get("many_small")
    if m:
        lines.append(f"{m['count']} x {m['bytes_each'] // KIB} KiB async then synchronize: "
                     f"hvdlike {_ms(m['hvdlike'])} ms   per-tensor gloo "
                     f"{_ms(m['gloo_per_tensor'])} ms   flattened {_ms(m['gloo_flattened'])} ms")
        lines.append(f"  per-tensor/hvdlike {r['many_small.gloo_per_tensor/hvdlike']:.1f}x   "
                     f"hvdlike/flattened {r['many_small.hvdlike/gloo_flattened']:.3f}")
        lines.append("")
    o = res.get("overhead")
    if o:
        lines.append(f"negotiation cycle, {o['cached_tensors']} cached tensors: "
                     f"{_ms(o['negotiation_cycle'])} ms   1-element gloo allreduce "
                     f"{_ms(o['gloo_1_element'])} ms   ratio "
                     f"{r['overhead.negotiation/gloo_1_element']:.3f}")
        if "bookkeeping" in o:
            lines.append(f"  control collective once all ranks are in {_ms(o['control_collectives'])}"
                         f" ms (ratio {r['overhead.control/gloo_1_element']:.3f}); per-tensor "
                         f"bookkeeping {_ms(o['bookkeeping'])} ms; the rest is waiting for the "
                         f"other rank")
        idle = o["idle_cpu"]
        lines.append(f"  runtime threads CPU while rank sleeps "
                     f"{100 * idle['sleeping']['cpu_fraction_max_rank']:.1f}% of a core, while "
                     f"it computes {100 * idle['computing']['cpu_fraction_max_rank']:.1f}%")
        lines.append("")
    f = res.get("floor")
    if f and "skipped" in f:
        lines += [f"floor: skipped ({f['skipped']})", ""]
    elif f:
        lines.append(f"floor of a synchronous step, {f['layers']} x Linear({f['width']},"
                     f"{f['width']}), batch {f['batch']}: median ms, and / compute")
        lines.append(f"  compute {_ms(f['compute'])}")
        for name in FLOOR:
            lines.append(f"  {name:13} {_ms(f[name])}   {r[f'floor.{name}/compute']:.3f}")
        lines.append(f"  (max |param diff| segment vs hvdlike "
                     f"{f['max_param_diff_segment_vs_hvdlike']:.1e})")
        lines.append("")
    lines.append("targets")
    for label, value, ok in targets(res):
        lines.append(f"  [{'met' if ok else 'NOT met':>7}] {label:45} {value}")
    return "\n".join(lines)
