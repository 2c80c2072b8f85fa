"""hvdlike-run with the shared-memory plane: segments never outlive the job, however it ends."""

import os
import signal
import textwrap

import pytest

from tests.shm_names import created_by

from .conftest import TRAINING, finish, kill_session, start, wait_ready, wait_until_gone


@pytest.mark.parametrize("victim", ["launcher", "rank"])
def test_nothing_left_in_dev_shm_when_the_launcher_or_a_rank_is_killed(marker, victim):
    (marker / "job.py").write_text(textwrap.dedent(TRAINING))
    proc = start(["-np", "3", "--grace-period-seconds", "2", "python", str(marker / "job.py")])
    try:
        wait_ready(marker, 3, proc, timeout=90)
        pids = [int((marker / f"ready.{r}").read_text()) for r in range(3)]
        ranks = {str(pid) for pid in pids}
        for pid in pids:
            with open(f"/proc/{pid}/maps") as f:
                lines = [line for line in f if "/dev/shm/hvdlike-" in line]
            # The plane is in use, and its name is already gone from /dev/shm.
            assert lines and all(line.rstrip().endswith("(deleted)") for line in lines), lines
        assert created_by(ranks) == set()
        os.kill(proc.pid if victim == "launcher" else pids[1], signal.SIGKILL)
        code, out, err = finish(proc, timeout=60)
    finally:
        kill_session(proc.pid)
    assert code != 0
    assert not wait_until_gone(str(marker), timeout=30)
    assert created_by(ranks) == set()


def test_no_shm_flag_keeps_gloo(marker):
    (marker / "job.py").write_text(textwrap.dedent(TRAINING))
    proc = start(["-np", "2", "--no-shm", "python", str(marker / "job.py")])
    try:
        wait_ready(marker, 2, proc, timeout=90)
        pid = int((marker / "ready.0").read_text())
        with open(f"/proc/{pid}/maps") as f:
            assert not [line for line in f if "/dev/shm/hvdlike-" in line]
    finally:
        kill_session(proc.pid)
        proc.communicate()
