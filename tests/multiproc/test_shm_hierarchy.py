"""Hierarchical allreduce/allgather on real ranks, with two hosts simulated on one machine.

Each rank is told its host (``HVDLIKE_HOSTNAME``) and its local/cross place, so
ranks 0, 1 form "host A" and ranks 2, 3 "host B": each host's members share a
segment, the two leaders (ranks 0 and 2) form the cross-host Gloo group. The
real two-host run is in ``tests/e2e/test_multihost_netns.py``.
"""

import json

import torch

from tests.multiproc.harness import run_ranks
from tests.multiproc.test_shm_plane import (ACROSS_MIN_BYTES, DTYPES, OPS, _check_allreduces,
                                            _value)

SIZES = [0, 7, 5000]  # 5000 x 8 bytes spans ten 4 KiB chunks


def _two_hosts(rank):
    return {"HVDLIKE_HOSTNAME": "host-a" if rank < 2 else "host-b",
            "HVDLIKE_LOCAL_RANK": str(rank % 2), "HVDLIKE_LOCAL_SIZE": "2",
            "HVDLIKE_CROSS_RANK": str(rank // 2), "HVDLIKE_CROSS_SIZE": "2"}


def _planes(hvd, sets):
    from hvdlike.core import api

    out = {}
    for name, ps in sets.items():
        state = api.runtime().process_sets.get(ps.process_set_id)
        if state is None:
            continue
        plane = state.groups.cpu_plane
        out[name] = (type(plane).__name__ if plane is not None else "gloo",
                     getattr(plane, "hierarchical_allreduce", None),
                     getattr(plane, "hierarchical_allgather", None))
    return out


def _collectives(chunk_bytes, timeline, dtypes=DTYPES):
    import hvdlike.torch as hvd
    from hvdlike.core import shm_plane

    shm_plane.CHUNK_BYTES = chunk_bytes
    shm_plane.ACROSS_MIN_BYTES = ACROSS_MIN_BYTES  # 5000 x 8 bytes: reduced across
    trio, pair = hvd.ProcessSet([0, 1, 2]), hvd.ProcessSet([1, 3])
    hvd.init(process_sets=[trio, pair])
    r, n = hvd.rank(), hvd.size()
    out = {"planes": _planes(hvd, {"global": hvd.global_process_set, "trio": trio,
                                   "pair": pair})}
    if timeline:
        hvd.start_timeline(timeline)
    handles = {}
    for dtype in dtypes:
        for size in SIZES:
            for op in OPS:
                handles[("ar", dtype, size, op)] = hvd.allreduce_async(
                    _value(r, dtype, size), op=getattr(hvd, op), name=f"ar.{dtype}.{size}.{op}")
            rows = size % 5 + r  # uneven first dimensions
            handles[("ag", dtype, size)] = hvd.allgather_async(
                _value(r, dtype, rows * 3, 1).reshape(rows, 3), name=f"ag.{dtype}.{size}")
    out.update({key: hvd.synchronize(h) for key, h in handles.items()})
    # Alone (not fused), scaled, and larger than one chunk.
    out["scaled"] = hvd.allreduce(_value(r, "float32", 3001), op=hvd.Average,
                                  prescale_factor=0.5, postscale_factor=3.0, name="scaled")
    out["bc"] = hvd.broadcast(_value(r, "float32", 9, 2), root_rank=3, name="bc")
    out["rs"] = hvd.reducescatter(_value(r, "float32", 2 * n + 1).reshape(-1, 1), op=hvd.Sum,
                                  name="rs")
    if r in (0, 1, 2):
        out["trio_ar"] = hvd.allreduce(_value(r, "float64", 1001), op=hvd.Sum, name="t",
                                       process_set=trio)
        out["trio_ag"] = hvd.allgather(_value(r, "int32", 2 * r + 1, 4).reshape(-1, 1),
                                       name="tg", process_set=trio)
    if r in (1, 3):
        out["pair_ar"] = hvd.allreduce(_value(r, "float32", 77), op=hvd.Max, name="p",
                                       process_set=pair)
    hvd.barrier()
    if timeline:
        hvd.stop_timeline()
    hvd.shutdown()
    if timeline and r == 0:
        with open(timeline) as f:
            out["spans"] = sorted({e["name"] for e in json.load(f) if e.get("ph") == "X"})
    return out


def _check(results, n, dtypes=DTYPES):
    for dtype in dtypes:
        tol = {"float16": 5e-2, "bfloat16": 5e-2, "float32": 1e-6}.get(dtype, 1e-12)
        for size in SIZES:
            _check_allreduces(results, n, dtype, size, tol)
            rows = [size % 5 + r for r in range(n)]
            want = torch.cat([_value(r, dtype, rows[r] * 3, 1).reshape(rows[r], 3)
                              for r in range(n)])
            for res in results:
                assert torch.equal(res[("ag", dtype, size)], want), (dtype, size)
    inputs = torch.stack([_value(r, "float32", 3001) for r in range(n)])
    want = (inputs * 0.5).sum(0) / n * 3.0
    total = torch.stack([_value(r, "float32", 2 * n + 1) for r in range(n)]).sum(0)
    for r, res in enumerate(results):
        assert torch.allclose(res["scaled"], want, atol=1e-5)
        assert torch.equal(res["bc"], _value(3, "float32", 9, 2))
        start = 2 * r + min(r, 1)
        assert torch.equal(res["rs"].reshape(-1), total[start:start + 2 + (r < 1)])
    trio_sum = torch.stack([_value(r, "float64", 1001) for r in range(3)]).sum(0)
    trio_cat = torch.cat([_value(r, "int32", 2 * r + 1, 4).reshape(-1, 1) for r in range(3)])
    for r in (0, 1, 2):
        assert torch.equal(results[r]["trio_ar"], trio_sum)
        assert torch.equal(results[r]["trio_ag"], trio_cat)
    pair_max = torch.maximum(_value(1, "float32", 77), _value(3, "float32", 77))
    for r in (1, 3):
        assert torch.equal(results[r]["pair_ar"], pair_max)


def test_auto_is_hierarchical_where_a_host_has_several_members(tmp_path):
    path = str(tmp_path / "timeline.json")
    results = run_ranks(_collectives, np=4, args=(4096, path), per_rank_env=_two_hosts,
                        timeout=240)
    _check(results, 4)
    hier = ("HierarchicalGroup", True, True)
    assert results[0]["planes"] == {"global": hier, "trio": hier}
    assert results[2]["planes"] == {"global": hier, "trio": hier}
    # One member per host: nothing to share, the flat Gloo ring it is.
    assert results[3]["planes"] == {"global": hier, "pair": ("gloo", None, None)}
    spans = set(results[0]["spans"])
    assert {"HIER_ALLREDUCE", "SHM_REDUCE", "GLOO_CROSS_ALLREDUCE", "SHM_BROADCAST",
            "HIER_ALLGATHER", "SHM_GATHER", "GLOO_CROSS_ALLGATHER"} <= spans, spans


def test_knobs_force_either_way():
    # Horovod's name forces allreduce on (even for one member per host), ours allgather off.
    env = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HVDLIKE_HIERARCHICAL_ALLGATHER": "0"}
    dtypes = ["float32", "int16", "bool"]
    results = run_ranks(_collectives, np=4, args=(4096, "", dtypes), per_rank_env=_two_hosts,
                        env=env, timeout=240)
    _check(results, 4, dtypes)
    assert results[3]["planes"] == {"global": ("HierarchicalGroup", True, False),
                                    "pair": ("HierarchicalGroup", True, False)}
    off = run_ranks(_planes_only, np=4, per_rank_env=_two_hosts, timeout=120,
                    env={"HVDLIKE_HIERARCHICAL_ALLREDUCE": "0",
                         "HOROVOD_HIERARCHICAL_ALLGATHER": "off"})
    assert off[0] == {"global": ("gloo", None, None), "sum": 6.0}


def _planes_only():
    import hvdlike.torch as hvd

    hvd.init()
    out = _planes(hvd, {"global": hvd.global_process_set})
    out["sum"] = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
    hvd.shutdown()
    return out

