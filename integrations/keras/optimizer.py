"""DistributedOptimizer for Keras 3: average gradients across ranks, then apply.

Keras funnels every update through ``optimizer.apply(grads, variables)``:
``model.fit`` calls it directly on the torch backend and through
``stateless_apply`` inside the jitted step on the JAX backend. The wrapper
overrides ``apply`` in a subclass of the user's optimizer class, so both
paths average the gradients -- in one grouped allreduce -- before the wrapped
optimizer's own logic (loss scaling, accumulation, EMA...) runs.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

from hvdlike.core.messages import ReduceOp
from hvdlike.core.process_sets import global_process_set
from hvdlike.frontend.submit import name_for

from .backend import FRONTEND, grouped_allreduce


class _DistributedMixin:
    """Put in front of an optimizer class; see :func:`DistributedOptimizer`."""

    _hvd_settings = None

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        if present:
            settings = self._hvd_settings
            if settings["name"] is None:
                settings["name"] = name_for(None, "keras_optimizer", settings["process_set"])
            reduced = grouped_allreduce([grads[i] for i in present], name=settings["name"],
                                        op=settings["op"], prescale_factor=settings["prescale"],
                                        postscale_factor=settings["postscale"],
                                        process_set=settings["process_set"])
            for i, value in zip(present, reduced):
                grads[i] = value
        return super().apply(grads, trainable_variables)


def DistributedOptimizer(optimizer, name: Optional[str] = None, op=ReduceOp.AVERAGE,
                         gradient_predivide_factor: float = 1.0,
                         process_set=global_process_set):
    """A copy of ``optimizer`` (same class and config) that averages gradients first.

    Args:
        optimizer: a Keras 3 optimizer, not yet used for training (its
            configuration is copied; its variables are not).
        name: name of the grouped allreduce (default: chosen on the first
            step, the same on every rank when ranks build optimizers in the
            same order).
        op: ``Average`` (default) or ``Sum``.
        gradient_predivide_factor: with ``Average``, divide gradients by this
            factor before the sum and by ``size / factor`` after it.
        process_set: ranks to average over.

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer.
        ValueError: ``gradient_predivide_factor`` with an op other than Average.

    Example:
        >>> opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
        >>> model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    """
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"{FRONTEND}.DistributedOptimizer expects a keras.optimizers.Optimizer, "
                        f"got {type(optimizer).__module__}.{type(optimizer).__qualname__}")
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError(f"{FRONTEND}.DistributedOptimizer: the optimizer already averages "
                         f"its gradients across ranks (it was returned by "
                         f"DistributedOptimizer); wrapping it again would reduce every "
                         f"gradient twice")
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"{FRONTEND}.DistributedOptimizer: unknown reduction op {op!r}; "
                         f"use hvd.Average or hvd.Sum") from None
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError(f"{FRONTEND}.DistributedOptimizer: op must be Average or Sum, "
                         f"got {op.name.title()}")
    factor = gradient_predivide_factor
    if (isinstance(factor, bool) or not isinstance(factor, numbers.Real)
            or not math.isfinite(factor) or factor <= 0):
        raise ValueError(f"{FRONTEND}.DistributedOptimizer: gradient_predivide_factor must be "
                         f"a positive finite number, got {factor!r}")
    prescale = postscale = 1.0
    if gradient_predivide_factor != 1.0:
        if op != ReduceOp.AVERAGE:
            raise ValueError(f"{FRONTEND}.DistributedOptimizer: gradient_predivide_factor "
                             f"needs op=Average")
        prescale, postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedMixin, base), {"__module__": base.__module__})
    try:
        wrapped = cls.from_config(optimizer.get_config())
    except Exception as exc:
        raise TypeError(
            f"{FRONTEND}.DistributedOptimizer builds a copy of the optimizer from its "
            f"configuration, and {base.__module__}.{base.__qualname__}.from_config("
            f"optimizer.get_config()) failed: {type(exc).__name__}: {exc} (a custom optimizer "
            f"must return every argument of its __init__ from get_config)") from exc
    wrapped._hvd_settings = {"name": name, "op": op, "prescale": prescale,
                             "postscale": postscale, "process_set": process_set}
    return wrapped
