"""Collectives on JAX arrays, eagerly or from inside ``jax.jit``.

Eager calls go straight through the shared grid (:class:`ArrayOps`). Under a
JAX trace the synchronous collectives are staged as an ordered
``jax.experimental.io_callback``: the compiled program calls back into the
host when it reaches the collective, the callback runs the eager collective on
the concrete CPU arrays, and the result flows on inside the program. Ordered
callbacks run in program order, which keeps every rank's sequence of
collectives the same. The collective's name is fixed when the function is
traced, so each execution reuses it (and hits the response cache).

An exception raised by the callback reaches the caller as JAX's
``JaxRuntimeError``; the callback records it first, so that
:mod:`hvdlike.jax.errors` can hand the original back.

Result shapes must be known while tracing, so under ``jit`` an allgather
assumes every rank contributes the same shape and an alltoall takes no
``splits``; eager calls have neither restriction.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from hvdlike.core import api, collectives as core
from hvdlike.core.messages import ReduceOp
from hvdlike.core.process_sets import global_process_set
from hvdlike.frontend import ArrayOps
from hvdlike.frontend.submit import name_for, set_size

from . import errors
from .convert import FRONTEND, JaxAdapter, check_dtype, is_traced

Average = ReduceOp.AVERAGE
grid = ArrayOps(JaxAdapter())


def _any_traced(values: Sequence) -> bool:
    return any(is_traced(v) for v in values)


def _as_jax(values: Sequence) -> list:
    """Traced values as they are; constants (Python scalars, numpy arrays) as JAX arrays.

    Inside a traced function JAX holds constants in its own canonical dtypes
    (float32 for a float64 numpy array unless x64 is on); staging them the
    same way keeps the callback's declared result types valid.
    """
    out = []
    for value in values:
        if not is_traced(value) and not isinstance(value, jax.Array):
            try:
                value = jnp.asarray(value)
            except TypeError as exc:
                raise TypeError(f"{FRONTEND}: cannot stage a {type(value).__module__}."
                                f"{type(value).__qualname__} in a collective inside jax.jit: "
                                f"{exc}") from None
        out.append(value)
    return out


def _stand_in(value, what: str) -> np.ndarray:
    """A numpy array of ``value``'s shape and dtype that owns no real memory."""
    check_dtype(value.dtype, what)
    return np.broadcast_to(np.zeros((), dtype=np.dtype(value.dtype)), tuple(value.shape))


def _tensor(value, what: str):
    """The torch view of a stand-in for ``value``, refused as the eager call would refuse it."""
    return grid._tensor(_stand_in(value, what), what)


def _staged(eager: Callable, values: Sequence, shapes: Sequence[jax.ShapeDtypeStruct]):
    """Run ``eager(list_of_concrete_arrays)`` from inside the traced program."""
    def host(*concrete):
        try:
            return _run_on_host(eager, concrete, shapes)
        except Exception as exc:
            errors.record(exc)  # JAX will hand the caller only a formatted copy
            raise
    return io_callback(host, list(shapes), *values, ordered=True)


def _run_on_host(eager: Callable, concrete: Sequence, shapes: Sequence[jax.ShapeDtypeStruct]):
    """The eager collective on the callback's concrete arrays, with the traced shapes checked."""
    results = eager(list(concrete))
    for got, want in zip(results, shapes):
        if tuple(got.shape) != tuple(want.shape):
            raise ValueError(f"{FRONTEND}: inside jax.jit the result shape must be known "
                             f"when tracing; expected {want.shape}, got {got.shape} "
                             f"(do all ranks pass the same shape?)")
    return list(results)


def _spec(value, shape=None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(value.shape) if shape is None else shape, value.dtype)


def _trace_name(name: Optional[str], op: str, process_set) -> str:
    """The collective's final name, chosen while tracing, after the eager call's checks.

    The checks the eager call makes when it submits -- that this rank is a
    member of ``process_set``, that ``name`` is a string -- would otherwise
    only run inside the compiled program (or, for the result shape, fail
    unprefixed), so they are made here, with the eager call's message.
    """
    try:
        set_size(process_set)
        return name_for(name, op, process_set)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        if message.startswith(FRONTEND):
            raise
        if message.startswith(op + ":"):
            message = message[len(op) + 1:].lstrip()
        kind = TypeError if isinstance(exc, TypeError) else ValueError
        raise kind(f"{FRONTEND}.{op}: {message}") from None


