"""Gradient averaging for optax: Horovod's DistributedOptimizer, the JAX way.

:func:`allreduce_gradients` is an optax ``GradientTransformation`` that
replaces every rank's gradients by their average over all ranks, as one
grouped allreduce of the whole gradient pytree (one negotiation, fused into
few buffers). Chain it in front of any optimizer::

    tx = optax.chain(hvd.allreduce_gradients(), optax.adam(1e-3))
    # or, with Horovod's name:
    tx = hvd.DistributedOptimizer(optax.adam(1e-3))

It works in an eager step and inside ``jax.jit`` (the collective is staged
as an ordered host callback, see :mod:`hvdlike.jax.ops`). A jitted step whose
allreduce fails raises JAX's ``JaxRuntimeError``; built with ``hvd.jit`` or
called inside ``hvd.original_errors()`` it raises hvdlike's exception
(``HorovodInternalError``, ``MismatchError``), see :mod:`hvdlike.jax.errors`.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import optax

from hvdlike.core.messages import ReduceOp
from hvdlike.core.process_sets import global_process_set
from hvdlike.frontend.submit import name_for

from .convert import FRONTEND
from .pytree import _reduce_tree

_OPS = (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)


def _check_op(op, what: str) -> ReduceOp:
    try:
        reduce_op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"{FRONTEND}.{what}: unknown reduction op {op!r}; use hvd.Average "
                         f"or hvd.Sum") from None
    if reduce_op not in _OPS:
        raise ValueError(f"{FRONTEND}.{what}: op {reduce_op.name.title()} is not available "
                         f"in hvdlike.jax; use hvd.Average or hvd.Sum")
    return reduce_op


def _check_factor(factor, what: str) -> float:
    if (isinstance(factor, bool) or not isinstance(factor, numbers.Real)
            or not math.isfinite(factor) or factor <= 0):
        raise ValueError(f"{FRONTEND}.{what}: gradient_predivide_factor must be a positive "
                         f"finite number, got {factor!r}")
    return float(factor)


def allreduce_gradients(op=ReduceOp.AVERAGE, name: Optional[str] = None,
                        gradient_predivide_factor: float = 1.0,
                        process_set=global_process_set) -> optax.GradientTransformation:
    """A transformation averaging (or summing) the updates across ranks.

    Args:
        op: ``Average`` (default) or ``Sum``.
        name: name of the grouped allreduce; by default one is chosen on the
            first update, the same on every rank as long as every rank builds
            its transformations in the same order.
        gradient_predivide_factor: with ``Average``, divide by this factor
            before the sum and by ``size / factor`` after it (Horovod's knob
            for keeping fp16 sums in range).
        process_set: ranks to average over.

    Raises:
        ValueError: ``gradient_predivide_factor`` is used with an op other
            than ``Average``.
    """
    op = _check_op(op, "allreduce_gradients")
    gradient_predivide_factor = _check_factor(gradient_predivide_factor, "allreduce_gradients")
    prescale, postscale = 1.0, 1.0
    if gradient_predivide_factor != 1.0:
        if op != ReduceOp.AVERAGE:
            raise ValueError(f"{FRONTEND}.allreduce_gradients: gradient_predivide_factor "
                             f"needs op=Average")
        prescale = 1.0 / gradient_predivide_factor
        postscale = gradient_predivide_factor
    chosen = [name]

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        del params
        if chosen[0] is None:
            chosen[0] = name_for(None, "allreduce_gradients", process_set)
        reduced = _reduce_tree(updates, chosen[0], op, prescale, postscale, process_set,
                               "allreduce_gradients")
        return reduced, state

    return optax.GradientTransformation(init_fn, update_fn)


def DistributedOptimizer(optimizer: optax.GradientTransformation, op=ReduceOp.AVERAGE,
                         name: Optional[str] = None, gradient_predivide_factor: float = 1.0,
                         backward_passes_per_step: int = 1,
                         process_set=global_process_set) -> optax.GradientTransformation:
    """``optimizer`` applied to gradients averaged over every rank.

    Args:
        optimizer: the optax transformation to apply to the averaged gradients.
        op, name, gradient_predivide_factor, process_set: as in
            :func:`allreduce_gradients`.
        backward_passes_per_step: accumulate (average) this many successive
            gradients locally and communicate once, on the last of them, with
            ``optax.MultiSteps``; the other steps return zero updates.

    Example:
        >>> tx = hvd.DistributedOptimizer(optax.sgd(0.1 * hvd.size()))
        >>> opt_state = hvd.broadcast_pytree(tx.init(params), root_rank=0)
    """
    if not (callable(getattr(optimizer, "init", None))
            and callable(getattr(optimizer, "update", None))):
        raise TypeError(f"{FRONTEND}.DistributedOptimizer expects an optax "
                        f"GradientTransformation (e.g. optax.sgd(0.1)), got "
                        f"{type(optimizer).__module__}.{type(optimizer).__qualname__}")
    steps = backward_passes_per_step
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"{FRONTEND}.DistributedOptimizer: backward_passes_per_step must be "
                         f"an int >= 1, got {backward_passes_per_step!r}")
    backward_passes_per_step = int(steps)
    tx = optax.chain(allreduce_gradients(op, name, gradient_predivide_factor, process_set),
                     optimizer)
    if backward_passes_per_step > 1:
        # MultiSteps calls the inner transformation (and so the allreduce) only
        # on every k-th step, under lax.cond inside jit: one collective per k.
        tx = optax.MultiSteps(tx, every_k_schedule=int(backward_passes_per_step))
        tx = tx.gradient_transformation()
    return tx
