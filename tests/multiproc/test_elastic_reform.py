"""Re-forming real ranks into new generations: topology, state, and no leaks.

The test's rank 0 plays the launcher's part for the generations (it publishes
them in the job's store); every re-form is a real shutdown + init with new
Gloo groups under the new generation's store prefix.
"""

import os
import secrets

from tests.multiproc.harness import run_ranks

REFORMS = 20
# Each process's own secret, as the launcher would give it (the test's rank 0, playing
# the launcher, gets them all as an argument).
SECRETS = {f"w{r}": secrets.token_hex(16) for r in range(3)}
FAILED = (5, 11, 17)  # generations that end in a lost peer instead of new hosts


def _reform_many(reforms, failed, timeline, worker_secrets):
    import json
    import os
    import threading
    import time

    import torch

    import hvdlike.torch as hvd
    from hvdlike.core import api
    from hvdlike.core.autotune import Candidate
    from hvdlike.core.elastic import protocol, worker

    torch.set_num_threads(1)
    ctx = worker.context()
    seen = []

    def publish(number):
        order = ["w0", "w1"] if number % 2 else ["w1", "w0"]  # ranks swap every generation
        table = {w: {"rank": r, "size": 2, "local_rank": r, "local_size": 2, "cross_rank": 0,
                     "cross_size": 1, "hostname": "localhost"} for r, w in enumerate(order)}
        protocol.publish(ctx.store, protocol.Generation(number, table, removed_only=True),
                         worker_secrets)
        ctx.store.set(protocol.LATEST_KEY, str(number))

    if os.environ["HVDLIKE_RANK"] == "0":
        publish(1)
    else:  # the launcher publishes a generation before it starts its ranks
        ctx.store.wait([protocol.LATEST_KEY])
    first, second = hvd.ProcessSet([0]), hvd.ProcessSet([1])
    # knobs given to init(), static sets; waits until both members of generation 1 are present
    hvd.init(process_sets=[first, second], fusion_threshold=12345, autotune=True,
             autotune_warmup_samples=1000)
    hvd.start_timeline(timeline, mark_cycles=True)

    @hvd.elastic.run
    def train(state):
        rt = api.runtime()
        if ctx.generation == 3:  # as if the autotuner had settled: every later one keeps it
            rt.autotuner, rt.tuned = None, Candidate(4 << 20, 2.5)
            rt.settings.apply(rt.tuned)
        total = hvd.allreduce(torch.tensor([float(state.step)]), op=hvd.Sum, name="agree")
        # init() refreshes what horovodrun would export, for this generation's place
        assert (os.environ["HOROVOD_RANK"], os.environ["HOROVOD_SIZE"]) == (str(hvd.rank()), "2")
        mine = first if first.included() else second
        alone = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, process_set=mine, name="alone")
        seen.append({
            "gen": ctx.generation, "rank": hvd.rank(), "total": int(total.item()),
            "threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd")),
            "keys": ctx.store.num_keys(), "knob": rt.config.fusion_threshold,
            "sets": {i: rt.sets.ranks_of(i) for i in sorted(rt.sets.objects)},
            "ids": (first.process_set_id, second.process_set_id), "alone": alone.item(),
            "tuning": (rt.autotuner is not None, rt.settings.fusion_threshold,
                       rt.settings.cycle_seconds),
            "recording": rt.recording.timeline is not None, "at": time.monotonic()})
        while state.step < reforms - len(failed):
            state.step += 1
            if ctx.generation in failed:
                if hvd.rank() == 0:
                    publish(ctx.generation + 1)  # the launcher would, after the loss
                hvd.allreduce(torch.ones(1), name="published")
                if hvd.rank() == 1:
                    rt.abort("lost on purpose")  # this rank's runtime goes away
                hvd.allreduce(torch.ones(1), name="fails")  # HorovodInternalError on both
            if hvd.rank() == 0:
                publish(ctx.generation + 1)
            state.commit()  # every rank sees the new generation here

    state = hvd.elastic.ObjectState(step=0)
    train(state)
    # Both ranks past their last collective (each one's "alone" runs in its own
    # set) before either shuts down: a shutdown is agreed in the global set's
    # next cycle, and fails what the other rank still has pending, as Horovod's does.
    hvd.barrier()
    hvd.shutdown()
    # the file this process started under its first rank, one JSON array across generations
    with open(timeline.replace("{rank}", os.environ["HVDLIKE_ELASTIC_WORKER"][1:])) as f:
        events = json.load(f)
    rows = {e["pid"] for e in events if e.get("name") == "process_name"
            and e["args"].get("name") == "allreduce.agree"}
    return seen, sum(1 for e in events if e.get("pid") in rows and e["name"].startswith("NEGOTIATE"))


