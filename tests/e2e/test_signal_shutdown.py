"""The preemption recipe under hvdlike-run: a SIGTERM handler calls ``hvd.shutdown()``
and exits 0 while the rank loops on synchronous collectives.

The signal often lands inside a negotiation cycle the rank runs itself; the
rank must still exit 0 (no SIGABRT from groups torn down under the interrupted
cycle, no ``sys.exit`` turned into an internal error) and its peer must read a
shutdown, not a timeout.
"""

import textwrap

from .conftest import run

SCRIPT = """
    import os, signal, sys, threading
    import torch
    torch.set_num_threads(1)
    import hvdlike.torch as hvd
    hvd.init()
    r = hvd.rank()

    def on_term(signum, frame):
        hvd.shutdown()
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    try:
        for k in range(200000):  # new names: every call is negotiated and launched afresh
            hvd.allreduce(torch.ones(4), name=f"a{k}", op=hvd.Sum)
            if k == 0 and r == 1:  # both ranks are in the loop: the signal lands amid its cycles
                delay = float(sys.argv[1])
                threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    except hvd.HorovodInternalError as exc:
        print(f"rank {r} stopped: {exc}", flush=True)
        sys.exit(0 if "shut down" in str(exc) else 5)
"""


def test_shutdown_and_exit_from_a_sigterm_handler_end_the_job_cleanly(marker):
    (marker / "job.py").write_text(textwrap.dedent(SCRIPT))
    # Where the signal lands varies (inside a cycle or between two): three runs,
    # each with the signal at another time after the loop started.
    for delay in ("0.1", "0.25", "0.4"):
        code, out, err, _ = run(["-np", "2", "python", str(marker / "job.py"), delay],
                                timeout=90)
        assert "terminate called" not in err, err
        assert code == 0, out + err
        assert "rank 0 stopped:" in out and "rank 1 on localhost" in out, out
