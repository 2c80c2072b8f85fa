"""Synchronous collectives whose cycle starts on the calling thread (``Runtime.run``).

A synchronous allreduce repeated in a loop is, once its name is cached and the
order learned, the one thing pending on its rank: ``Runtime.run`` then starts
the cycle that runs it right there instead of queueing it. These tests check
that this path is taken, that its results equal a local oracle whatever the
peers do at the same time (asynchronous submissions, late ranks, new names,
a peer shutting down), and that it fails as the queued path does. A peer
killed in such a loop: ``test_reliability.py``.
"""

import time

import pytest
import torch

from tests.multiproc.harness import run_ranks

ROUNDS = 30


def _sync_loop():
    import hvdlike.torch as hvd
    from hvdlike.core import api

    hvd.init()
    r = hvd.rank()
    rt = api.runtime()
    got = []
    inplace = torch.zeros(6)
    strided = torch.zeros(6, 2)[:, 0]  # not contiguous: reduced apart, then copied back
    for k in range(ROUNDS):
        plain = hvd.allreduce(torch.full((4,), float(r + k)), op=hvd.Sum, name="plain")
        inplace.fill_(float(r * k))
        same = hvd.allreduce_(inplace, op=hvd.Average, name="inplace")
        strided.fill_(float(k + r))
        hvd.allreduce_(strided, op=hvd.Max, name="strided")
        got.append((plain.tolist(), inplace.tolist(), same is inplace, strided.tolist()))
    ran = rt.ran_here
    hvd.shutdown()
    return got, ran