def _worker_env(rank):
    return {"HVDLIKE_ELASTIC_WORKER": f"w{rank}",
            "HVDLIKE_ELASTIC_WORKER_SECRET": SECRETS[f"w{rank}"]}


def test_twenty_reforms_keep_topology_state_settings_and_resources(tmp_path):
    # Gloo, not shared memory, carries the collectives: a peer that aborts without
    # exiting is noticed on its closed sockets at once, not at the shared-memory timeout.
    env = {"HVDLIKE_ELASTIC_GENERATION": "1", "HVDLIKE_ELASTIC_TIMEOUT": "60", "HVDLIKE_SHM": "0"}
    timeline = str(tmp_path / "timeline.{rank}.json")
    results = run_ranks(_reform_many, np=2, args=(REFORMS, FAILED, timeline, SECRETS), timeout=240,
                        env=env, per_rank_env=_worker_env)
    steps, step = [], 0  # the committed step each generation starts from
    for g in range(1, REFORMS + 2):
        steps.append(step)
        step += 0 if g in FAILED else 1
    for worker, (seen, agreed) in enumerate(results):
        assert [s["gen"] for s in seen] == list(range(1, REFORMS + 2))
        # odd generations: w0 is rank 0; even ones: w1 is rank 0
        assert [s["rank"] for s in seen] == [
            (worker if g % 2 else 1 - worker) for g in range(1, REFORMS + 2)]
        # both ranks were at the same committed step in every generation
        assert [s["total"] for s in seen] == [2 * s for s in steps]
        # knobs, static process sets (same ids, same global ranks), timeline and tuning
        assert {s["knob"] for s in seen} == {12345}
        assert all(s["sets"] == {1: [0], 2: [1]} and s["ids"] == (1, 2) for s in seen), seen
        assert {s["alone"] for s in seen} == {1.0}
        assert all(s["recording"] for s in seen)
        assert all(s["tuning"][0] for s in seen[:2])  # still tuning
        assert {s["tuning"] for s in seen[2:]} == {(False, 4 << 20, 0.0025)}
        assert agreed == REFORMS + 1, agreed
        threads = [s["threads"] for s in seen]
        fds = [s["fds"] for s in seen]
        keys = [s["keys"] for s in seen]
        at = [round(b["at"] - a["at"], 2) for a, b in zip(seen, seen[1:])]
        print(f"worker {worker}: threads per generation {threads}; open fds {fds}; "
              f"store keys {keys}; seconds between generations {at}")
        assert max(threads[2:]) == threads[2], threads  # nothing accumulates per re-form
        assert max(fds[2:]) <= fds[2] + 2, fds
        # failed and finished generations' keys are deleted: no growth over 20 re-forms
        assert max(keys[2:]) <= keys[2] + 8, keys


def _torch_state_sync():
    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r = hvd.rank()
    torch.manual_seed(r)  # different models on purpose
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if r == 0:  # only rank 0 has momentum buffers yet (a new rank has none)
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
    sampler = hvd.elastic.ElasticSampler(list(range(16)), seed=2)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler,
                                   epoch=10 + r)
    sampler.processed_indices = {r, 8 + r}  # each rank knows a different part
    state.sync()
    params = [p.detach().clone() for p in model.parameters()]
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    synced = (state.epoch, sorted(sampler.processed_indices), len(list(sampler)))
    # restore() after a commit and a change goes back to the committed values
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    state.epoch = 99
    state.restore()
    restored = all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    hvd.shutdown()
    return ([p.tolist() for p in params], [m.tolist() for m in momentum], synced,
            restored, state.epoch)


def test_torch_state_sync_broadcasts_rank0_and_unions_processed_indices():
    first, second = run_ranks(_torch_state_sync, np=2, timeout=120)
    assert first[0] == second[0] and first[1] == second[1]  # parameters and momentum
    assert first[2] == second[2] == (10, [0, 1, 8, 9], 6)  # rank 0's epoch, the union
    assert first[3] and second[3] and first[4] == second[4] == 10


def _numpy_object_state():
    import numpy as np

    import hvdlike.numpy as hvd

    hvd.init()
    state = hvd.elastic.ObjectState(weights=np.full(3, float(hvd.rank())), step=hvd.rank())
    synced = run_in_loop = None

    @hvd.elastic.run
    def train(state):
        nonlocal synced
        synced = (state.weights.tolist(), state.step)
        state.weights = state.weights + 1
        state.step += 1
        state.commit()
        return state.step

    run_in_loop = train(state)
    hvd.shutdown()
    return synced, run_in_loop


def test_numpy_front_end_shares_the_elastic_core():
    results = run_ranks(_numpy_object_state, np=2, timeout=120)
    assert results == [(([0.0, 0.0, 0.0], 0), 1)] * 2  # rank 0's state, then one step
