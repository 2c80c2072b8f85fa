"""Ranks that part ways: one raised and went on, the other waits on a collective.

Both must get an error within the configured deadline, and ``shutdown()``
followed by ``init()`` must give every rank a runtime that works as if
nothing had happened -- twice in a row, so nothing of the first failure
lingers (an abort record, a half-negotiated name, a stale auto-name counter).
"""

import os
import socket
import time

from tests.multiproc.harness import run_ranks

DEADLINES = {"HVDLIKE_STALL_CHECK_TIME_SECONDS": "1",
             "HVDLIKE_STALL_SHUTDOWN_TIME_SECONDS": "3"}


def _diverge_then_recover(rounds):
    import torch

    import hvdlike.torch as hvd
    from hvdlike.core.errors import HvdlikeError

    report = []
    for round_ in range(rounds):
        hvd.init()
        hvd.allreduce(torch.ones(1), name="before")
        started = time.monotonic()
        try:
            if hvd.rank() == 0:
                # this rank's test "failed" here and it moved on to its teardown
                hvd.barrier()
            else:
                hvd.allreduce(torch.ones(3), name="the.next.assertion")
            outcome = "no error"
        except HvdlikeError as exc:
            outcome = type(exc).__name__
            message = str(exc)
        report.append((outcome, round(time.monotonic() - started, 1)))
        if outcome == "DeadlockError":
            report.append(message)
        hvd.shutdown()
        hvd.init()
        total = hvd.allreduce(torch.full((2,), float(hvd.rank() + 1)), op=hvd.Sum)
        gathered = hvd.allgather(torch.tensor([hvd.rank()]))
        # the harness exports only HVDLIKE_*: init() sets what horovodrun would
        horovod = {k[len("HOROVOD_"):]: v for k, v in os.environ.items()
                   if k in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK",
                            "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME")}
        assert horovod == {"RANK": str(hvd.rank()), "SIZE": str(hvd.size()),
                           "LOCAL_RANK": str(hvd.local_rank()), "CROSS_SIZE": "1",
                           "HOSTNAME": socket.gethostname()}, horovod
        report.append((total.tolist(), gathered.tolist(), hvd.size()))
        hvd.shutdown()
    return report


def test_diverged_ranks_both_fail_within_the_deadline_then_reinit_cleanly():
    results = run_ranks(_diverge_then_recover, np=2, args=(2,), env=DEADLINES, timeout=120)
    for report in results:
        for failed, recovered in (report[0:2], report[2:4]):  # no DeadlockError line
            outcome, waited = failed
            assert outcome == "StallError", report
            assert waited < 30, report  # deadline 3s plus detection; far from a hang
            assert recovered == ([3.0, 3.0], [0, 1], 2), report


def test_by_default_a_deadlock_fails_every_rank_naming_what_each_waits_for():
    # No stall shutdown configured (Horovod's default): the deadlock check ends it.
    env = {"HVDLIKE_DEADLOCK_TIME_SECONDS": "2"}
    results = run_ranks(_diverge_then_recover, np=3, args=(1,), env=env, timeout=120)
    for report in results:
        (outcome, waited), message, recovered = report
        assert outcome == "DeadlockError", report
        assert waited < 30, report
        assert "deadlock: rank(s) 0, 1, 2 have all waited" in message, message
        assert "rank 0 (" in message and "waits for 'barrier.noname.0', not submitted by " \
            "rank(s) 1, 2" in message, message
        assert "waits for 'allreduce.the.next.assertion', not submitted by rank(s) 0" in message, message
        assert recovered == ([6.0, 6.0], [0, 1, 2], 3), report


def _mismatch_then_recover():
    import torch

    import hvdlike.torch as hvd
    from hvdlike.core.errors import HvdlikeError

    hvd.init()
    try:
        # same name, different shapes: the ranks' programs disagree
        hvd.allreduce(torch.ones(2 + hvd.rank()), name="disagree")
        outcome = "no error"
    except HvdlikeError as exc:
        # as in Horovod, a HorovodInternalError from synchronize; also a ValueError
        outcome = (type(exc).__name__, isinstance(exc, hvd.HorovodInternalError),
                   isinstance(exc, ValueError))
    after = hvd.allreduce(torch.ones(2), name="still.works", op=hvd.Sum).tolist()
    hvd.shutdown()
    hvd.init()
    again = hvd.allreduce(torch.ones(2), name="still.works", op=hvd.Sum).tolist()
    hvd.shutdown()
    return outcome, after, again


def test_mismatch_fails_on_every_rank_and_the_runtime_goes_on():
    results = run_ranks(_mismatch_then_recover, np=2, env=DEADLINES, timeout=90)
    assert results == [(("MismatchError", True, True), [2.0, 2.0], [2.0, 2.0])] * 2, results
