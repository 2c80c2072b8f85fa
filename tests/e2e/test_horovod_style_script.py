"""A script written for horovodrun: it reads HOROVOD_* variables before init()."""

from .conftest import run, write_script

HOROVOD_STYLE = """
    import os
    import socket

    # Before init(), as scripts and test harnesses written for Horovod do
    before = {k: os.environ[k] for k in (
        "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
        "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME")}
    log_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "logs-rank%s" % before["HOROVOD_RANK"])
    os.makedirs(log_dir)

    import torch
    torch.set_num_threads(1)
    import hvdlike.torch as hvd

    hvd.init()
    after = {"HOROVOD_RANK": hvd.rank(), "HOROVOD_SIZE": hvd.size(),
             "HOROVOD_LOCAL_RANK": hvd.local_rank(), "HOROVOD_LOCAL_SIZE": hvd.local_size(),
             "HOROVOD_CROSS_RANK": hvd.cross_rank(), "HOROVOD_CROSS_SIZE": hvd.cross_size()}
    for key, value in after.items():
        assert before[key] == str(value), (key, before[key], value)
    total = hvd.allreduce(torch.tensor([float(before["HOROVOD_RANK"])]), op=hvd.Sum).item()
    print("rank=%s size=%s host=%s sum=%g" % (before["HOROVOD_RANK"], before["HOROVOD_SIZE"],
                                              before["HOROVOD_HOSTNAME"], total))
    hvd.shutdown()
"""


def test_horovod_variables_are_set_before_init_and_agree_with_it(marker):
    script = write_script(marker, "train.py", HOROVOD_STYLE)
    code, out, err, _ = run(["-np", "3", "python", script], timeout=120)
    assert code == 0, err
    for rank in range(3):
        assert f"[{rank}]<stdout>:rank={rank} size=3 host=localhost sum=3" in out, out
        assert (marker / f"logs-rank{rank}").is_dir()
