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
from hvdlike.frontend.submit import name_for, set_size

from .backend import FRONTEND, Compression, allreduce, check_compression, grouped_allreduce


class _HvdlikeOptimizer:
    """Marks optimizers returned by :func:`DistributedOptimizer`."""

    _hvd_settings = None

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient on this rank: it is not reduced (Horovod's method).

        With ``scale_local_gradients`` (default) the local gradient is divided
        by the process set's size, as Horovod does.
        """
        import keras

        if not isinstance(var, keras.Variable):
            raise TypeError(f"{FRONTEND}.DistributedOptimizer.register_local_var expects a "
                            f"keras.Variable, got {type(var).__module__}."
                            f"{type(var).__qualname__}")
        local = self._hvd_settings["local"]
        if not any(var is v for v in local):
            local.append(var)

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


def _local_ids(settings) -> set:
    """ids of the variables whose gradients stay on their rank.

    Layers given to :func:`PartialDistributedOptimizer` are looked at on every
    update rather than once, so a layer built after the optimizer was made
    (Keras builds layers lazily) still counts with all its weights.
    """
    ids = {id(v) for v in settings.get("local", ())}
    for layer in settings.get("local_layers", ()):
        ids.update(id(v) for v in layer.trainable_weights)
    return ids


def _reduce_shared(settings, grads, variables, kind: str):
    """Reduce the gradients of shared variables; scale those of local ones.

    Local variables (``register_local_var``, ``PartialDistributedOptimizer``)
    keep their rank's own gradient. With ``scale_local_gradients`` (the
    default) that gradient is divided by the process set's size whatever the
    op, as Horovod divides it, so scripts tuned there train the same here.
    """
    local = _local_ids(settings) if variables is not None else set()
    if not local:
        return _reduce(settings, grads, kind)
    grads = list(grads)
    is_local = [id(v) in local for v in variables]
    shared = _reduce(settings, [None if here else g for g, here in zip(grads, is_local)], kind)
    size = set_size(settings["process_set"]) if settings.get("scale_local", True) else 1
    for i, here in enumerate(is_local):
        if here and grads[i] is not None:
            shared[i] = grads[i] / size if size != 1 else grads[i]
    return shared


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

    def _backend_apply_gradients(self, grads, trainable_variables):
        # _clip_gradients gets the gradients only; which of them belong to
        # local variables is known from the variables handed in here, in the
        # same order (after Keras has filtered both lists).
        self.__dict__["_hvd_variables"] = list(trainable_variables)
        try:
            return super()._backend_apply_gradients(grads, trainable_variables)
        finally:
            self.__dict__["_hvd_variables"] = None

    def _clip_gradients(self, grads):
        self.__dict__["_hvd_hook_ran"] = True
        return super()._clip_gradients(self._hvd_reduce_on_update(grads))

    def _overwrite_variables_directly_with_gradients(self, grads, trainable_variables):
        """Agree on the values Keras writes straight into variables, then let Keras write them.

        Float8 layers keep their scales and amax histories in variables with
        ``overwrite_with_gradient``: the "gradient" Keras computes is the new
        value (the history shifted by one with this batch's absolute maximum
        in front, and a scale derived from the previous history), and Keras
        assigns it before ``_clip_gradients`` runs. Ranks that started equal
        differ only in the newest amax, which would make their scales drift
        apart. The Max over ranks is, for inputs and kernel, the amax of the
        global batch -- what one process training on the whole batch would
        record -- and for the output gradients, which each rank quantizes on
        its own, the largest any rank has to represent; a scale is a rising
        function of the amax it was computed from. Keras combines accumulated
        micro-batches with a maximum too.
        """
        grads = list(grads)
        trainable_variables = list(trainable_variables)
        local = _local_ids(self._hvd_settings)
        chosen = [i for i, v in enumerate(trainable_variables)
                  if self._overwrite_variable_with_gradient(v) and id(v) not in local
                  and grads[i] is not None]
        if chosen:
            settings = self._hvd_settings
            if settings.get("overwrite_name") is None:
                settings["overwrite_name"] = name_for(None, "keras_overwrite",
                                                      settings["process_set"])
            reduced = grouped_allreduce([grads[i] for i in chosen],
                                        name=settings["overwrite_name"], op=ReduceOp.MAX,
                                        process_set=settings["process_set"])
            for i, value in zip(chosen, reduced):
                grads[i] = value
        grads, trainable_variables = super()._overwrite_variables_directly_with_gradients(
            grads, trainable_variables)
        if not list(grads):
            # Nothing is left for _clip_gradients: no gradient goes unreduced.
            self.__dict__["_hvd_hook_ran"] = True
        return grads, trainable_variables

    def apply(self, grads, trainable_variables=None):
        if len(grads) == 0:
            # Keras's documented no-op for empty gradients: nothing to reduce.
            return super().apply(grads, trainable_variables)
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
        variables = self.__dict__.get("_hvd_variables")
        steps = self.gradient_accumulation_steps
        if not steps:
            return _reduce_shared(settings, grads, variables, "keras_optimizer")
        is_update = keras.ops.equal((self._iterations + 1) % steps, 0)
        return keras.ops.cond(
            is_update, lambda: _reduce_shared(settings, grads, variables, "keras_optimizer"),
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
              process_set, scale_local_gradients=True) -> dict:
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
            "process_set": process_set, "compression": compression, "local": [],
            "local_layers": [], "scale_local": bool(scale_local_gradients),
            "overwrite_name": None}


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
    # The same list: register_local_var on the outer optimizer reaches the inner one.
    wrapped._hvd_settings = {"name": None, "process_set": settings["process_set"],
                             "local": settings["local"]}
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
        scale_local_gradients: divide the gradients of local variables (see
            ``register_local_var`` on the returned optimizer) by the process
            set's size, as Horovod does; without local variables it changes
            nothing.

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
                         average_aggregated_gradients, process_set, scale_local_gradients)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        inner = _distributed_copy(optimizer.inner_optimizer, settings, passes)
        return _loss_scaled(inner, optimizer, settings)
    wrapped = _distributed_copy(optimizer, settings, passes)
    if _mixed_float16():
        return _loss_scaled(wrapped, None, settings)
    return wrapped


def _layer_list(local_layers) -> list:
    import keras

    if local_layers is None:
        return []
    layers = [local_layers] if isinstance(local_layers, keras.layers.Layer) else local_layers
    try:
        layers = list(layers)
    except TypeError:
        layers = [layers]
    for layer in layers:
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(f"{FRONTEND}.PartialDistributedOptimizer: local_layers must be "
                            f"keras layers, got {type(layer).__module__}."
                            f"{type(layer).__qualname__}")
    return layers


def PartialDistributedOptimizer(optimizer, name: Optional[str] = None, device_dense: str = "",
                                device_sparse: str = "", compression=Compression.none,
                                sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op=ReduceOp.AVERAGE,
                                backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False, groups=None,
                                process_set=global_process_set,
                                scale_local_gradients: bool = True, local_layers=None):
    """:func:`DistributedOptimizer` whose ``local_layers`` keep their own gradients.

    The trainable weights of every layer in ``local_layers`` (a layer or a
    list of layers) are local to each rank: their gradients are not reduced
    and, with ``scale_local_gradients``, are divided by the process set's
    size, as in Horovod. The layers' weights are looked up at each update, so
    layers that are not built yet may be passed. The other arguments are
    :func:`DistributedOptimizer`'s.

    Raises:
        TypeError: ``local_layers`` holds something that is not a Keras layer.
    """
    layers = _layer_list(local_layers)
    wrapped = DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)
    _distributed_settings(wrapped)["local_layers"].extend(layers)
    return wrapped


def _distributed_settings(optimizer) -> dict:
    """The settings of the optimizer that reduces (inside any loss scaling)."""
    import keras

    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer._hvd_settings
