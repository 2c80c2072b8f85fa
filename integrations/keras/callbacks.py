"""Keras callbacks with Horovod's semantics.

* :class:`BroadcastGlobalVariablesCallback`: every rank starts training from
  ``root_rank``'s model and optimizer state.
* :class:`MetricAverageCallback`: the epoch's logged metrics become averages
  over all ranks (put it before callbacks that read metrics, e.g.
  ``ReduceLROnPlateau`` or checkpointing on ``val_loss``).
* :class:`LearningRateWarmupCallback`: ramp the learning rate from
  ``initial_lr / size`` to ``initial_lr`` over the first epochs (Goyal et al.,
  "Accurate, Large Minibatch SGD"), with momentum correction.

On the JAX backend ``model.fit`` keeps the training state outside the Keras
variables while an epoch runs; callbacks that write variables mid-epoch first
sync that state back (``model.jax_state_sync()``), which also makes the
trainer reload it before the next step.
"""

from __future__ import annotations

import math
import numbers

import keras
import numpy as np

from hvdlike.core import api
from hvdlike.core.process_sets import global_process_set

from .backend import backend_name, broadcast_variables


def _sync_jax_state(model) -> None:
    if backend_name() == "jax" and hasattr(model, "jax_state_sync"):
        model.jax_state_sync()


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast model and optimizer variables from ``root_rank`` when training starts.

    Keras 3 builds the optimizer before the first step, so the broadcast
    happens once, in ``on_train_begin``: every step, the first included, runs
    on identical weights and optimizer state on every rank. Later ``fit``
    calls on the same callback do not broadcast again.

    Args:
        root_rank: rank whose variables everybody receives.
        process_set: ranks taking part.
    """

    def __init__(self, root_rank: int = 0, process_set=global_process_set):
        super().__init__()
        if isinstance(root_rank, bool) or not isinstance(root_rank, numbers.Integral):
            raise TypeError(f"BroadcastGlobalVariablesCallback: root_rank must be an int, got "
                            f"{type(root_rank).__name__}")
        self.root_rank = int(root_rank)
        self.process_set = process_set
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        model = self.model
        optimizer = getattr(model, "optimizer", None)
        variables = list(model.variables)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(model.trainable_variables)
            variables += list(optimizer.variables)
        _sync_jax_state(model)
        broadcast_variables(variables, self.root_rank, name="keras.broadcast_global_variables",
                            process_set=self.process_set)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each numeric entry of the epoch logs by its average over all ranks.

    Every rank must log the same metric names (they do when they run the same
    model). All values travel in one grouped allreduce.
    """

    def __init__(self, process_set=global_process_set):
        super().__init__()
        self.process_set = process_set

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        import hvdlike.numpy as hnp

        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and _is_number(v))
        if not keys:
            return
        values = [np.asarray(float(logs[k]), dtype=np.float64) for k in keys]
        averaged = hnp.grouped_allreduce(values, name="keras.metric_average", op=hnp.Average,
                                         process_set=self.process_set)
        for key, value in zip(keys, averaged):
            logs[key] = float(value)


def _is_number(value) -> bool:
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False


def _check_number(what: str, value, positive: bool) -> None:
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or value < 0 or (positive and value == 0)):
        kind = "> 0" if positive else ">= 0"
        raise ValueError(f"LearningRateWarmupCallback: {what} must be a finite number {kind}, "
                         f"got {value!r}")


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Linear learning-rate warmup from ``initial_lr / size`` to ``initial_lr``.

    During the first ``warmup_epochs`` epochs, at the start of every batch,
    the learning rate is set to::

        initial_lr / size * (e * (size - 1) / warmup_epochs + 1)

    where ``e = epoch + (batch + 1) / steps_per_epoch`` is the fractional
    epoch reached at the end of the batch, so the last warmup batch runs at
    exactly ``initial_lr`` (and the rate stays there afterwards). With
    ``momentum_correction``, an optimizer's ``momentum`` is scaled by
    ``new_lr / old_lr`` for the batch in which the rate changes and restored
    after it. (On the JAX backend the jitted step captures ``momentum`` as a
    constant, so the correction only applies when the model runs eagerly.)

    Args:
        initial_lr: the learning rate after warmup (usually already scaled by
            ``size()``).
        warmup_epochs: length of the warmup, in epochs.
        momentum_correction: apply the momentum correction described above.
        steps_per_epoch: batches per epoch; defaults to what ``fit`` reports.
        verbose: print a line when warmup ends (rank 0 only).
    """

    def __init__(self, initial_lr: float, warmup_epochs: float = 5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        super().__init__()
        _check_number("initial_lr", initial_lr, positive=False)
        _check_number("warmup_epochs", warmup_epochs, positive=True)
        if steps_per_epoch is not None and (isinstance(steps_per_epoch, bool) or not isinstance(
                steps_per_epoch, numbers.Integral) or steps_per_epoch < 1):
            raise ValueError(f"LearningRateWarmupCallback: steps_per_epoch must be None or an "
                             f"int >= 1, got {steps_per_epoch!r}")
        self.initial_lr = float(initial_lr)
        self.warmup_epochs = warmup_epochs
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = 0
        self._restore_momentum = None

    def multiplier(self, epoch: float) -> float:
        size = api.size()
        return 1.0 / size * (epoch * (size - 1) / self.warmup_epochs + 1)

    def _steps(self) -> int:
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise ValueError("LearningRateWarmupCallback needs steps_per_epoch: fit() did not "
                             "report the number of steps (pass steps_per_epoch=...)")
        return int(steps)

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.current_epoch + float(batch) / self._steps() >= self.warmup_epochs:
            return
        epoch = self.current_epoch + float(batch + 1) / self._steps()
        optimizer = self.model.optimizer
        _sync_jax_state(self.model)
        old_lr = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        momentum = getattr(optimizer, "momentum", None)
        if (self.momentum_correction and isinstance(momentum, float) and momentum
                and old_lr > 0 and new_lr != old_lr):
            self._restore_momentum = momentum
            optimizer.momentum = momentum * new_lr / old_lr

    def on_train_batch_end(self, batch, logs=None):
        if self._restore_momentum is not None:
            self.model.optimizer.momentum = self._restore_momentum
            self._restore_momentum = None

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            _sync_jax_state(self.model)
            logs["learning_rate"] = float(
                keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        if epoch + 1 == self.warmup_epochs and self.verbose and api.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{self.initial_lr:g}.")
