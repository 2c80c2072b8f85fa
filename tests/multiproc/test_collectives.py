"""Every collective, op and dtype on 2 and 4 real ranks, against local oracles."""

import pytest
import torch

from tests.multiproc.harness import run_ranks

FLOAT_DTYPES = ["float16", "bfloat16", "float32", "float64"]
INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8"]


def _value(rank, dtype, n=5):
    """Distinct small per-rank values that no dtype overflows on."""
    base = torch.arange(n, dtype=torch.float64) % 2 + rank % 2 + 1 + (rank == 2)
    return base.to(getattr(torch, dtype))


def _allreduce_matrix(dtypes):
    import hvdlike.torch as hvd

    hvd.init()
    results = {}
    for dtype in dtypes:
        for op_name in ["Sum", "Average", "Min", "Max", "Product"]:
            op = getattr(hvd, op_name)
            t = _value(hvd.rank(), dtype)
            results[(dtype, op_name)] = hvd.allreduce(t, op=op, name=f"ar.{dtype}.{op_name}")
    hvd.shutdown()
    return results


def _oracle(values, op_name):
    stack = torch.stack([v.to(torch.float64) for v in values])
    if op_name == "Sum":
        return stack.sum(0)
    if op_name == "Average":
        return stack.sum(0) / len(values)
    if op_name == "Min":
        return stack.min(0).values
    if op_name == "Max":
        return stack.max(0).values
    return stack.prod(0)


@pytest.mark.parametrize("np", [2, 4])
def test_allreduce_every_op_and_dtype(np):
    dtypes = FLOAT_DTYPES + INT_DTYPES
    results = run_ranks(_allreduce_matrix, np=np, args=(dtypes,))
    for (dtype, op_name), got in results[0].items():
        want = _oracle([_value(r, dtype) for r in range(np)], op_name)
        if dtype in INT_DTYPES and op_name == "Average":
            want = torch.trunc(want)
        tol = 5e-2 if dtype in ("float16", "bfloat16") else 1e-6
        assert got.dtype == getattr(torch, dtype), (dtype, op_name)
        assert torch.allclose(got.to(torch.float64), want, rtol=tol, atol=tol), (dtype, op_name, got, want)
        for other in results[1:]:
            assert torch.equal(other[(dtype, op_name)], got), (dtype, op_name)


def _bool_and_scaling():
    import hvdlike.torch as hvd

    hvd.init()
    r = hvd.rank()
    flags = torch.tensor([r == 0, True, False])
    out = {
        "any": hvd.allreduce(flags, op=hvd.Sum, name="b.any").tolist(),
        "all": hvd.allreduce(flags, op=hvd.Min, name="b.all").tolist(),
        "scaled": hvd.allreduce(torch.ones(4) * (r + 1), op=hvd.Sum, prescale_factor=2.0,
                                postscale_factor=0.5, name="scaled").tolist(),
        "avg_default": hvd.allreduce(torch.ones(2) * r).tolist(),
        "deprecated_average": hvd.allreduce(torch.ones(2) * r, average=False).tolist(),
    }
    hvd.shutdown()
    return out


def test_bool_and_scaling():
    res = run_ranks(_bool_and_scaling, np=2)
    for out in res:
        assert out["any"] == [True, True, False]
        assert out["all"] == [False, True, False]
        assert out["scaled"] == [3.0] * 4
        assert out["avg_default"] == [0.5, 0.5]
        assert out["deprecated_average"] == [1.0, 1.0]


def _shapes_and_layouts():
    import hvdlike.torch as hvd

    hvd.init()
    r = hvd.rank()
    out = {}
    out["empty"] = hvd.allreduce(torch.empty(0, 3), op=hvd.Sum, name="empty")
    base = torch.arange(12.0).reshape(3, 4) * (r + 1)
    nc = base.t()  # non-contiguous
    out["noncontig"] = hvd.allreduce(nc, op=hvd.Sum, name="nc")
    inplace = base.t()
    hvd.allreduce_(inplace, op=hvd.Sum, name="nc_inplace")
    out["noncontig_inplace"] = inplace
    out["scalar"] = hvd.allreduce(torch.tensor(float(r)), op=hvd.Sum, name="scalar")
    big = torch.ones(300) * (r + 1)
    out["big"] = hvd.allreduce(big, op=hvd.Sum, name="big")  # larger than the 256-byte threshold
    hvd.shutdown()
    return out


def test_empty_noncontiguous_and_oversized():
    res = run_ranks(_shapes_and_layouts, np=2, env={"HVDLIKE_FUSION_THRESHOLD": "256"})
    base = torch.arange(12.0).reshape(3, 4)
    for out in res:
        assert out["empty"].shape == (0, 3)
        assert torch.equal(out["noncontig"], (base * 3).t())
        assert torch.equal(out["noncontig_inplace"], (base * 3).t())
        assert out["scalar"].item() == 1.0 and out["scalar"].dim() == 0
        assert torch.equal(out["big"], torch.full((300,), 3.0))