@pytest.mark.parametrize("np", [2, 3])
def test_a_loop_of_synchronous_allreduces_runs_here_and_is_right(np):
    results = run_ranks(_sync_loop, np=np, timeout=120)
    for got, ran in results:
        for k, (plain, inplace, same, strided) in enumerate(got):
            assert plain == [float(np * k + np * (np - 1) // 2)] * 4, (k, plain)
            assert inplace == [k * (np - 1) / 2] * 6, (k, inplace)
            assert same, "allreduce_ returns the tensor it was given"
            assert strided == [float(k + np - 1)] * 6, (k, strided)
        # Each name's first rounds are negotiated and learned; after that most
        # calls run here (some meet the background thread's idle cycle first).
        assert ran >= ROUNDS * 3 // 2, ran


def _other_collectives_loop():
    import hvdlike.torch as hvd
    from hvdlike.core import api

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    got = []
    for k in range(ROUNDS):
        b = torch.full((3,), float(10 * r + k))
        hvd.broadcast_(b, root_rank=n - 1, name="b")
        g = hvd.allgather(torch.full((r + 1, 2), float(r + k)), name="g")
        a = hvd.alltoall(torch.arange(2 * n, dtype=torch.float32) + 100 * r + k, name="a")
        got.append((b.tolist(), g.tolist(), a.tolist()))
    ran = api.runtime().ran_here
    hvd.shutdown()
    return got, ran


def test_broadcast_allgather_and_alltoall_in_a_loop_run_here_and_are_right():
    n = 2
    results = run_ranks(_other_collectives_loop, np=n, timeout=120)
    for r, (got, ran) in enumerate(results):
        for k, (b, g, a) in enumerate(got):
            assert b == [float(10 * (n - 1) + k)] * 3, (k, b)
            assert g == [[float(q + k)] * 2 for q in range(n) for _ in range(q + 1)], (k, g)
            # Rank q sends rows 2r, 2r + 1 of its arange(2n) + 100q + k to rank r.
            assert a == [float(2 * r + i + 100 * q + k) for q in range(n) for i in range(2)], \
                (k, a)
        assert ran >= ROUNDS * 3 // 2, ran


def _mixed():
    import hvdlike.torch as hvd

    hvd.init()
    r = hvd.rank()
    out = []
    for k in range(24):
        if r == 0:
            out.append(hvd.allreduce(torch.full((3,), float(k)), op=hvd.Sum, name="m").tolist())
        else:
            # Submitted asynchronously, sometimes late: rank 0's cycle meets a
            # vote of 0 (not ready) or of -1 (new names to negotiate).
            handle = hvd.allreduce_async(torch.full((3,), float(10 * k)), op=hvd.Sum, name="m")
            if k % 3 == 0:
                time.sleep(0.01)
            out.append(hvd.synchronize(handle).tolist())
        if k % 5 == 4:
            out.append(hvd.allreduce(torch.full((2,), float(r)), op=hvd.Sum,
                                     name=f"new.{k}").tolist())
    hvd.shutdown()
    return out


def test_results_stay_right_when_the_peer_submits_asynchronously_and_late():
    results = run_ranks(_mixed, np=2, timeout=120)
    want = []
    for k in range(24):
        want.append([float(11 * k)] * 3)
        if k % 5 == 4:
            want.append([1.0, 1.0])
    assert results[0] == want
    assert results[1] == want


def _peer_shuts_down():
    import hvdlike.torch as hvd
    from hvdlike.core.errors import HorovodInternalError

    hvd.init()
    r = hvd.rank()
    for k in range(20):
        hvd.allreduce(torch.ones(8), name="loop")
    if r == 1:
        hvd.shutdown()
        return "shut down"
    try:
        for k in range(100000):
            hvd.allreduce(torch.ones(8), name="loop")
        return "no error"
    except HorovodInternalError as exc:
        return str(exc)
    finally:
        hvd.shutdown()


def test_a_peer_shutting_down_fails_the_waiting_call_instead_of_hanging():
    results = run_ranks(_peer_shuts_down, np=2, timeout=60)
    assert results[1] == "shut down"
    assert "shut down" in results[0], results[0]


def _same_name_in_flight():
    import hvdlike.torch as hvd
    from hvdlike.core.errors import DuplicateNameError

    hvd.init()
    for k in range(10):
        hvd.allreduce(torch.ones(2), name="x")
    clash = "not tried"
    if hvd.rank() == 1:
        time.sleep(0.5)  # rank 0's "x" stays in flight meanwhile
    handle = hvd.allreduce_async(torch.ones(2), name="x")
    if hvd.rank() == 0:
        try:
            hvd.allreduce(torch.ones(2), name="x")
            clash = "no error"
        except DuplicateNameError as exc:
            clash = str(exc)
    value = hvd.synchronize(handle).tolist()
    again = hvd.allreduce(torch.ones(2), name="x").tolist()
    hvd.shutdown()
    return clash, value, again


def test_a_name_still_in_flight_is_refused_as_for_any_submission():
    results = run_ranks(_same_name_in_flight, np=2, timeout=60)
    clash = results[0][0]
    assert "hvdlike.torch.allreduce" in clash and "'allreduce.x'" in clash, clash
    for _, value, again in results:
        assert value == [1.0, 1.0] and again == [1.0, 1.0]  # Average


def _numpy_loop():
    import numpy as np

    import hvdlike.numpy as hnp
    from hvdlike.core import api

    hnp.init()
    r = hnp.rank()
    got = []
    buf = np.zeros(5, dtype=np.float64)
    for k in range(ROUNDS):
        got.append(hnp.allreduce(np.full(3, r + k, dtype=np.int32), op=hnp.Sum,
                                 name="n").tolist())
        buf[:] = r * k
        hnp.allreduce_(buf, op=hnp.Average, name="n_")
        got.append(buf.tolist())
    ran = api.runtime().ran_here
    hnp.shutdown()
    return got, ran


def test_the_array_front_ends_synchronous_allreduce_runs_here_too():
    results = run_ranks(_numpy_loop, np=2, timeout=120)
    for got, ran in results:
        for k in range(ROUNDS):
            assert got[2 * k] == [2 * k + 1] * 3, (k, got[2 * k])
            assert got[2 * k + 1] == [k / 2] * 5, (k, got[2 * k + 1])
        assert ran >= ROUNDS, ran
