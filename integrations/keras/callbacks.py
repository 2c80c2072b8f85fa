"""Keras callbacks with Horovod's semantics.

* :class:`BroadcastGlobalVariablesCallback`: every rank starts training from
  ``root_rank``'s model and optimizer state.
* :class:`MetricAverageCallback`: the epoch's logged metrics become averages
  over all ranks (put it before callbacks that read metrics, e.g.
  ``ReduceLROnPlateau`` or checkpointing on ``val_loss``).
* :class:`LearningRateWarmupCallback`: ramp the learning rate from
  ``initial_lr / size`` to ``initial_lr`` over the first epochs (Goyal et al.,
  "Accurate, Large Minibatch SGD"), with momentum correction.
* :class:`LearningRateScheduleCallback`: ``initial_lr * multiplier(epoch)``
  between ``start_epoch`` and ``end_epoch``, per epoch or per batch.
* :class:`BestModelCheckpoint`: ``ModelCheckpoint`` keeping only the best model.

Every callback takes Horovod's positional arguments (``device`` is accepted
and ignored: hvdlike communicates from host memory) and ``process_set`` as a
keyword only.

On the JAX backend every callback here also makes ``model.fit`` raise
hvdlike's exceptions rather than ``JaxRuntimeError`` when a collective in the
jitted train step fails. ``model.fit`` keeps the training state outside the Keras
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
from .errors import original_errors


def _sync_jax_state(model) -> None:
    if backend_name() == "jax" and hasattr(model, "jax_state_sync"):
        model.jax_state_sync()


def _raise_hvdlike_errors(model) -> None:
    """Make ``model.fit``'s jitted train step raise hvdlike's exceptions (JAX backend).

    The gradient allreduce runs inside the step, so a failing collective would
    reach the caller of ``fit`` as a ``JaxRuntimeError``. Keras builds the
    step before ``on_train_begin``; wrapping it in ``original_errors`` there
    hands back the hvdlike exception (``MismatchError``,
    ``HorovodInternalError``...) instead. A step Keras rebuilds later is
    wrapped again at the next ``fit``.
    """
    if backend_name() != "jax":
        return
    step = getattr(model, "train_function", None)
    if step is None or getattr(step, "_hvd_original_errors", False):
        return
    wrapped = original_errors()(step)
    wrapped._hvd_original_errors = True
    model.train_function = wrapped


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast model and optimizer variables from ``root_rank`` when training starts.

    Keras 3 builds the optimizer before the first step, so the broadcast
    happens once, in ``on_train_begin``: every step, the first included, runs
    on identical weights and optimizer state on every rank. Later ``fit``
    calls on the same callback do not broadcast again.

    Args:
        root_rank: rank whose variables everybody receives.
        device: accepted for compatibility; ignored.
        local_variables: a variable or list of variables each rank keeps as
            its own (not broadcast).
        process_set: ranks taking part (keyword only).
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables=None, *,
                 process_set=global_process_set):
        super().__init__()
        if isinstance(root_rank, bool) or not isinstance(root_rank, numbers.Integral):
            raise TypeError(f"BroadcastGlobalVariablesCallback: root_rank must be an int, got "
                            f"{type(root_rank).__name__}")
        self.root_rank = int(root_rank)
        self.device = device
        self.local_variables = _variable_list(local_variables)
        self.process_set = process_set
        self.broadcast_done = False

    def register_local_var(self, var) -> None:
        """Keep ``var`` out of the broadcast: each rank keeps its own value (Horovod's method)."""
        for v in _variable_list(var):
            if not any(v is known for known in self.local_variables):
                self.local_variables.append(v)

    def on_train_begin(self, logs=None):
        _raise_hvdlike_errors(self.model)
        if self.broadcast_done:
            return
        model = self.model
        optimizer = getattr(model, "optimizer", None)
        variables = list(model.variables)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(model.trainable_variables)
            variables += list(optimizer.variables)
        local = {id(v) for v in self.local_variables}
        variables = [v for v in variables if id(v) not in local]
        _sync_jax_state(model)
        broadcast_variables(variables, self.root_rank, name="keras.broadcast_global_variables",
                            process_set=self.process_set)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each numeric entry of the epoch logs by its average over all ranks.

    Every rank must log the same metric names (they do when they run the same
    model). All values travel in one grouped allreduce.

    Args:
        device: accepted for compatibility; ignored.
        process_set: ranks to average over (keyword only).
    """

    def __init__(self, device: str = "", *, process_set=global_process_set):
        super().__init__()
        self.device = device
        self.process_set = process_set

    def on_train_begin(self, logs=None):
        _raise_hvdlike_errors(self.model)

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


def _variable_list(variables) -> list:
    if variables is None:
        return []
    if isinstance(variables, keras.Variable):
        return [variables]
    variables = list(variables)
    for v in variables:
        if not isinstance(v, keras.Variable):
            raise ValueError(f"BroadcastGlobalVariablesCallback: local_variables must be "
                             f"keras.Variable objects, got {type(v).__name__}")
    return variables


def _is_number(value) -> bool:
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False


def _check_number(what: str, value, positive: bool,
                  owner: str = "LearningRateWarmupCallback") -> None:
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or value < 0 or (positive and value == 0)):
        kind = "> 0" if positive else ">= 0"
        raise ValueError(f"{owner}: {what} must be a finite number {kind}, got {value!r}")


def _check_steps(steps, owner: str) -> None:
    if steps is not None and (isinstance(steps, bool) or not isinstance(
            steps, numbers.Integral) or steps < 1):
        raise ValueError(f"{owner}: steps_per_epoch must be None or an int >= 1, got {steps!r}")


def _read_lr(optimizer) -> float:
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


class _RateCallback(keras.callbacks.Callback):
    """What the learning-rate callbacks share: setting the rate with Horovod's
    momentum correction, undoing the correction after the batch, logging the rate."""

    momentum_correction = True
    _restore_momentum = None

    def on_train_begin(self, logs=None):
        _raise_hvdlike_errors(self.model)

    def _set_learning_rate(self, new_lr: float, only_on_change: bool = False) -> None:
        optimizer = self.model.optimizer
        _sync_jax_state(self.model)
        old_lr = _read_lr(optimizer)
        optimizer.learning_rate = new_lr
        momentum = getattr(optimizer, "momentum", None)
        if (self.momentum_correction and isinstance(momentum, float) and momentum
                and old_lr > 0 and not (only_on_change and new_lr == old_lr)):
            self._restore_momentum = momentum
            optimizer.momentum = momentum * new_lr / old_lr

    def on_train_batch_end(self, batch, logs=None):
        if self._restore_momentum is not None:
            self.model.optimizer.momentum = self._restore_momentum
            self._restore_momentum = None

    def _log_rate(self, logs) -> None:
        if logs is not None:
            _sync_jax_state(self.model)
            logs["learning_rate"] = _read_lr(self.model.optimizer)


class LearningRateWarmupCallback(_RateCallback):
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
        _check_steps(steps_per_epoch, "LearningRateWarmupCallback")
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
        self._set_learning_rate(self.initial_lr * self.multiplier(epoch), only_on_change=True)

    def on_epoch_end(self, epoch, logs=None):
        self._log_rate(logs)
        if epoch + 1 == self.warmup_epochs and self.verbose and api.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{self.initial_lr:g}.")


class LearningRateScheduleCallback(_RateCallback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` on.

    ``multiplier`` is a number ``m`` (meaning ``m ** (epoch - start_epoch)``,
    an exponential decay) or a function of the epoch. With ``staircase``
    (default) the rate changes at the first batch of each epoch in
    ``[start_epoch, end_epoch)``, and the function gets the integer epoch;
    without it, the rate changes at every batch and the function gets the
    fractional epoch ``epoch + batch / steps_per_epoch``. With
    ``momentum_correction``, an optimizer's ``momentum`` is scaled by
    ``new_lr / old_lr`` for each batch in which the rate is set and restored
    after it (the jitted JAX step captures momentum as a constant, so there
    it only applies when the model runs eagerly). The epoch logs get the
    current ``learning_rate``.

    Args:
        initial_lr: the rate the multiplier scales (required).
        multiplier: a number or a function ``f(epoch) -> factor``.
        start_epoch: first epoch adjusted.
        end_epoch: first epoch no longer adjusted (None: never stop).
        staircase: adjust once per epoch rather than every batch.
        momentum_correction: apply the momentum correction described above.
        steps_per_epoch: batches per epoch; defaults to what ``fit`` reports.
    """

    NAME = "LearningRateScheduleCallback"

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError(f"{self.NAME}: initial_lr is required")
        _check_number("initial_lr", initial_lr, positive=False, owner=self.NAME)
        _check_number("start_epoch", start_epoch, positive=False, owner=self.NAME)
        if end_epoch is not None:
            _check_number("end_epoch", end_epoch, positive=False, owner=self.NAME)
        _check_steps(steps_per_epoch, self.NAME)
        self.initial_lr = float(initial_lr)
        self.multiplier = _as_function(multiplier, start_epoch, self.NAME)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        self._restore_momentum = None

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = (self.params or {}).get("steps")
            if not self.steps_per_epoch:
                raise ValueError(f"{self.NAME} needs steps_per_epoch: fit() did not report the "
                                 f"number of steps (pass steps_per_epoch=...)")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def _in_range(self) -> bool:
        return self.current_epoch >= self.start_epoch and (
            self.end_epoch is None or self.current_epoch < self.end_epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if not self._in_range():
            return
        if self.staircase:
            if batch == 0:
                self._set_rate(self.current_epoch)
        else:
            self._set_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def _set_rate(self, epoch) -> None:
        self._set_learning_rate(self.initial_lr * self.multiplier(epoch))

    def on_epoch_end(self, epoch, logs=None):
        self._log_rate(logs)


def _as_function(multiplier, start_epoch, owner: str):
    if callable(multiplier):
        return multiplier
    if isinstance(multiplier, bool) or not isinstance(multiplier, numbers.Real):
        raise TypeError(f"{owner}: multiplier must be a number or a function of the epoch, "
                        f"got {type(multiplier).__name__}")
    factor = float(multiplier)
    return lambda epoch: factor ** (epoch - start_epoch)


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """``ModelCheckpoint`` with ``save_best_only=True``: keep the best model seen.

    Horovod's takes no path (its Spark estimator sets ``filepath`` later); so
    does this one, and ``filepath`` may also be given as a keyword. Training
    with no path set raises ``ValueError``. Keras 3 wants a path ending in
    ``.keras`` (or ``.weights.h5`` with ``save_weights_only``).
    """

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto",
                 save_freq="epoch", *, filepath=None):
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=filepath or placeholder, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only, mode=mode,
                         save_freq=save_freq)
        if filepath is None:
            self.filepath = None

    def on_train_begin(self, logs=None):
        if not self.filepath:
            raise ValueError("BestModelCheckpoint: no filepath; set callback.filepath (or pass "
                             "filepath=...) before training")
        super().on_train_begin(logs)
