"""TorchState's handlers: Horovod's StateHandler interface and registry, and
learning-rate schedulers kept bound to the optimizer the loop trains with."""

import pytest
import torch

import hvdlike.torch as hvd
from hvdlike.torch.elastic import TorchState
from hvdlike.torch.elastic import state as state_mod


@pytest.fixture(scope="module", autouse=True)
def one_rank_job():
    # sync() broadcasts rank 0's state on every rank, whatever it holds.
    hvd.init()
    yield
    hvd.shutdown()


def _model_and_scheduler():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def test_a_restored_scheduler_still_drives_the_training_optimizer():
    model, opt, sched = _model_and_scheduler()
    state = TorchState(model=model, optimizer=opt, scheduler=sched)
    opt.step()
    sched.step()
    state.commit()  # lr 0.5, last_epoch 1
    opt.step()
    sched.step()  # lr 0.25: not committed
    state.restore()
    assert state.scheduler is sched and sched.optimizer is opt
    assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == 0.5
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.25  # the real optimizer follows the schedule


def test_plateau_schedulers_are_handled_too():
    model, opt, _ = _model_and_scheduler()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
    state = TorchState(model=model, optimizer=opt, plateau=plateau)
    plateau.step(1.0)
    state.commit()
    plateau.step(2.0)
    plateau.step(3.0)  # worse twice: the rate drops
    dropped = opt.param_groups[0]["lr"]
    state.restore()
    assert state.plateau is plateau and plateau.num_bad_epochs == 0 and dropped < 1.0


class Counter:
    def __init__(self):
        self.n = 0


class CounterHandler(state_mod.StateHandler):
    """Written as for Horovod: the base's __init__ only keeps the value."""

    calls = []

    def __init__(self, value):
        super().__init__(value)
        self.saved = value.n

    def save(self):
        self.calls.append("save")
        self.saved = self.value.n

    def restore(self):
        self.calls.append("restore")
        self.value.n = self.saved

    def sync(self):
        self.calls.append("sync")


def test_a_registered_handler_keeps_its_objects(monkeypatch):
    registry = state_mod.get_handler_registry()
    monkeypatch.setattr(state_mod, "_handler_registry", list(registry))
    state_mod.set_handler_registry([(Counter, CounterHandler)] + registry)
    counter = Counter()
    state = TorchState(counter=counter)
    counter.n = 5
    state.commit()
    counter.n = 9
    state.restore()
    assert state.counter is counter and counter.n == 5
    state.sync()
    assert "sync" in CounterHandler.calls
    replacement = Counter()
    replacement.n = 7
    state.counter = replacement  # a new object takes the old one's place
    state.restore()
    assert state.counter is replacement and replacement.n == 7


@pytest.mark.parametrize("entry", [
    (Counter, object), (Counter(), CounterHandler), "x", (Counter,), (Counter, CounterHandler, 1),
])
def test_the_registry_takes_type_and_handler_pairs_only(entry):
    with pytest.raises(TypeError, match="entry 0 must be a"):
        state_mod.set_handler_registry([entry])


def test_horovods_handler_names_are_there():
    for name in ("StateHandler", "ModelStateHandler", "OptimizerStateHandler",
                 "SamplerStateHandler", "get_handler_registry", "set_handler_registry"):
        assert hasattr(state_mod, name), name
    kinds = [kind for kind, _ in state_mod.get_handler_registry()]
    assert torch.nn.Module in kinds and torch.optim.Optimizer in kinds
