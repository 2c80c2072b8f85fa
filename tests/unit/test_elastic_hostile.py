"""The elastic API given bad input, in one process: clear errors, no lost or
repeated samples, state restored into the objects the training loop holds."""

import threading

import numpy as np
import pytest
import torch

from hvdlike.core.elastic import ObjectState, run_fn
from hvdlike.core.errors import DeadlockError, HorovodInternalError


def _fake_job(monkeypatch, size, rank):
    from hvdlike.core import api

    monkeypatch.setattr(api, "is_initialized", lambda: True)
    monkeypatch.setattr(api, "size", lambda: size)
    monkeypatch.setattr(api, "rank", lambda: rank)


def _sampler(n=10, shuffle=False, seed=0):
    from hvdlike.torch.elastic import ElasticSampler

    return ElasticSampler(list(range(n)), shuffle=shuffle, seed=seed)


def _object_state(**kwargs):
    return ObjectState(lambda obj, root_rank=0: obj, lambda: 0, lambda obj: [obj], **kwargs)


# -- ElasticSampler ----------------------------------------------------------------------


@pytest.mark.parametrize("size", [3, 4, 5])
def test_every_rank_is_dealt_as_many_samples_when_fewer_remain_than_ranks(monkeypatch, size):
    # One sample left after a re-form onto more ranks: every rank must still run
    # the same number of batches, or the ranks that have one wait for the others.
    dealt = []
    for rank in range(size):
        _fake_job(monkeypatch, size, rank)
        sampler = _sampler(10)
        sampler.load_state_dict({"epoch": 0, "processed_indices": list(range(9))})
        dealt.append(list(sampler))
        assert len(sampler) == 1
    assert dealt == [[9]] * size


def test_padding_with_two_left_on_five_ranks_repeats_only_what_is_left(monkeypatch):
    dealt = []
    for rank in range(5):
        _fake_job(monkeypatch, 5, rank)
        sampler = _sampler(10, shuffle=True, seed=4)
        left = sampler.remaining_indices[-2:]
        sampler.load_state_dict({"epoch": 0,
                                 "processed_indices": sampler.remaining_indices[:-2]})
        dealt += list(sampler)
    assert len(dealt) == 5 and set(dealt) == set(left)


def test_record_batch_rejects_negative_and_non_integer_batches_and_ignores_late_ones(monkeypatch):
    _fake_job(monkeypatch, 2, 0)
    sampler = _sampler(10)  # 5 samples per rank
    with pytest.raises(ValueError, match="batch_idx must be >= 0, got -2"):
        sampler.record_batch(-2, 2)  # used to mark the tail of the epoch as processed
    with pytest.raises(TypeError, match="batch_idx must be an integer, got float 1.0"):
        sampler.record_batch(1.0, 2)
    with pytest.raises(ValueError, match="batch_size must be > 0, got 0"):
        sampler.record_batch(0, 0)
    with pytest.raises(TypeError, match="batch_size must be an integer"):
        sampler.record_batch(0, True)
    # Past what each rank was dealt: Horovod ignores it, and scripts rely on that.
    with pytest.warns(UserWarning, match="batch 3 of size 2 starts at sample 6, but each rank "
                                         "was dealt only 5"):
        sampler.record_batch(3, 2)
    assert sampler.processed_indices == set()
    sampler.record_batch(np.int64(2), torch.tensor(2))  # the last, partial batch
    assert sampler.processed_indices == {8, 9}


def test_record_indices_and_get_indices_as_in_horovod(monkeypatch):
    _fake_job(monkeypatch, 2, 1)
    sampler = _sampler(10)
    assert list(sampler) == [1, 3, 5, 7, 9]
    assert sampler.get_indices(1, 2) == [5, 7] and sampler.get_indices(2, 2) == [9]
    # a loader's index tensor: recorded as ints, so the samples are not dealt again
    sampler.record_indices(torch.tensor([1, 3]))
    sampler.record_indices({np.int64(5)})
    assert sampler.processed_indices == {1, 3, 5}
    assert all(type(i) is int for i in sampler.processed_indices)
    sampler.reset()
    assert sorted(sampler.remaining_indices) == [0, 2, 4, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="index 10 is outside the dataset"):
        sampler.record_indices([10])
    with pytest.raises(TypeError, match="must be an integer, got float 2.5"):
        sampler.record_indices([2.5])
    with pytest.raises(TypeError, match="iterable of dataset indices"):
        sampler.record_indices(4)
    assert sampler.processed_indices == {1, 3, 5}


