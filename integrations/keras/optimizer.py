"""DistributedOptimizer for Keras 3: average gradients across ranks, then apply.

Keras funnels every update through ``optimizer.apply(grads, variables)``:
``model.fit`` calls it directly on the torch backend and through
``stateless_apply`` inside the jitted step on the JAX backend. Both reach
``_clip_gradients`` exactly once per real update -- after empty gradients
are dropped, the loss scale is undone and Keras's own gradient accumulation
has summed its micro-batches, and before clipping, weight decay and the
update itself. The wrapper overrides that hook in a subclass of the user's
optimizer class, so both paths reduce the gradients there, in one grouped
allreduce, and clipping sees the averaged gradient as it does under Horovod.

Mixed precision needs care: a ``LossScaleOptimizer`` skips the step when a
gradient is not finite, and it decides before its inner optimizer runs. If
each rank decided on its own gradients, a rank that overflowed would skip a
step the others took, and from then on the ranks would average gradients of
different steps. So a loss-scaled optimizer returned here agrees on
finiteness across ranks first (one tiny Min allreduce), and a
``LossScaleOptimizer`` wrapped around hvdlike's optimizer from outside is
refused when it is built.
"""

from __future__ import annotations

import math
import numbers
import sys
import warnings
from typing import Optional

from hvdlike.core.messages import ReduceOp
from hvdlike.core.process_sets import global_process_set
from hvdlike.frontend.submit import name_for

from .backend import FRONTEND, Compression, allreduce, check_compression, grouped_allreduce


class _HvdlikeOptimizer:
    """Marks optimizers returned by :func:`DistributedOptimizer`."""

    _hvd_settings = None

    @property
    def loss_scale_factor(self):
        return self.__dict__.get("_hvd_loss_scale_factor")

    @loss_scale_factor.setter
    def loss_scale_factor(self, value):
        # A LossScaleOptimizer clears its inner optimizer's factor in __init__:
        # that is how one built around this optimizer from outside shows up.
        import keras

        if self._hvd_settings is not None:
            caller = _calling_loss_scaler(self, keras.optimizers.LossScaleOptimizer)
            if caller is not None and not isinstance(caller, _HvdlikeOptimizer):
                raise ValueError(_FOREIGN_LOSS_SCALE)
        object.__setattr__(self, "_hvd_loss_scale_factor", value)


def _reduce(settings, grads, kind: str):
    """One grouped allreduce of ``grads`` (None entries kept) with the optimizer's settings."""
    grads = list(grads)
    present = [i for i, g in enumerate(grads) if g is not None]
    if not present:
        return grads
    if settings["name"] is None:
        settings["name"] = name_for(None, kind, settings["process_set"])
    reduced = grouped_allreduce([grads[i] for i in present], name=settings["name"],
                                op=settings["op"], prescale_factor=settings["prescale"],
                                postscale_factor=settings["postscale"],
                                process_set=settings["process_set"],
                                compression=settings["compression"])
    for i, value in zip(present, reduced):
        grads[i] = value
    return grads


_FOREIGN_LOSS_SCALE = (
    f"{FRONTEND}.DistributedOptimizer: a keras LossScaleOptimizer is being wrapped around an "
    f"optimizer returned by DistributedOptimizer (model.compile() does this under the "
    f"'mixed_float16' dtype policy when the policy was set after DistributedOptimizer was "
    f"called). That LossScaleOptimizer would test each rank's own, not yet averaged, "
    f"gradients for inf/NaN, so a rank that overflows would skip a step the others take and "
    f"the ranks would drift apart. Call keras.mixed_precision.set_dtype_policy("
    f"'mixed_float16') before DistributedOptimizer (it then does the loss scaling itself), "
    f"or pass DistributedOptimizer(keras.optimizers.LossScaleOptimizer(optimizer)).")


class _DistributedMixin(_HvdlikeOptimizer):
    """Put in front of an optimizer class; see :func:`DistributedOptimizer`."""

    def _clip_gradients(self, grads):
        self.__dict__["_hvd_hook_ran"] = True
        return super()._clip_gradients(self._hvd_reduce_on_update(grads))

    def apply(self, grads, trainable_variables=None):
        # The reduction rides on Keras's gradient-clipping hook. A Keras whose
        # apply() never reached that hook would train every rank on its own
        # gradients without a word: refuse instead.
        self.__dict__["_hvd_hook_ran"] = False
        result = super().apply(grads, trainable_variables)
        if not self.gradient_accumulation_steps and not self.__dict__["_hvd_hook_ran"]:
            raise RuntimeError(
                f"{FRONTEND}.DistributedOptimizer: this Keras version's optimizer did not call "
                f"_clip_gradients() in apply(), where hvdlike averages the gradients; the "
                f"update used this rank's own gradients (Keras {keras_version()} is not "
                f"supported).")
        return result

    def _hvd_reduce_on_update(self, grads):
        """Reduce now, or -- with gradient accumulation -- only on the update micro-step.

        On torch Keras calls this hook only on update steps; the JAX backend
        calls it on every micro-step and discards the result between updates,
        so the reduction goes into a ``cond`` to communicate once per update.
        """
        import keras

        settings = self._hvd_settings
        steps = self.gradient_accumulation_steps
        if not steps:
            return _reduce(settings, grads, "keras_optimizer")
        is_update = keras.ops.equal((self._iterations + 1) % steps, 0)
        return keras.ops.cond(is_update, lambda: _reduce(settings, grads, "keras_optimizer"),
                              lambda: list(grads))

