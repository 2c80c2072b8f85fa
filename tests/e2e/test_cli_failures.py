"""hvdlike-run when things go wrong: failing ranks, killed ranks, Ctrl-C, no orphans."""

import os
import signal
import textwrap
import time

import psutil
import pytest

from .conftest import TRAINING, finish, kill_session, run, start, wait_until_gone

# The same without collectives: for tests of the launcher alone (cheaper to start).
SLEEPER = """
    import os, time
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "ready." + os.environ["HVDLIKE_RANK"]), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
"""


def _wait_ready(folder, ranks, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((folder / f"ready.{r}").exists() for r in range(ranks)):
            return [int((folder / f"ready.{r}").read_text() or 0) for r in range(ranks)]
        time.sleep(0.1)
    raise AssertionError(f"ranks not ready within {timeout}s")


def test_rank_exiting_non_zero_stops_the_others(marker):
    script = marker / "job.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['HVDLIKE_RANK'] == '1':\n"
        "    time.sleep(0.5)\n"
        "    print('bad input in shard 1', file=sys.stderr)\n"
        "    sys.exit(3)\n"
        "time.sleep(120)\n"
    )
    code, out, err, _ = run(["-np", "3", "--grace-period-seconds", "2", "python", str(script)],
                            timeout=60)
    assert code == 3
    assert "job failed: rank 1 on host localhost exited with code 3" in err
    assert "bad input in shard 1" in err.split("job failed:", 1)[1]  # stderr tail in the summary
    assert "Traceback" not in err


def test_a_rank_exiting_non_zero_mid_job_is_blamed_not_the_peer_it_shut_down(marker):
    # Rank 1's sys.exit(7) shuts the job down on its way out; rank 0, inside an
    # allreduce, fails at once naming rank 1 and is often reaped first. The job
    # still ends with rank 1's status and names rank 1 (a timing race before) --
    # also when rank 1's interpreter takes seconds to exit after it announced its
    # shutdown (as one that loaded torch can on a busy host; the last run).
    script = marker / "job.py"
    script.write_text(textwrap.dedent("""
        import atexit, os, sys, time
        if os.environ["HVDLIKE_RANK"] == "1":
            atexit.register(time.sleep, float(sys.argv[1]))  # runs after hvdlike's
        import torch
        torch.set_num_threads(1)
        import hvdlike.torch as hvd
        hvd.init()
        if hvd.rank() == 1:
            sys.exit(7)
        for _ in range(3):
            hvd.allreduce(torch.ones(2))
    """))
    for exit_seconds in ("0", "0", "3.5"):
        code, out, err, _ = run(["-np", "2", "python", str(script), exit_seconds], timeout=60)
        assert code == 7, err
        assert "job failed: rank 1 on host localhost exited with code 7" in err, err


def test_rank_killed_by_sigkill_ends_the_job(marker):
    (marker / "job.py").write_text(textwrap.dedent(TRAINING))
    proc = start(["-np", "3", "--grace-period-seconds", "2", "python", str(marker / "job.py")])
    try:
        pids = _wait_ready(marker, 3)
        os.kill(pids[1], signal.SIGKILL)
        code, out, err = finish(proc, timeout=45)
    finally:
        kill_session(proc.pid)
    assert code == 128 + signal.SIGKILL, err
    assert "rank 1 on host localhost was killed by signal 9 (SIGKILL)" in err


# Ctrl-C, and SIGHUP when the launcher's terminal closes: the same orderly stop.
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGHUP, 129)],
                         ids=["ctrl_c", "sighup"])
def test_an_interrupt_stops_every_rank(marker, sig, code):
    (marker / "job.py").write_text(textwrap.dedent(SLEEPER))
    proc = start(["-np", "2", "python", str(marker / "job.py")])
    try:
        pids = _wait_ready(marker, 2)
        proc.send_signal(sig)
        code_seen, out, err = finish(proc, timeout=30)
    finally:
        kill_session(proc.pid)
    assert code_seen == code, err
    assert f"received {sig.name}; stopping 2 rank(s)" in err
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def test_rank_ignoring_sigterm_is_killed_after_the_grace_period(marker):
    script = marker / "stubborn.py"
    script.write_text(
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "open(os.path.join(os.path.dirname(__file__), 'ready.' + os.environ['HVDLIKE_RANK']), 'w').close()\n"
        "time.sleep(120)\n"
    )
    proc = start(["-np", "2", "--grace-period-seconds", "1", "python", str(script)])
    try:
        _wait_ready(marker, 2)
        proc.send_signal(signal.SIGTERM)
        code, out, err = finish(proc, timeout=30)
    finally:
        kill_session(proc.pid)
    assert code == 128 + signal.SIGTERM, err