def test_set_epoch_and_load_state_dict_reject_bad_values_naming_them(monkeypatch):
    _fake_job(monkeypatch, 1, 0)
    sampler = _sampler(6)
    with pytest.raises(TypeError, match="set_epoch: epoch must be an integer, got str '1'"):
        sampler.set_epoch("1")
    with pytest.raises(TypeError, match="set_epoch: epoch must be an integer"):
        sampler.set_epoch(1.5)
    with pytest.raises(ValueError, match="expects a dict with 'epoch' and 'processed_indices'"):
        sampler.load_state_dict({})
    with pytest.raises(ValueError, match="expects a dict"):
        sampler.load_state_dict([1, 2])
    with pytest.raises(TypeError, match="each of 'processed_indices' must be an integer"):
        sampler.load_state_dict({"epoch": 0, "processed_indices": ["a"]})
    with pytest.raises(TypeError, match="'processed_indices' must be an iterable"):
        sampler.load_state_dict({"epoch": 0, "processed_indices": 3})
    # nothing half-loaded
    assert sampler.state_dict() == {"epoch": 0, "processed_indices": [], "processed_num": 0}
    assert len(sampler) == 6
    with pytest.raises(TypeError, match="'processed_num' must be an integer"):
        sampler.load_state_dict({"epoch": 0, "processed_num": "2"})
    with pytest.raises(ValueError, match="'processed_num' must be >= 0"):
        sampler.load_state_dict({"epoch": 0, "processed_num": -1})


def test_state_dict_round_trips_including_horovods_sets(monkeypatch):
    _fake_job(monkeypatch, 2, 0)
    first = _sampler(12, shuffle=True, seed=7)
    first.set_epoch(3)
    first.record_batch(0, 2)
    saved = first.state_dict()
    first.reset()  # what a re-form would deal: the rest of the epoch
    assert len(first) == 4
    second = _sampler(12, shuffle=True, seed=7)
    second.load_state_dict(saved)
    assert list(second) == list(first) and second.state_dict() == saved
    # Horovod's state_dict holds a set; numpy integers from a checkpoint
    third = _sampler(12, shuffle=True, seed=7)
    third.load_state_dict({"epoch": np.int64(3),
                           "processed_indices": set(map(np.int64, saved["processed_indices"]))})
    assert third.state_dict() == saved and list(third) == list(first)


def test_horovods_processed_num_counts_and_its_state_dicts_load(monkeypatch):
    # Horovod >= 0.24 counts processed samples (processed_num) and saves
    # {'epoch', 'processed_num'}: the first processed_num samples of the epoch's order.
    _fake_job(monkeypatch, 2, 1)
    sampler = _sampler(12, shuffle=True, seed=7)
    sampler.set_epoch(2)
    assert sampler.processed_num == 0
    sampler.record_batch(0, 2)
    sampler.record_batch(1, 2)
    assert sampler.processed_num == 8  # 2 batches of 2 on each of 2 ranks
    assert sampler.state_dict()["processed_num"] == 8
    order = sampler._order()
    other = _sampler(12, shuffle=True, seed=7)
    other.load_state_dict({"epoch": 2, "processed_num": 4})
    assert other.epoch == 2 and other.processed_indices == set(order[:4])
    assert len(other) == 4 and sorted(other.remaining_indices) == sorted(order[4:])
    other.processed_num = 6  # Horovod scripts assign it too
    assert other.processed_indices == set(order[:6])


def test_a_sampler_built_before_init_deals_for_the_job_once_initialized(monkeypatch):
    from hvdlike.core import api

    monkeypatch.setattr(api, "is_initialized", lambda: False)
    sampler = _sampler(10)
    assert len(sampler) == 10  # one rank: the whole data set
    _fake_job(monkeypatch, 2, 1)
    assert len(sampler) == 5 and list(sampler) == [1, 3, 5, 7, 9]