def keras_version() -> str:
    import keras

    return getattr(keras, "__version__", "?")


def _calling_loss_scaler(target, loss_scale_class):
    """The LossScaleOptimizer (other than ``target``) setting an attribute of ``target``.

    Looks a few frames up (past Keras's ``__setattr__``), no further.
    """
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if candidate is not target and isinstance(candidate, loss_scale_class):
            return candidate
        frame = frame.f_back
    return None


class _AgreedLossScaleMixin(_HvdlikeOptimizer):
    """Put in front of ``LossScaleOptimizer``: all ranks skip the same steps.

    The inner optimizer (itself distributed) averages the gradients; this
    only makes the skip decision common, with a Min over each rank's
    "all my gradients are finite" flag.
    """

    def check_finite(self, grads):
        import keras

        settings = self._hvd_settings
        if settings["name"] is None:
            settings["name"] = name_for(None, "keras_loss_scale", settings["process_set"])
        mine = keras.ops.reshape(keras.ops.cast(super().check_finite(grads), "float32"), (1,))
        everyone = allreduce(mine, name=settings["name"], op=ReduceOp.MIN,
                             process_set=settings["process_set"])
        return keras.ops.all(keras.ops.greater(everyone, 0.5))


def _check_factor(factor) -> None:
    if (isinstance(factor, bool) or not isinstance(factor, numbers.Real)
            or not math.isfinite(factor) or factor <= 0):
        raise ValueError(f"{FRONTEND}.DistributedOptimizer: gradient_predivide_factor must be "
                         f"a positive finite number, got {factor!r}")


def _check_op(op) -> ReduceOp:
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"{FRONTEND}.DistributedOptimizer: unknown reduction op {op!r}; "
                         f"use hvd.Average or hvd.Sum") from None
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError(f"{FRONTEND}.DistributedOptimizer: op must be Average or Sum, "
                         f"got {op.name.title()}")
    return op


def _check_passes(passes) -> int:
    if isinstance(passes, bool) or not isinstance(passes, numbers.Integral) or passes < 1:
        raise ValueError(f"{FRONTEND}.DistributedOptimizer: backward_passes_per_step must be "
                         f"an int >= 1, got {passes!r}")
    return int(passes)


def _check_groups(num_groups, groups):
    """Horovod's checks; hvdlike already sends all gradients as one fused group."""
    if num_groups:
        warnings.warn("DistributedOptimizer: num_groups is deprecated; use groups",
                      DeprecationWarning, stacklevel=3)
        groups = num_groups if groups is None else groups
    if groups is not None and not isinstance(groups, list) and not (
            isinstance(groups, numbers.Integral) and not isinstance(groups, bool)
            and groups > 0):
        raise ValueError(f"{FRONTEND}.DistributedOptimizer: groups must be a positive int or "
                         f"a list of lists of variables, got {groups!r}")


def _settings(name, compression, gradient_predivide_factor, op, passes, average_aggregated,
              process_set) -> dict:
    op = _check_op(op)
    _check_factor(gradient_predivide_factor)
    check_compression(compression, "DistributedOptimizer")
    prescale = postscale = 1.0
    if gradient_predivide_factor != 1.0:
        if op != ReduceOp.AVERAGE:
            raise ValueError(f"{FRONTEND}.DistributedOptimizer: gradient_predivide_factor "
                             f"needs op=Average")
        prescale, postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
    if passes > 1 and not average_aggregated:
        # Keras's accumulation averages the micro-batches; Horovod's sums them by default.
        postscale *= passes
    return {"name": name, "op": op, "prescale": prescale, "postscale": postscale,
            "process_set": process_set, "compression": compression}


def _subclass(mixin, base):
    return type(base.__name__, (mixin, base), {"__module__": base.__module__})


