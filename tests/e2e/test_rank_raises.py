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
    assert err.count("Traceback (most recent call last):") == 1, err
    assert '[1]<stderr>:    raise ValueError("shard 1 is corrupt")' in err
    assert "job failed: rank 1 on host localhost exited with code 1" in err
    assert "ValueError: shard 1 is corrupt" in err.split("job failed:", 1)[1]
    assert not wait_until_gone(str(marker))