def test_a_dataset_without_a_length_or_a_seed_that_is_no_integer_is_a_clear_error():
    from hvdlike.torch.elastic import ElasticSampler

    with pytest.raises(TypeError, match="needs a dataset with a length"):
        ElasticSampler(iter(range(4)))
    with pytest.raises(TypeError, match="ElasticSampler seed must be an integer, got str '1'"):
        ElasticSampler(range(4), seed="1")


def test_syncing_samplers_that_disagree_on_the_dataset_is_refused(monkeypatch):
    import hvdlike.torch.elastic.state as torch_state

    _fake_job(monkeypatch, 2, 0)
    sampler = _sampler(10, shuffle=True, seed=1)
    state = torch_state.TorchState(sampler=sampler, epoch=0)

    def other_rank_has(**changes):
        def allgather(mine):
            return [mine, dict(mine, **changes)]
        monkeypatch.setattr(torch_state, "allgather_object", allgather)

    handler = state._handlers["sampler"]
    other_rank_has(length=12)
    with pytest.raises(ValueError, match=r"disagree on len\(dataset\): rank 0: 10, rank 1: 12"):
        handler.sync()
    other_rank_has(seed=2)
    with pytest.raises(ValueError, match="disagree on seed: rank 0: 1, rank 1: 2"):
        handler.sync()
    other_rank_has(shuffle=False)
    with pytest.raises(ValueError, match="disagree on shuffle: rank 0: True, rank 1: False"):
        handler.sync()
    other_rank_has(processed_indices=[4, 5])  # agreeing ranks: the union, as before
    handler.sync()
    assert sampler.processed_indices == {4, 5}
    sampler.shuffle = False  # no permutation drawn: seeds may differ
    other_rank_has(seed=9, shuffle=False)
    handler.sync()
    assert sampler.processed_indices == {4, 5}


# -- state objects -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["commit", "save", "restore", "sync", "reset", "on_reset",
                                  "check_host_updates", "register_reset_callbacks", "_saved"])
def test_a_state_attribute_named_like_a_method_is_refused(name):
    from hvdlike.torch.elastic import TorchState

    with pytest.raises(ValueError, match=f"cannot keep state under the name.*'{name}'"):
        _object_state(**{name: 1})
    with pytest.raises(ValueError, match=f"TorchState: cannot keep state under .*'{name}'"):
        TorchState(model=torch.nn.Linear(1, 1), **{name: torch.nn.Linear(1, 1)})


def test_torch_state_takes_attributes_named_like_object_states_arguments():
    from hvdlike.torch.elastic import TorchState

    state = TorchState(get_rank=3, bcast_object="b", allgather_object=[1])
    state.get_rank = 4
    state.restore()
    assert (state.get_rank, state.bcast_object, state.allgather_object) == (3, "b", [1])


def test_an_attribute_that_cannot_be_copied_is_named():
    from hvdlike.torch.elastic import TorchState

    with pytest.raises(TypeError, match="TorchState attribute 'lock': a lock cannot be copied"):
        TorchState(model=torch.nn.Linear(1, 1), lock=threading.Lock())
    state = TorchState(epoch=0)
    x = torch.ones(2, requires_grad=True)
    state.loss = torch.zeros(())
    state.loss = x.sum() * 2  # part of an autograd graph
    state.commit()  # added later and not copyable: stays outside the state (a warning)
    assert "loss" not in state._saved
    state.loss = state.loss.detach()
    state.commit()  # a detached tensor is fine: it joins the state now
    state.loss = torch.ones(())
    state.restore()
    assert float(state.loss) == 4.0
    state.loss = x.sum()  # tracked now: a value that cannot be copied is named
    with pytest.raises(TypeError, match="TorchState attribute 'loss': a Tensor cannot be copied"):
        state.commit()


