"""A rank's runtime entered from where it must not run: a forked child, a signal
handler, a rank that closes long after the others.

* A child forked after ``init()`` (``os.fork``, a DataLoader worker) holds a copy
  of its parent's runtime: collectives there are refused naming why, ``init()``
  too, and its exit (atexit handlers included) leaves the parent's job alone.
* ``shutdown()`` from a signal handler (the preemption pattern) returns at once
  even when the signal interrupted a negotiation cycle, and the peers learn a
  shutdown, not a timeout.
* The generation's store keys are deleted by whichever rank closes last: no
  rank waits in ``shutdown()`` for another that computes on.
"""

import os

from tests.multiproc.harness import run_ranks


def _forked_child():
    import atexit

    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r = hvd.rank()
    assert hvd.allreduce(torch.ones(2), name="before", op=hvd.Sum).tolist() == [2.0, 2.0]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, then leave through sys.exit
        os.close(read)
        lines = [f"rank={hvd.rank()} size={hvd.size()} initialized={hvd.is_initialized()}"]
        try:
            hvd.allreduce(torch.ones(2), name="child", op=hvd.Sum)
            lines.append("allreduce: no error")
        except Exception as exc:  # noqa: BLE001 - the report is the test
            lines.append(f"allreduce: {type(exc).__name__}: {exc}")
        try:
            hvd.init()
            lines.append("init: no error")
        except Exception as exc:  # noqa: BLE001
            lines.append(f"init: {type(exc).__name__}: {exc}")
        os.write(write, "\n".join(lines).encode())
        os.close(write)
        # What sys.exit() would run (hvdlike's shutdown among it) must not reach the
        # parent's job; then leave without unwinding into the rank's own frames.
        atexit._run_exitfuncs()
        os._exit(0)
    os.close(write)
    report = b""
    while True:
        chunk = os.read(read, 65536)
        if not chunk:
            break
        report += chunk
    _, status = os.waitpid(pid, 0)
    # The parent's job goes on: a burst of collectives, right and on both ranks.
    sums = [hvd.allreduce(torch.full((3,), float(i + r)), name=f"after{i}", op=hvd.Sum).tolist()
            for i in range(30)]
    ok = all(s == [2.0 * i + 1.0] * 3 for i, s in enumerate(sums))
    hvd.shutdown()
    return {"report": report.decode(), "status": os.waitstatus_to_exitcode(status), "ok": ok,
            "parent_pid": os.getpid()}


def test_a_forked_child_is_refused_and_leaves_the_parents_job_alone():
    results = run_ranks(_forked_child, np=2, timeout=120)
    for rank, out in enumerate(results):
        assert out["ok"], out
        assert out["status"] == 0, out
        report = out["report"]
        assert f"rank={rank} size=2 initialized=True" in report, report
        assert "allreduce: HvdlikeInternalError: cannot submit" in report, report
        assert (f"this process was forked from rank {rank} (pid {out['parent_pid']}) after "
                f"init()") in report, report
        assert "init: HvdlikeError: this process was forked from rank" in report, report


def _shutdown_in_a_handler():
    import signal
    import threading

    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r = hvd.rank()

    def handler(signum, frame):
        hvd.shutdown()

    signal.signal(signal.SIGUSR1, handler)
    if r == 0:  # lands wherever rank 0's loop is: often inside a negotiation cycle
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGUSR1)).start()
    k = 0
    try:
        while k < 200000:
            hvd.allreduce(torch.ones(2), name=f"loop{k % 5}", op=hvd.Sum)
            k += 1
        return {"ended": "loop ran out"}
    except Exception as exc:  # noqa: BLE001 - the report is the test
        return {"ended": f"{type(exc).__name__}: {exc}", "calls": k}


def test_shutdown_from_a_signal_handler_stops_the_job_as_a_shutdown():
    results = run_ranks(_shutdown_in_a_handler, np=2, timeout=120)
    # Rank 0's own loop finds hvdlike shut down; rank 1's collective fails naming
    # rank 0's shutdown -- not a 30 s timeout of a shared-memory negotiation.
    assert results[0]["ended"].startswith(("NotInitializedError", "HvdlikeInternalError")), results
    assert "shut down" in results[1]["ended"], results
    assert "rank 0" in results[1]["ended"] and "within" not in results[1]["ended"], results


def _late_closer():
    import datetime
    import time

    import torch
    from torch.distributed import TCPStore

    import hvdlike.torch as hvd
    from hvdlike.core import bootstrap

    torch.set_num_threads(1)
    raw = TCPStore(os.environ[bootstrap.ENV_STORE_ADDR],
                   int(os.environ[bootstrap.ENV_STORE_PORT]), 2, False,
                   timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    raw.add("late/closed", 0)
    raw.add("late/done", 0)
    hvd.init()
    me = hvd.rank()
    hvd.allreduce(torch.ones(2), name="x", op=hvd.Sum)
    hvd.barrier()
    baseline = None
    if me == 0:
        hvd.shutdown()  # rank 1 computes on: nothing to wait for here
        raw.add("late/closed", 1)
    else:
        deadline = time.monotonic() + 60
        while raw.add("late/closed", 0) < 1:  # rank 1 closes only once rank 0 has
            assert time.monotonic() < deadline, "rank 0's shutdown() did not return"
            time.sleep(0.01)
        hvd.shutdown()
        baseline = raw.num_keys()
    raw.add("late/done", 1)
    return {"keys": baseline}


def test_the_rank_closing_last_deletes_the_generations_keys():
    results = run_ranks(_late_closer, np=2, timeout=120)
    # What is left is this test's own three keys and the harness's bootstrap keys,
    # none of the generation's (rank 0 used to wait for rank 1's list, give up
    # after 10 s and leave them all).
    keys = results[1]["keys"]
    assert keys is not None and keys <= 8, results
