"""Gradient averaging for optax: Horovod's DistributedOptimizer, the JAX way.

:func:`allreduce_gradients` is an optax ``GradientTransformation`` that
replaces every rank's gradients by their average over all ranks, as one
grouped allreduce of the whole gradient pytree (one negotiation, fused into
few buffers). Chain it in front of any optimizer::

    tx = optax.chain(hvd.allreduce_gradients(), optax.adam(1e-3))
    # or, with Horovod's name:
    tx = hvd.DistributedOptimizer(optax.adam(1e-3))

It works in an eager step and inside ``jax.jit`` (the collective is staged
as an ordered host callback, see :mod:`hvdlike.jax.ops`).
"""

from __future__ import annotations

from typing import Optional

import optax

from hvdlike.core.messages import ReduceOp
from hvdlike.core.process_sets import global_process_set
from hvdlike.frontend.submit import name_for

from .pytree import allreduce_pytree


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
    op = ReduceOp(op)
    prescale, postscale = 1.0, 1.0
    if gradient_predivide_factor != 1.0:
        if op != ReduceOp.AVERAGE:
            raise ValueError("gradient_predivide_factor needs op=Average")
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
        reduced = allreduce_pytree(updates, chosen[0], op, prescale, postscale, process_set)
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
    if int(backward_passes_per_step) < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    tx = optax.chain(allreduce_gradients(op, name, gradient_predivide_factor, process_set),
                     optimizer)
    if backward_passes_per_step > 1:
        # MultiSteps calls the inner transformation (and so the allreduce) only
        # on every k-th step, under lax.cond inside jit: one collective per k.
        tx = optax.MultiSteps(tx, every_k_schedule=int(backward_passes_per_step))
        tx = tx.gradient_transformation()
    return tx
