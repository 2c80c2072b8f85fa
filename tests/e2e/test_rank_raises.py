"""A rank that raises: its traceback once, the failure attributed to it, the rest stopped."""

from .conftest import run, wait_until_gone, write_script

RAISES = """
import time
import torch
torch.set_num_threads(1)
import hvdlike.torch as hvd

hvd.init()
for step in range(10000):
    hvd.allreduce(torch.ones(4), name=f"s{step}")
    if hvd.rank() == 1 and step == 3:
        raise ValueError("shard 1 is corrupt")
    time.sleep(0.02)
"""


def test_rank_that_raises_is_named_and_its_traceback_appears_once(marker):
    script = write_script(marker, "job.py", RAISES)
    code, out, err, seconds = run(["-np", "3", "--grace-period-seconds", "2", "python", script],
                                  timeout=90)
    assert code == 1, err
    # Rank 1's traceback once (the summary quotes its last line, not the traceback). On
    # a loaded host the peers may see rank 1's death before the launcher stops them,
    # and print their own error's traceback: that is theirs, and names rank 1.
    assert err.count("[1]<stderr>:Traceback (most recent call last):") == 1, err
    assert err.count('raise ValueError("shard 1 is corrupt")') == 1, err
    for peer in (0, 2):
        if f"[{peer}]<stderr>:Traceback" in err:
            assert f"[{peer}]<stderr>:hvdlike.core.errors.HvdlikeInternalError: rank {peer} " \
                   "(localhost): rank 1 on localhost" in err, err
    assert '[1]<stderr>:    raise ValueError("shard 1 is corrupt")' in err
    assert "job failed: rank 1 on host localhost exited with code 1" in err
    assert "ValueError: shard 1 is corrupt" in err.split("job failed:", 1)[1]
    assert not wait_until_gone(str(marker))
