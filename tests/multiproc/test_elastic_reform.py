"""Re-forming real ranks into new generations: topology, state, and no leaks.

The test's rank 0 plays the launcher's part for the generations (it publishes
them in the job's store); every re-form is a real shutdown + init with new
Gloo groups under the new generation's store prefix.
"""

import os

from tests.multiproc.harness import run_ranks

REFORMS = 20


def _reform_many(reforms):
    import os
    import threading

    import torch

    import hvdlike.torch as hvd
    from hvdlike.core.elastic import protocol, worker

    torch.set_num_threads(1)
    ctx = worker.context()
    seen = []

    def publish(number):
        order = ["w0", "w1"] if number % 2 else ["w1", "w0"]  # ranks swap every generation
        table = {w: {"rank": r, "size": 2, "local_rank": r, "local_size": 2, "cross_rank": 0,
                     "cross_size": 1, "hostname": "localhost"} for r, w in enumerate(order)}
        ctx.store.set(protocol.generation_key(number),
                      protocol.Generation(number, table, removed_only=True).encode())
        ctx.store.set(protocol.LATEST_KEY, str(number))

    if os.environ["HVDLIKE_RANK"] == "0":
        publish(1)
    hvd.init()  # waits until both members of generation 1 are present

    @hvd.elastic.run
    def train(state):
        total = hvd.allreduce(torch.tensor([float(state.step)]), op=hvd.Sum, name="agree")
        # init() refreshes what horovodrun would export, for this generation's place
        assert (os.environ["HOROVOD_RANK"], os.environ["HOROVOD_SIZE"]) == (str(hvd.rank()), "2")
        seen.append((ctx.generation, hvd.rank(), int(total.item()),
                     threading.active_count(), len(os.listdir("/proc/self/fd"))))
        while state.step < reforms:
            state.step += 1
            if hvd.rank() == 0:
                publish(ctx.generation + 1)
            state.commit()  # every rank sees the new generation here

    state = hvd.elastic.ObjectState(step=0)
    train(state)
    hvd.shutdown()
    return seen


def test_twenty_reforms_keep_topology_state_and_resources():
    env = {"HVDLIKE_ELASTIC_GENERATION": "1", "HVDLIKE_ELASTIC_TIMEOUT": "60"}
    results = run_ranks(_reform_many, np=2, args=(REFORMS,), timeout=240,
                        env=env, per_rank_env=lambda r: {"HVDLIKE_ELASTIC_WORKER": f"w{r}"})
    for worker, seen in enumerate(results):
        assert [g for g, _, _, _, _ in seen] == list(range(1, REFORMS + 2))
        # odd generations: w0 is rank 0; even ones: w1 is rank 0
        assert [r for _, r, _, _, _ in seen] == [
            (worker if g % 2 else 1 - worker) for g in range(1, REFORMS + 2)]
        # both ranks were at the same committed step in every generation
        assert [total for _, _, total, _, _ in seen] == [2 * s for s in range(REFORMS + 1)]
        threads = [t for _, _, _, t, _ in seen]
        fds = [f for _, _, _, _, f in seen]
        print(f"worker {worker}: threads per generation {threads}; open fds {fds}")
        assert max(threads[2:]) == threads[2], threads  # nothing accumulates per re-form
        assert max(fds[2:]) <= fds[2] + 2, fds


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
