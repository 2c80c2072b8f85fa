"""Ranks that part ways: one raised and went on, the other waits on a collective.

Both must get an error within the configured deadline, and ``shutdown()``
followed by ``init()`` must give every rank a runtime that works as if
nothing had happened -- twice in a row, so nothing of the first failure
lingers (an abort record, a half-negotiated name, a stale auto-name counter).
"""

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
        report.append((outcome, round(time.monotonic() - started, 1)))
        hvd.shutdown()
        hvd.init()
        total = hvd.allreduce(torch.full((2,), float(hvd.rank() + 1)), op=hvd.Sum)
        gathered = hvd.allgather(torch.tensor([hvd.rank()]))
        report.append((total.tolist(), gathered.tolist(), hvd.size()))
        hvd.shutdown()
    return report


def test_diverged_ranks_both_fail_within_the_deadline_then_reinit_cleanly():
    results = run_ranks(_diverge_then_recover, np=2, args=(2,), env=DEADLINES, timeout=120)
    for report in results:
        for failed, recovered in (report[0:2], report[2:4]):
            outcome, waited = failed
            assert outcome == "StallError", report
            assert waited < 30, report  # deadline 3s plus detection; far from a hang
            assert recovered == ([3.0, 3.0], [0, 1], 2), report


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
        outcome = type(exc).__name__
    after = hvd.allreduce(torch.ones(2), name="still.works", op=hvd.Sum).tolist()
    hvd.shutdown()
    hvd.init()
    again = hvd.allreduce(torch.ones(2), name="still.works", op=hvd.Sum).tolist()
    hvd.shutdown()
    return outcome, after, again


def test_mismatch_fails_on_every_rank_and_the_runtime_goes_on():
    results = run_ranks(_mismatch_then_recover, np=2, env=DEADLINES, timeout=90)
    assert results == [("MismatchError", [2.0, 2.0], [2.0, 2.0])] * 2, results
