"""hvdlike.keras.elastic: Horovod's elastic API for Keras 3 (torch or JAX backend).

    import hvdlike.keras as hvd

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, batches):
                model.train_on_batch(*batch_of(state.epoch, state.batch))
                state.commit()
            state.batch = 0

    state = hvd.elastic.KerasState(model, optimizer, epoch=0, batch=0)
    train(state)

The retry loop and re-rendezvous are the core's (:mod:`hvdlike.core.elastic`),
shared with every other front end. :class:`KerasState` keeps the model's
weights and the optimizer's variables (its iteration count and slots) in host
memory at every commit, puts them back on ``restore()`` and broadcasts rank 0's
on ``sync()``; other keyword arguments are plain attributes, as in
:class:`ObjectState`.
"""

from __future__ import annotations

from typing import Any, List

from hvdlike.core import api
from hvdlike.core.elastic import HorovodInternalError, HostsUpdatedInterrupt, State, run
from hvdlike.core.elastic import ObjectState as _ObjectState
from hvdlike.core.elastic.state import use_allreduce
from hvdlike.core.errors import HvdlikeError
from hvdlike.frontend.objects import allgather_object, broadcast_object


class ObjectState(_ObjectState):
    """Elastic state of picklable values (keyword arguments become attributes)."""

    def __init__(self, bcast_object=None, get_rank=api.rank, **kwargs):
        super().__init__(bcast_object or broadcast_object, get_rank, allgather_object, **kwargs)
        use_allreduce(self)


class KerasState(ObjectState):
    """Elastic state of a Keras model and its optimizer, plus plain attributes.

    Args:
        model: a built ``keras.Model``.
        optimizer: its optimizer (default ``model.optimizer``); None for none.
        **kwargs: further attributes (epoch, batch, ...), as in :class:`ObjectState`.

    Raises:
        TypeError: ``model`` has no weights to keep (not a Keras model).
    """

    def __init__(self, model, optimizer=None, **kwargs: Any):
        if not hasattr(model, "weights"):
            raise TypeError(f"KerasState: model must be a keras.Model, got "
                            f"{type(model).__name__}")
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_optimizer",
                           optimizer if optimizer is not None else getattr(model, "optimizer", None))
        super().__init__(**kwargs)
        object.__setattr__(self, "_saved_variables", self._read())

    @property
    def model(self):
        return self._model

    @property
    def optimizer(self):
        return self._optimizer

    def _optimizer_variables(self) -> List:
        opt = self._optimizer
        return list(opt.variables) if opt is not None and getattr(opt, "built", False) else []

    def _read(self):
        """``(model weights, optimizer variables)`` as numpy arrays."""
        from keras import ops

        return ([ops.convert_to_numpy(v) for v in self._model.weights],
                [ops.convert_to_numpy(v) for v in self._optimizer_variables()])

    def _write(self, saved) -> None:
        weights, slots = saved
        if slots and not self._optimizer_variables() and self._optimizer is not None:
            # A rank that never stepped (a new process) builds its slots to receive them.
            self._optimizer.build(self._model.trainable_variables)
        targets = (list(self._model.weights), self._optimizer_variables())
        for what, variables, values in (("model weights", targets[0], weights),
                                        ("optimizer variables", targets[1], slots)):
            if len(variables) != len(values):
                raise HvdlikeError(f"KerasState: this rank has {len(variables)} {what}, the "
                                   f"state to load has {len(values)} (not the same model or "
                                   f"optimizer on every rank?)")
            for variable, value in zip(variables, values):
                variable.assign(value)

    def save(self) -> None:
        object.__setattr__(self, "_saved_variables", self._read())
        super().save()

    def restore(self) -> None:
        self._write(self._saved_variables)
        super().restore()

    def sync(self) -> None:
        synced = self._bcast_object(self._read())
        self._write(synced)
        object.__setattr__(self, "_saved_variables", synced)
        super().sync()


def _keras_callback_base():
    import keras

    return keras.callbacks.Callback


class CommitStateCallback(_keras_callback_base()):
    """Commit ``state`` every ``batches_per_commit`` batches and at every epoch's end.

    For ``model.fit`` inside an ``hvd.elastic.run`` function: a failure rolls
    back at most ``batches_per_commit`` batches. The count starts again at
    every ``fit`` (after a reset every rank counts from the same point). On
    the JAX backend ``fit`` keeps the weights outside the Keras variables
    during an epoch; they are synced back first so the commit saves them.

    Args:
        state: the :class:`KerasState` to commit.
        batches_per_commit: batches between commits (an int >= 1).
    """

    def __init__(self, state, batches_per_commit: int = 1):
        super().__init__()
        if (isinstance(batches_per_commit, bool) or not isinstance(batches_per_commit, int)
                or batches_per_commit < 1):
            raise ValueError(f"CommitStateCallback: batches_per_commit must be an int >= 1, "
                             f"got {batches_per_commit!r}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        from .callbacks import _raise_hvdlike_errors

        _raise_hvdlike_errors(self.model)
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.commit()

    def commit(self) -> None:
        from .callbacks import _sync_jax_state

        model = getattr(self.state, "model", None)
        if model is not None:
            _sync_jax_state(model)
        self.state.commit()


class UpdateBatchStateCallback(_keras_callback_base()):
    """Keep ``state.batch`` at the index of the last finished batch; 0 after each epoch.

    Unlike Horovod's, it cannot shorten the epoch resumed after a reset:
    Keras 3 does not read the step count back from the callbacks' ``params``,
    so that epoch runs all its batches.
    """

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(_keras_callback_base()):
    """Count finished epochs in ``state.epoch``, across resets.

    Keras numbers a ``fit`` call's epochs from ``initial_epoch`` (0 unless
    given), so ``state.epoch`` becomes the value it had when ``fit`` began
    plus the epochs finished since: call ``fit(epochs=epochs - state.epoch)``
    after a reset, as with Horovod, not ``initial_epoch=state.epoch``.
    """

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1


__all__ = ["CommitStateCallback", "HorovodInternalError", "HostsUpdatedInterrupt",
           "KerasState", "ObjectState", "State", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run"]