def test_an_attribute_added_later_joins_the_state_at_the_next_commit():
    state = _object_state(epoch=0)
    state.steps = 3
    state.steps = 4
    state.restore()  # never committed: left alone, as Horovod leaves it
    assert (state.epoch, state.steps) == (0, 4)
    state.commit()
    state.steps = 9
    state.restore()
    assert state.steps == 4
    with open(__file__) as handle:
        state.handle = handle
        state.commit()  # cannot be copied: outside the state, and nothing fails
    assert "handle" not in state._saved and state.steps == 4


def test_attributes_sharing_an_object_still_share_it_after_restore():
    shared = [1]
    state = _object_state(a=shared, b=shared)
    state.commit()
    state.restore()
    assert state.a is state.b


def test_modules_optimizers_and_samplers_given_after_construction_are_restored_in_place(
        monkeypatch):
    from hvdlike.torch.elastic import TorchState

    _fake_job(monkeypatch, 1, 0)
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sampler = _sampler(8)
    state = TorchState(epoch=0)
    state.model, state.optimizer, state.sampler = model, optimizer, sampler
    state.commit()
    committed = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    sampler.record_batch(0, 4)
    state.restore()
    # the objects the training loop (optimizer, data loader) holds are the ones restored
    assert state.model is model and state.optimizer is optimizer and state.sampler is sampler
    assert all(torch.equal(a, b) for a, b in zip(committed, model.parameters()))
    assert optimizer.state_dict()["state"] == {} and sampler.processed_indices == set()
    assert optimizer.param_groups[0]["params"][0] is model.weight
    assert not {"model", "optimizer", "sampler"} & set(state._saved)
    # a framework object replaced by a plain value becomes a plain attribute
    state.sampler = None
    state.commit()
    state.sampler = "x"
    state.restore()
    assert state.sampler is None


# -- the retry loop ----------------------------------------------------------------------


def test_run_with_something_else_than_a_state_names_the_mistake():
    def train(state):
        pytest.fail("called")

    wrapped = run_fn(train, reset=lambda: pytest.fail("re-formed"), is_elastic=lambda: True)
    with pytest.raises(TypeError, match=r"first argument of .*train\(\) must be the elastic "
                                        r"state .* got dict \(it has no sync, restore, on_reset"):
        wrapped({"epoch": 0})


def test_a_deadlock_is_not_retried():
    # Every rank is alive and waits on the others: no new generation will come, a
    # re-form would only wait for one until the elastic timeout.
    state = _object_state(step=0)

    def train(state):
        raise DeadlockError("every rank waits on the others")

    wrapped = run_fn(train, reset=lambda: pytest.fail("re-formed"), is_elastic=lambda: True)
    with pytest.raises(DeadlockError):
        wrapped(state)


def test_reset_callbacks_are_checked_when_registered():
    state = _object_state(step=0)
    with pytest.raises(TypeError, match="takes a list of callables, got int"):
        state.register_reset_callbacks(5)
    with pytest.raises(TypeError, match="'lr' \\(str\\) is not callable"):
        state.register_reset_callbacks([print, "lr"])
    assert state._reset_callbacks == []
    calls = []
    state.register_reset_callbacks(lambda: calls.append(1))  # one callable, not in a list
    state.on_reset()
    assert calls == [1]


def test_a_reset_callback_failing_on_a_lost_peer_is_retried_and_a_user_error_propagates():
    state = _object_state(step=0)
    events, failures = [], [HorovodInternalError("peer lost while re-forming")]
    lost = [HorovodInternalError("peer lost")]

    def callback():
        events.append("callback")
        if failures:
            raise failures.pop()

    def train(state):
        events.append(("train", state.step))
        state.step += 1
        if lost:
            raise lost.pop()
        return state.step

    state.register_reset_callbacks([callback])
    wrapped = run_fn(train, reset=lambda: events.append("reform"), is_elastic=lambda: True)
    assert wrapped(state) == 1
    assert events == [("train", 0), "reform", "callback", "reform", "callback", ("train", 0)]

    state = _object_state(step=0)
    lost.append(HorovodInternalError("peer lost"))
    state.register_reset_callbacks([lambda: 1 / 0])
    with pytest.raises(ZeroDivisionError):
        run_fn(train, reset=lambda: None, is_elastic=lambda: True)(state)