def _repeated_fused_batches():
    """Batches of many tensors, repeated (the kept views of the fusion buffer) and changed."""
    import hvdlike.torch as hvd
    from hvdlike.core import api

    hvd.init()
    r = hvd.rank()
    got = []
    # Steps 0-2 repeat one batch; step 3 changes sizes under the same names;
    # step 4 mixes shapes, a 2-D tensor and a float64 tensor; step 5 repeats step 3.
    layouts = [[(i % 7) + 1 for i in range(40)]] * 3 + [[(i % 5) + 3 for i in range(40)],
               [(i % 3) + 1 for i in range(24)] + [(2, 3)] * 8, [(i % 5) + 3 for i in range(40)]]
    for step, layout in enumerate(layouts):
        tensors = [torch.full(n if isinstance(n, tuple) else (n,), float(step + r * 10 + i))
                   for i, n in enumerate(layout)]
        if step == 4:
            tensors.append(torch.full((5,), float(r + 1), dtype=torch.float64))
        handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"fused.{i}")
                   for i, t in enumerate(tensors)]
        for h in handles:
            hvd.synchronize(h)
        got.append(tensors)
    kept = len(api.runtime().process_sets[0].executor._views)
    hvd.shutdown()
    return got, kept


def test_repeated_and_changing_fused_batches_keep_correct_results():
    res = run_ranks(_repeated_fused_batches, np=2)
    for got, kept in res:
        assert kept >= 1  # the repeated batches did go through kept views
        for step, tensors in enumerate(got):
            for i, t in enumerate(tensors):
                if step == 4 and i == len(tensors) - 1:
                    assert t.dtype == torch.float64 and torch.equal(t, torch.full((5,), 3.0,
                                                                                   dtype=torch.float64))
                    continue
                want = 2 * (step + i) + 10  # ranks 0 and 1: step+i and step+10+i
                assert torch.equal(t, torch.full_like(t, float(want))), (step, i, t)
    assert [t.shape for t in res[0][0][4][24:32]] == [(2, 3)] * 8


def _data_movement():
    import hvdlike.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {}
    for dtype in FLOAT_DTYPES + INT_DTYPES + ["bool"]:
        t = torch.full((r + 1, 2), r % 2 if dtype == "bool" else r, dtype=getattr(torch, dtype))
        out[("allgather", dtype)] = hvd.allgather(t, name=f"ag.{dtype}")
        b = torch.full((3,), r + 1).to(getattr(torch, dtype))
        out[("broadcast", dtype)] = hvd.broadcast(b, root_rank=n - 1, name=f"bc.{dtype}")
    inplace = torch.full((2,), float(r))
    hvd.broadcast_(inplace, root_rank=0)
    out["broadcast_"] = inplace
    # alltoall: rank r sends (i + 1) rows of value 10*r + i to rank i.
    splits = [i + 1 for i in range(n)]
    rows = torch.cat([torch.full((i + 1, 2), float(10 * r + i)) for i in range(n)])
    out["alltoall"] = hvd.alltoall(rows, splits=splits, name="a2a")
    out["alltoall_even"] = hvd.alltoall(torch.arange(float(n)) + 100 * r, name="a2a.even")
    out["reducescatter"] = hvd.reducescatter(torch.arange(7.0) * (r + 1), op=hvd.Sum)
    out["reducescatter_avg"] = hvd.reducescatter(torch.ones(n * 2, 3) * (r + 1))
    out["grouped_allgather"] = hvd.grouped_allgather([torch.ones(1) * r, torch.ones(2, 2) * r])
    out["grouped_reducescatter"] = hvd.grouped_reducescatter([torch.ones(n) * r], op=hvd.Sum)
    out["object"] = hvd.broadcast_object({"from": r, "data": list(range(r + 1))}, root_rank=1)
    out["objects"] = hvd.allgather_object(("rank", r, "x" * r))
    hvd.barrier()
    hvd.shutdown()
    return out


@pytest.mark.parametrize("np", [2, 4])
def test_allgather_broadcast_alltoall_reducescatter(np):
    res = run_ranks(_data_movement, np=np)
    for me, out in enumerate(res):
        for dtype in FLOAT_DTYPES + INT_DTYPES + ["bool"]:
            dt = getattr(torch, dtype)
            want = torch.cat([torch.full((r + 1, 2), r % 2 if dtype == "bool" else r, dtype=dt)
                              for r in range(np)])
            assert torch.equal(out[("allgather", dtype)], want), dtype
            assert torch.equal(out[("broadcast", dtype)], torch.full((3,), np).to(dt)), dtype
        assert torch.equal(out["broadcast_"], torch.zeros(2))
        got, received = out["alltoall"]
        want = torch.cat([torch.full((me + 1, 2), float(10 * r + me)) for r in range(np)])
        assert torch.equal(got, want)
        assert received.tolist() == [me + 1] * np
        assert torch.equal(out["alltoall_even"], torch.tensor([100.0 * r + me for r in range(np)]))
        total = torch.arange(7.0) * sum(r + 1 for r in range(np))
        base, extra = divmod(7, np)
        start = me * base + min(me, extra)
        assert torch.equal(out["reducescatter"], total[start:start + base + (me < extra)])
        avg = sum(r + 1 for r in range(np)) / np
        assert torch.allclose(out["reducescatter_avg"], torch.full((2, 3), avg))
        ga = out["grouped_allgather"]
        assert torch.equal(ga[0], torch.arange(float(np)))
        assert torch.equal(ga[1], torch.cat([torch.full((2, 2), float(r)) for r in range(np)]))
        assert torch.equal(out["grouped_reducescatter"][0], torch.full((1,), float(sum(range(np)))))
        assert out["object"] == {"from": 1, "data": [0, 1]}
        assert out["objects"] == [("rank", r, "x" * r) for r in range(np)]


