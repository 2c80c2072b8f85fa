"""Long runs leave nothing growing: what a runtime keeps stays bounded.

Each test repeats one pattern many times on real ranks and compares what the
processes hold after a few repetitions (one-time costs paid) with what they
hold at the end: the keys in the job's store, the runtime's own tables,
threads and open descriptors.
"""

import os

from tests.multiproc.harness import run_ranks


def _store_client():
    """A plain connection to the job's store (not hvdlike's), to count its keys."""
    import datetime

    from torch.distributed import TCPStore

    from hvdlike.core import bootstrap

    return TCPStore(os.environ[bootstrap.ENV_STORE_ADDR],
                    int(os.environ[bootstrap.ENV_STORE_PORT]), 2, False,
                    timeout=datetime.timedelta(seconds=60), wait_for_workers=False)


def _add_and_remove(cycles, measured):
    import threading
    import time

    import torch

    import hvdlike.torch as hvd
    from hvdlike.core import api

    torch.set_num_threads(1)
    raw = _store_client()
    hvd.init(process_sets="dynamic")
    runtime = api.runtime()
    deadline = time.monotonic() + 60
    while min(runtime.health._counters_of(range(hvd.size())).values()) < 2:
        # Every health watcher has ticked (its records are written once, at the first).
        assert time.monotonic() < deadline, "the health watchers never beat"
        time.sleep(0.05)
    samples = {}
    for i in range(cycles):
        pair = hvd.add_process_set([0, 1])
        if pair.included():
            total = hvd.allreduce(torch.ones(2), process_set=pair, op=hvd.Sum)  # named for it
            assert total.tolist() == [2.0, 2.0]
            hvd.allreduce(torch.ones(2), process_set=pair, name="named")
        assert hvd.remove_process_set(pair)
        if i in measured:
            hvd.barrier()  # every rank past the removal: the last member deleted the keys
            samples[i] = {"store keys": raw.num_keys(),
                          "keys recorded": sum(len(log.written()) for log in runtime._key_logs),
                          "name counters": len(runtime._counters),
                          "threads": threading.active_count(),
                          "descriptors": len(os.listdir("/proc/self/fd"))}
            hvd.barrier()  # nobody counts while another still writes
    hvd.shutdown()
    return samples


def test_process_sets_added_and_removed_leave_nothing_behind():
    """Each added set's rendezvous and shared-memory records, and its automatic
    names' counter, go when it is removed (they piled up until shutdown)."""
    cycles, measured = 20, (5, 19)
    results = run_ranks(_add_and_remove, np=3, args=(cycles, list(measured)), timeout=120)
    for rank, samples in enumerate(results):
        first, last = samples[measured[0]], samples[measured[1]]
        for what in ("store keys", "keys recorded", "name counters", "threads"):
            assert last[what] <= first[what], f"rank {rank}: {what}: {first} -> {last}"
        assert last["descriptors"] <= first["descriptors"] + 2, f"rank {rank}: {first} -> {last}"


def _init_on_part_of_the_job(cycles, measured):
    import time

    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    raw = _store_client()
    raw.add("leaks/closed", 0)  # exists from here on: the count sees only hvdlike's keys

    def meet(n):  # the three ranks meet outside hvdlike: they run two separate jobs
        raw.add("leaks/closed", 1)
        deadline = time.monotonic() + 60
        while raw.add("leaks/closed", 0) < n:
            assert time.monotonic() < deadline, "the other ranks did not come"
            time.sleep(0.005)

    me = int(os.environ["HVDLIKE_RANK"])
    keys = {}
    for i in range(cycles):
        hvd.init(comm=[0, 1] if me < 2 else [2])
        assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2
        hvd.shutdown()
        if i in measured:
            meet(3 * (2 * measured.index(i) + 1))  # every runtime of this cycle closed
            keys[i] = raw.num_keys()
            meet(3 * (2 * measured.index(i) + 2))
    return keys


def test_runtimes_on_part_of_the_job_leave_no_keys_behind():
    """``init(comm=[ranks])`` then ``shutdown()``, again and again: each member's
    host record (written while the list's ranks were renumbered) is deleted with
    the generation's other keys (one per member and init() stayed for good)."""
    cycles, measured = 10, (3, 9)
    for rank, keys in enumerate(run_ranks(_init_on_part_of_the_job, np=3,
                                          args=(cycles, list(measured)), timeout=120)):
        assert keys[measured[1]] <= keys[measured[0]], f"rank {rank}: store keys {keys}"