def test_launcher_killed_outright_leaves_nothing_behind(marker):
    (marker / "job.py").write_text(textwrap.dedent(SLEEPER))
    proc = start(["-np", "2", "python", str(marker / "job.py")])
    try:
        _wait_ready(marker, 2)
        proc.kill()
        proc.communicate(timeout=10)
        assert not wait_until_gone(str(marker), timeout=15)
    finally:
        kill_session(proc.pid)


@pytest.mark.parametrize("when", ["before_init", "before_reinit"])
def test_a_rank_that_exits_0_without_coming_is_named_by_the_ranks_waiting_for_it(marker, when):
    # Rank 1 ends cleanly while rank 0 waits for it in init(): before, rank 0
    # waited out --start-timeout and then knew only that rank 1 "did not take
    # part"; hvdlike-run saw the exit and says so through the store at once.
    script = marker / "job.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, torch
        torch.set_num_threads(1)
        import hvdlike.torch as hvd
        rank = int(os.environ["HVDLIKE_RANK"])
        if {when == "before_reinit"!r}:
            hvd.init()
            hvd.allreduce(torch.ones(2))
            hvd.shutdown()
        if rank == 1:
            sys.exit(0)
        hvd.init()
        print("rank 0 joined with", hvd.size(), "ranks")
    """))
    code, out, err, _ = run(["-np", "2", "--start-timeout", "600", "python", str(script)],
                            timeout=120)
    assert code == 1, err
    assert "rank 1 exited with code 0 (seen by hvdlike-run)" in err, err
    assert "joined with" not in out
    assert "did not take part within" not in err


def test_a_stopped_rank_gets_one_sigterm_not_two(marker):
    # The helper signalled the rank's process group and then every descendant,
    # the rank included: a checkpoint-on-SIGTERM handler could run twice.
    script = marker / "term.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys, time
        here = os.path.dirname(os.path.abspath(__file__))
        rank = os.environ["HVDLIKE_RANK"]
        def handler(signum, frame):
            with open(os.path.join(here, "got." + rank), "a") as f:
                f.write("got\\n")
            time.sleep(1.0)
            sys.exit(0)
        signal.signal(signal.SIGTERM, handler)
        open(os.path.join(here, "ready." + rank), "w").close()
        time.sleep(120)
    """))
    # A second SIGTERM shows only when it arrives after the first was taken:
    # six ranks, each stopped by its own helper, give six chances in one job.
    ranks = 6
    proc = start(["-np", str(ranks), "--grace-period-seconds", "10", "python", str(script)])
    try:
        _wait_ready(marker, ranks)
        proc.send_signal(signal.SIGTERM)
        code, out, err = finish(proc, timeout=60)
    finally:
        kill_session(proc.pid)
    assert code == 128 + signal.SIGTERM, err
    for r in range(ranks):
        assert (marker / f"got.{r}").read_text() == "got\n", (r, err)


def test_ctrl_c_while_the_launcher_starts_up_stops_it(marker):
    # A KeyboardInterrupt raised inside torch's import (the launcher imports it to
    # host the store) could be swallowed there: the launcher then ran the whole job.
    (marker / "job.py").write_text("import time\ntime.sleep(120)\n")
    for delay in (0.15, 0.3, 0.45, 0.6, 0.8, 1.0, 1.3):
        proc = start(["-np", "2", "python", str(marker / "job.py")])
        try:
            time.sleep(delay)
            proc.send_signal(signal.SIGINT)
            code, out, err = finish(proc, timeout=60)
        finally:
            kill_session(proc.pid)
        if code == 1 and "Fatal Python error: init_import_site" in err:
            continue  # a loaded host: the interpreter itself was still starting up
        assert code == 130, (delay, err)
        assert "interrupted" in err and "Traceback" not in err, (delay, err)


MPI_SLEEPER = """
    import os, time
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "ready." + os.environ["PMI_RANK"]), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
"""


@pytest.mark.parametrize("how", ["sighup", "sigkill"])
def test_an_mpi_launch_stops_every_rank_when_the_launcher_is_signalled_or_killed(marker, how):
    # Under --mpi the ranks are mpirun's: a SIGHUP to the launcher (its terminal
    # closed) is passed on and reported as 129; a SIGKILL cannot be passed on,
    # so mpirun is tied to the launcher's life and stops the ranks itself.
    from tests.engines import mpi_env

    from .conftest import launcher_env

    env = mpi_env("mpich", launcher_env())
    (marker / "job.py").write_text(textwrap.dedent(MPI_SLEEPER))
    proc = start(["--mpi", "-np", "2", "python", str(marker / "job.py")], env=env)
    try:
        pids = _wait_ready(marker, 2)
        if how == "sighup":
            proc.send_signal(signal.SIGHUP)
            code, out, err = finish(proc, timeout=30)
            assert code == 128 + signal.SIGHUP, err
            assert "job interrupted (SIGHUP)" in err
        else:
            proc.kill()
            proc.communicate(timeout=10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
            time.sleep(0.1)
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"ranks {alive} outlived the launcher"
    finally:
        kill_session(proc.pid)
