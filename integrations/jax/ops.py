"""Collectives on JAX arrays, eagerly or from inside ``jax.jit``.

Eager calls go straight through the shared grid (:class:`ArrayOps`). Under a
JAX trace the synchronous collectives are staged as an ordered
``jax.experimental.io_callback``: the compiled program calls back into the
host when it reaches the collective, the callback runs the eager collective on
the concrete CPU arrays, and the result flows on inside the program. Ordered
callbacks run in program order, which keeps every rank's sequence of
collectives the same. The collective's name is fixed when the function is
traced, so each execution reuses it (and hits the response cache).

Result shapes must be known while tracing, so under ``jit`` an allgather
assumes every rank contributes the same shape and an alltoall takes no
``splits``; eager calls have neither restriction.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
from jax.experimental import io_callback

from hvdlike.core import api
from hvdlike.core.messages import ReduceOp
from hvdlike.core.process_sets import global_process_set
from hvdlike.frontend import ArrayOps
from hvdlike.frontend.submit import name_for, set_size

from .convert import FRONTEND, JaxAdapter, is_traced

Average = ReduceOp.AVERAGE
grid = ArrayOps(JaxAdapter())


def _any_traced(values: Sequence) -> bool:
    return any(is_traced(v) for v in values)


def _staged(eager: Callable, values: Sequence, shapes: Sequence[jax.ShapeDtypeStruct]):
    """Run ``eager(list_of_concrete_arrays)`` from inside the traced program."""
    def host(*concrete):
        results = eager(list(concrete))
        for got, want in zip(results, shapes):
            if tuple(got.shape) != tuple(want.shape):
                raise ValueError(f"{FRONTEND}: inside jax.jit the result shape must be known "
                                 f"when tracing; expected {want.shape}, got {got.shape} "
                                 f"(do all ranks pass the same shape?)")
        return list(results)
    return io_callback(host, list(shapes), *values, ordered=True)


def _spec(value, shape=None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(value.shape) if shape is None else shape, value.dtype)


def _trace_name(name: Optional[str], op: str, process_set) -> str:
    return name_for(name, op, process_set)


def allreduce(tensor, name: Optional[str] = None, op=Average, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` across ranks (default Average); works inside ``jax.jit``.

    Example:
        >>> total = hvd.allreduce(jnp.ones(3), op=hvd.Sum)   # == size() * ones
    """
    if not is_traced(tensor):
        return grid.allreduce(tensor, name, op, prescale_factor, postscale_factor, process_set)
    name = _trace_name(name, "allreduce", process_set)
    return _staged(lambda xs: [grid.allreduce(xs[0], name, op, prescale_factor, postscale_factor,
                                             process_set)], [tensor], [_spec(tensor)])[0]


def grouped_allreduce(tensors, name: Optional[str] = None, op=Average, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set) -> list:
    """Allreduce a list of arrays as one fused unit; works inside ``jax.jit``."""
    tensors = grid._list(tensors, "grouped_allreduce")
    if not _any_traced(tensors):
        return grid.grouped_allreduce(tensors, name, op, prescale_factor, postscale_factor,
                                     process_set)
    name = _trace_name(name, "grouped_allreduce", process_set)
    return _staged(lambda xs: grid.grouped_allreduce(xs, name, op, prescale_factor,
                                                    postscale_factor, process_set),
                   tensors, [_spec(t) for t in tensors])


def broadcast(tensor, root_rank: int, name: Optional[str] = None,
              process_set=global_process_set):
    """Return ``root_rank``'s ``tensor`` on every rank; works inside ``jax.jit``."""
    if not is_traced(tensor):
        return grid.broadcast(tensor, root_rank, name, process_set)
    name = _trace_name(name, "broadcast", process_set)
    return _staged(lambda xs: [grid.broadcast(xs[0], root_rank, name, process_set)],
                   [tensor], [_spec(tensor)])[0]


def allgather(tensor, name: Optional[str] = None, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along dimension 0.

    Eagerly the first dimension may differ between ranks; inside ``jax.jit``
    every rank must pass the same shape.
    """
    if not is_traced(tensor):
        return grid.allgather(tensor, name, process_set)
    name = _trace_name(name, "allgather", process_set)
    shape = tuple(tensor.shape) or (1,)
    out = (shape[0] * set_size(process_set),) + shape[1:]
    return _staged(lambda xs: [grid.allgather(xs[0], name, process_set)],
                   [tensor], [_spec(tensor, out)])[0]


def alltoall(tensor, splits=None, name: Optional[str] = None, process_set=global_process_set):
    """Scatter slices of ``tensor`` to every rank and gather theirs.

    Returns the received array, or ``(received, received_splits)`` when
    ``splits`` is given (eager calls only).
    """
    if not is_traced(tensor):
        return grid.alltoall(tensor, splits, name, process_set)
    if splits is not None:
        raise ValueError(f"{FRONTEND}.alltoall: splits are not supported inside jax.jit "
                         f"(the received shape would depend on other ranks)")
    name = _trace_name(name, "alltoall", process_set)
    return _staged(lambda xs: [grid.alltoall(xs[0], None, name, process_set)],
                   [tensor], [_spec(tensor)])[0]


def reducescatter(tensor, name: Optional[str] = None, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` across ranks and keep this rank's part of dimension 0."""
    if not is_traced(tensor):
        return grid.reducescatter(tensor, name, op, process_set, prescale_factor,
                                 postscale_factor)
    name = _trace_name(name, "reducescatter", process_set)
    size = set_size(process_set)
    me = process_set.rank() if process_set is not None else api.rank()
    first = tensor.shape[0] if tensor.shape else 1
    rows = first // size + (1 if me < first % size else 0)
    return _staged(lambda xs: [grid.reducescatter(xs[0], name, op, process_set, prescale_factor,
                                                 postscale_factor)],
                   [tensor], [_spec(tensor, (rows,) + tuple(tensor.shape[1:]))])[0]
