"""Many runtimes in one process: each init()/shutdown() leaves nothing behind.

Every cycle builds a runtime with a process set per rank, a timeline and the
autotuner, runs collectives on the global set and on the rank's own set, and
shuts down. Between cycles the ranks meet on a plain store connection of
their own (not hvdlike's) and count this process's threads and descriptors
and the keys in the job's store.
"""

import json
import os

from tests.multiproc.harness import run_ranks

# Threads and store keys must match exactly and descriptors must not grow, so a
# runtime that leaves one of them behind per cycle fails the test as soon as one
# cycle lies between the two samples; fifteen lie between them here.
CYCLES = 20
MEASURED = (4, CYCLES - 1)  # after a few cycles (lazy imports done), and at the end


def _cycles(cycles, measured, folder):
    import datetime
    import threading
    import time

    import psutil
    import torch
    from torch.distributed import TCPStore

    import hvdlike.torch as hvd
    from hvdlike.core import api, bootstrap

    torch.set_num_threads(1)
    raw = TCPStore(os.environ[bootstrap.ENV_STORE_ADDR],
                   int(os.environ[bootstrap.ENV_STORE_PORT]), 2, False,
                   timeout=datetime.timedelta(seconds=60), wait_for_workers=False)

    for key in ("lifecycle/closed", "lifecycle/measured"):
        raw.add(key, 0)  # both exist from here on: the key count sees only hvdlike's

    def meet(key, n):
        raw.add(key, 1)
        deadline = time.monotonic() + 60
        while raw.add(key, 0) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the other rank did not reach {key} ({n})")
            time.sleep(0.005)

    me = int(os.environ[bootstrap.ENV_RANK])
    proc = psutil.Process()
    samples = {}
    for i in range(cycles):
        sets = [hvd.ProcessSet([0]), hvd.ProcessSet([1])]
        hvd.init(process_sets=sets)
        runtime = api.runtime()
        assert runtime.autotuner is not None and runtime.recording.timeline is not None
        mine = sets[hvd.rank()]
        total = hvd.allreduce(torch.ones(2), name="x", op=hvd.Sum)
        alone = hvd.allreduce(torch.ones(2) * (hvd.rank() + 1), name="own", op=hvd.Sum,
                              process_set=mine)
        assert total.tolist() == [2.0, 2.0] and alone.tolist() == [hvd.rank() + 1.0] * 2
        assert hvd.broadcast_object(i, root_rank=0) == i
        hvd.shutdown()
        if i in measured:
            meet("lifecycle/closed", 2 * (measured.index(i) + 1))
            time.sleep(0.2)  # threads that were told to end have ended
            samples[i] = (threading.active_count(), proc.num_fds(), raw.num_keys())
            meet("lifecycle/measured", 2 * (measured.index(i) + 1))
    with open(os.path.join(folder, f"tl-{me}.json")) as f:
        events = json.load(f)  # the last runtime closed its timeline as valid JSON
    return samples, len(events)


def test_many_runtimes_with_sets_timeline_and_autotune_leak_nothing(tmp_path):
    env = {"HVDLIKE_TIMELINE": str(tmp_path / "tl-{rank}.json"), "HVDLIKE_AUTOTUNE": "1"}
    results = run_ranks(_cycles, np=2, args=(CYCLES, list(MEASURED), str(tmp_path)), env=env,
                        timeout=150)
    for rank, (samples, events) in enumerate(results):
        first, last = samples[MEASURED[0]], samples[MEASURED[1]]
        assert events > 0, rank
        assert last[0] == first[0], f"rank {rank}: threads {first[0]} -> {last[0]}"
        assert last[1] <= first[1], f"rank {rank}: open descriptors {first[1]} -> {last[1]}"
        assert last[2] == first[2], f"rank {rank}: store keys {first[2]} -> {last[2]}"