def _threads_block_on_handles(engine_env):
    """Several user threads wait on their own handles at once while the main
    thread submits async work: one of them runs each cycle, the others wait."""
    import threading
    import time

    import hvdlike.torch as hvd
    from hvdlike.core import current

    hvd.init()
    rank = hvd.rank()
    runtime = current.get()
    errors, sums, cyclers = [], {}, set()
    cycle_all = runtime._cycle_all

    def recorded_cycle():
        cyclers.add(threading.current_thread().name)
        return cycle_all()

    runtime._cycle_all = recorded_cycle

    def worker(k):
        try:
            for i in range(40):
                t = torch.full((3 + k,), float(rank + 1 + i))
                sums[(k, i)] = hvd.allreduce(t, op=hvd.Sum, name=f"thread{k}.{i}")
                if i % 7 == k:
                    time.sleep(0.002)
        except BaseException as exc:  # reported to the test below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(k,), name=f"user{k}") for k in range(3)]
    for thread in threads:
        thread.start()
    handles = [hvd.allreduce_async(torch.full((2,), float(rank)), op=hvd.Sum, name=f"main.{i}")
               for i in range(20)]
    main = [hvd.synchronize(h) for h in handles]
    for thread in threads:
        thread.join(60)
    stuck = [t.name for t in threads if t.is_alive()]
    # Alone, a thread blocked on its handle runs the cycle itself (the threads
    # above may or may not have found the background thread cycling).
    cyclers.clear()
    alone = [hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"alone.{i}") for i in range(20)]
    alone_cyclers = sorted(cyclers)
    hvd.shutdown()
    return errors, stuck, sums, main, alone, alone_cyclers


@pytest.mark.parametrize("engine_env", [{}, {"HVDLIKE_SHM": "0"}], ids=["shm", "gloo"])
def test_user_threads_blocked_on_handles_share_the_cycles(engine_env):
    results = run_ranks(_threads_block_on_handles, np=2, args=(engine_env,), env=engine_env,
                        timeout=120)
    for errors, stuck, sums, main, alone, cyclers in results:
        assert not errors and not stuck, (errors, stuck)
        for (k, i), got in sums.items():
            assert torch.equal(got, torch.full((3 + k,), float(1 + i + 2 + i))), (k, i, got)
        assert all(torch.equal(t, torch.full((2,), 1.0)) for t in main)
        assert all(torch.equal(t, torch.full((2,), 2.0)) for t in alone)
        assert "MainThread" in cyclers, cyclers


def _interrupted_while_cycling():
    import signal
    import time

    import hvdlike.torch as hvd

    hvd.init()
    rank = hvd.rank()
    if rank == 1:
        time.sleep(3)  # rank 0 is interrupted while it waits for this rank
        try:
            hvd.allreduce(torch.ones(4), name="late")
            return "no error"
        except hvd.HorovodInternalError as exc:
            return str(exc)
        finally:
            hvd.shutdown()

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    try:
        hvd.allreduce(torch.ones(4), name="late")
        caught = "no interrupt"
    except KeyboardInterrupt:
        caught = "KeyboardInterrupt"
    except BaseException as exc:
        caught = f"{type(exc).__name__}: {exc}"
    try:
        hvd.allreduce(torch.ones(4), name="after")
        after = "no error"
    except hvd.HorovodInternalError as exc:
        after = str(exc)
    hvd.shutdown()
    return caught, after


def test_ctrl_c_during_a_synchronous_collective_reaches_the_user_and_nothing_hangs():
    (caught, after), peer = run_ranks(_interrupted_while_cycling, np=2, timeout=90)
    assert caught == "KeyboardInterrupt"
    if "KeyboardInterrupt in the middle of a negotiation cycle" in after:
        # Interrupted inside a cycle it ran itself: the ranks' control collectives are
        # out of step, so this rank refuses to go on and the peer's collective fails
        # (instead of hanging), naming rank 0.
        assert peer != "no error" and "rank 0" in peer, peer
    else:
        # Interrupted while waiting on the handle (the background thread was cycling):
        # the collective completes in the background, as in Horovod, and the runtime
        # goes on until the peer shuts down.
        assert peer == "no error", peer
        assert "rank 1" in after and "shut down" in after, after