def allreduce(tensor, name: Optional[str] = None, op=Average, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` across ranks (default Average); works inside ``jax.jit``.

    Example:
        >>> total = hvd.allreduce(jnp.ones(3), op=hvd.Sum)   # == size() * ones
    """
    if not is_traced(tensor):
        return grid.allreduce(tensor, name, op, prescale_factor, postscale_factor, process_set)
    name = _trace_name(name, "allreduce", process_set)
    # The eager checks (op, dtype, scale factors) run now, on a stand-in.
    grid._allreduce_entries(_stand_in(tensor, "allreduce"), name, op, prescale_factor,
                            postscale_factor, False, False, process_set)
    return _staged(lambda xs: [grid.allreduce(xs[0], name, op, prescale_factor, postscale_factor,
                                             process_set)], [tensor], [_spec(tensor)])[0]


def grouped_allreduce(tensors, name: Optional[str] = None, op=Average, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set) -> list:
    """Allreduce a list of arrays as one fused unit; works inside ``jax.jit``."""
    return grouped_allreduce_then(tensors, name, op, prescale_factor, postscale_factor,
                                  process_set)


def grouped_allreduce_then(tensors, name, op, prescale_factor, postscale_factor, process_set,
                           before: Optional[Callable[[str], None]] = None) -> list:
    """:func:`grouped_allreduce`, calling ``before(final_name)`` on the host first.

    ``before`` runs where the collective runs -- eagerly, or in the host
    callback of every execution of a jitted function -- so a check it makes
    (the pytree front end's structure agreement) sees the same runtime as the
    collective and can fail the step with an hvdlike error.
    """
    tensors = grid._list(tensors, "grouped_allreduce")
    if not _any_traced(tensors):
        if before is not None:
            name = _trace_name(name, "grouped_allreduce", process_set)
            before(name)
        return grid.grouped_allreduce(tensors, name, op, prescale_factor, postscale_factor,
                                     process_set)
    tensors = _as_jax(tensors)
    name = _trace_name(name, "grouped_allreduce", process_set)
    grid._allreduce_entries([_stand_in(t, "grouped_allreduce") for t in tensors], name, op,
                            prescale_factor, postscale_factor, False, True, process_set)

    def eager(xs):
        if before is not None:
            before(name)
        return grid.grouped_allreduce(xs, name, op, prescale_factor, postscale_factor,
                                      process_set)

    return _staged(eager, tensors, [_spec(t) for t in tensors])


def broadcast(tensor, root_rank: int, name: Optional[str] = None,
              process_set=global_process_set):
    """Return ``root_rank``'s ``tensor`` on every rank; works inside ``jax.jit``."""
    if not is_traced(tensor):
        return grid.broadcast(tensor, root_rank, name, process_set)
    name = _trace_name(name, "broadcast", process_set)
    _tensor(tensor, "broadcast")
    grid._build("broadcast", lambda: core.check_root(root_rank, api.size(), "broadcast"))
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
    _tensor(tensor, "allgather")
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
    t = _tensor(tensor, "alltoall")
    grid._build("alltoall", lambda: core.alltoall_entry(t, None, set_size(process_set), name))
    return _staged(lambda xs: [grid.alltoall(xs[0], None, name, process_set)],
                   [tensor], [_spec(tensor)])[0]


def reducescatter(tensor, name: Optional[str] = None, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` across ranks and keep this rank's part of dimension 0."""
    if not is_traced(tensor):
        return grid.reducescatter(tensor, name, op, process_set, prescale_factor,
                                 postscale_factor)
    name = _trace_name(name, "reducescatter", process_set)
    t = _tensor(tensor, "reducescatter")
    grid._build("reducescatter", lambda: core.reducescatter_entry(
        t, name, op, prescale_factor, postscale_factor))
    size = set_size(process_set)
    me = process_set.rank() if process_set is not None else api.rank()
    first = tensor.shape[0] if tensor.shape else 1
    rows = first // size + (1 if me < first % size else 0)
    return _staged(lambda xs: [grid.reducescatter(xs[0], name, op, process_set, prescale_factor,
                                                 postscale_factor)],
                   [tensor], [_spec(tensor, (rows,) + tuple(tensor.shape[1:]))])[0]