def _distributed_copy(optimizer, settings: dict, passes: int):
    """A copy of ``optimizer`` (same class and config) whose updates reduce first."""
    base = type(optimizer)
    config = optimizer.get_config()
    if passes > 1:
        if config.get("gradient_accumulation_steps"):
            raise ValueError(f"{FRONTEND}.DistributedOptimizer: backward_passes_per_step="
                             f"{passes} and the optimizer's own gradient_accumulation_steps="
                             f"{config['gradient_accumulation_steps']} both accumulate; use "
                             f"one of them")
        config["gradient_accumulation_steps"] = passes
    try:
        wrapped = _subclass(_DistributedMixin, base).from_config(config)
    except Exception as exc:
        raise TypeError(
            f"{FRONTEND}.DistributedOptimizer builds a copy of the optimizer from its "
            f"configuration, and {base.__module__}.{base.__qualname__}.from_config("
            f"optimizer.get_config()) failed: {type(exc).__name__}: {exc} (a custom optimizer "
            f"must return every argument of its __init__ from get_config)") from exc
    wrapped._hvd_settings = settings
    return wrapped


def _loss_scaled(inner, outer, settings: dict):
    """A LossScaleOptimizer around ``inner`` (distributed) whose ranks agree on skipping.

    ``outer`` is the user's LossScaleOptimizer whose scale settings are kept,
    or None for Keras's defaults (what ``compile`` would have used).
    """
    import keras

    base = type(outer) if outer is not None else keras.optimizers.LossScaleOptimizer
    config = dict(outer.get_config()) if outer is not None else {"name": "loss_scale_optimizer"}
    config.pop("inner_optimizer", None)
    wrapped = _subclass(_AgreedLossScaleMixin, base)(inner, **config)
    wrapped._hvd_settings = {"name": None, "process_set": settings["process_set"]}
    return wrapped


def _mixed_float16() -> bool:
    import keras

    return keras.config.dtype_policy().name == "mixed_float16"


def DistributedOptimizer(optimizer, name: Optional[str] = None, device_dense: str = "",
                         device_sparse: str = "", compression=Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op=ReduceOp.AVERAGE, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups=None, process_set=global_process_set,
                         scale_local_gradients: bool = True):
    """A copy of ``optimizer`` (same class and config) that averages gradients first.

    Args:
        optimizer: a Keras 3 optimizer, not yet used for training (its
            configuration is copied; its variables are not). A
            ``LossScaleOptimizer`` is kept, with its inner optimizer made
            distributed and the skip-on-overflow decision made common to
            all ranks; under the ``mixed_float16`` dtype policy any other
            optimizer is put in such a ``LossScaleOptimizer`` here, so
            ``compile`` does not add one of its own.
        name: name of the grouped allreduce (default: chosen on the first
            step, the same on every rank when ranks build optimizers in the
            same order).
        device_dense, device_sparse: accepted for compatibility; ignored.
        compression: ``Compression.none`` (default), ``Compression.fp16``
            (gradients cross as float16) or ``Compression.bf16``.
        sparse_as_dense: accepted; Keras 3 gradients on torch and JAX are dense.
        gradient_predivide_factor: with ``Average``, divide gradients by this
            factor before the sum and by ``size / factor`` after it.
        op: ``Average`` (default) or ``Sum``.
        backward_passes_per_step: accumulate this many local gradients and
            reduce once, every that many steps (Keras's gradient accumulation).
        average_aggregated_gradients: with ``backward_passes_per_step > 1``,
            apply the mean of the accumulated gradients instead of their sum.
        num_groups, groups: accepted and checked; all gradients already travel
            as one fused group.
        process_set: ranks to average over.
        scale_local_gradients: accepted; hvdlike has no rank-local variables.

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer.
        ValueError: a bad op, factor, ``backward_passes_per_step`` or groups.

    Example:
        >>> opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
        >>> model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    """
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"{FRONTEND}.DistributedOptimizer expects a keras.optimizers.Optimizer, "
                        f"got {type(optimizer).__module__}.{type(optimizer).__qualname__}")
    if isinstance(optimizer, _HvdlikeOptimizer):
        raise ValueError(f"{FRONTEND}.DistributedOptimizer: the optimizer already averages "
                         f"its gradients across ranks (it was returned by "
                         f"DistributedOptimizer); wrapping it again would reduce every "
                         f"gradient twice")
    passes = _check_passes(backward_passes_per_step)
    _check_groups(num_groups, groups)
    settings = _settings(name, compression, gradient_predivide_factor, op, passes,
                         average_aggregated_gradients, process_set)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        inner = _distributed_copy(optimizer.inner_optimizer, settings, passes)
        return _loss_scaled(inner, optimizer, settings)
    wrapped = _distributed_copy(optimizer, settings, passes)
    if _mixed_float16():
        return _loss_scaled(wrapped, None, settings)
    return wrapped
