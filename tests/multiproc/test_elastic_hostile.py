"""The elastic state and sampler on real ranks, given what a careless script does."""

from tests.multiproc.harness import run_ranks


def _few_left_and_a_late_model():
    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r = hvd.rank()
    sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=True, seed=5)
    if r == 0:  # rank 0 knows nine samples of the epoch are done; one is left for 3 ranks
        sampler.record_indices(sampler.remaining_indices[:9])
    state = hvd.elastic.TorchState(sampler=sampler, epoch=0)
    torch.manual_seed(r)  # a different model on every rank, given to the state late
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state.model = model
    state.optimizer = optimizer
    out = {}

    @hvd.elastic.run
    def train(state):
        steps = 0
        for index in state.sampler:  # one step per sample: every rank must take as many
            optimizer.zero_grad()
            model(torch.full((1, 3), float(index))).sum().backward()
            for p in model.parameters():
                p.grad = hvd.allreduce(p.grad, name=f"grad{steps}.{p.dim()}")
            optimizer.step()
            steps += 1
        out["dealt"] = list(state.sampler)
        out["steps"] = steps
        return "done"

    out["returned"] = train(state)
    out["same_objects"] = state.model is model and state.optimizer is optimizer
    out["params"] = [p.detach().tolist() for p in model.parameters()]
    hvd.barrier()
    hvd.shutdown()
    return out


def test_one_sample_left_for_three_ranks_and_a_model_given_late():
    results = run_ranks(_few_left_and_a_late_model, np=3, timeout=180)
    # the union of what the ranks know; the one sample left is dealt to every rank
    assert {len(out["dealt"]) for out in results} == {1}
    assert len({out["dealt"][0] for out in results}) == 1
    assert [out["steps"] for out in results] == [1, 1, 1]
    assert [out["returned"] for out in results] == ["done"] * 3
    # rank 0's model, broadcast into the object the optimizer updates, on every rank
    assert all(out["same_objects"] for out in results)
    assert results[0]["params"] == results[1]["params"] == results[2]["params"]


def _datasets_of_different_lengths():
    import torch

    import hvdlike.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    sampler = hvd.elastic.ElasticSampler(list(range(10 + hvd.rank())))
    state = hvd.elastic.TorchState(sampler=sampler, epoch=0)

    @hvd.elastic.run
    def train(state):
        return len(list(state.sampler))

    try:
        outcome = train(state)
    except ValueError as exc:
        outcome = str(exc)
    hvd.barrier()
    hvd.shutdown()
    return outcome


def test_ranks_whose_datasets_differ_in_length_are_told_so():
    results = run_ranks(_datasets_of_different_lengths, np=2, timeout=120)
    for outcome in results:
        assert "disagree on len(dataset): rank 0: 10, rank 1: 11" in str(outcome), results


def _a_joiner_without_the_attributes_the_survivor_committed():
    import torch

    import hvdlike.torch as hvd

    hvd.init()
    model = torch.nn.Linear(2, 1)
    state = hvd.elastic.TorchState(model=model, optimizer=None)
    if hvd.rank() == 0:  # the survivor: its training function added and committed these
        state.steps = 7
        state.history = [1, 2]
        state.commit()
    state.sync()  # the joiner (rank 1) holds no plain attribute: it used to skip the broadcast
    out = (state.steps, state.history, float(model.weight.detach().sum()))
    hvd.shutdown()
    return out


def test_a_rank_joining_receives_attributes_added_after_construction():
    results = run_ranks(_a_joiner_without_the_attributes_the_survivor_committed, np=2,
                        timeout=90)
    assert results[0] == results[1]
    assert results[1][:2] == (7, [1, 2])
