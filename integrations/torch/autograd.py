"""Differentiable collectives: ``hvd.allreduce`` & co. inside a model.

When the input requires grad (and grad mode is on), the synchronous forms
exported by ``hvdlike.torch`` run through the :class:`torch.autograd.Function`
classes here. The backward rules are Horovod's, so a model ported from
``horovod.torch`` receives the same gradients:

==========================  ===================================================
forward                     backward (``g`` = grad of the output on each rank)
==========================  ===================================================
allreduce Sum / Average     allreduce of ``g`` with the same op and scale factors
grouped_allreduce           the same, tensor by tensor
allreduce Min / Max         ``sum(g)`` to the ranks holding the extreme value,
                            shared equally between ties (Horovod reduces
                            ``g`` with Min / Max instead)
allreduce Product / Adasum  forward only: a backward through it raises
allgather                   this rank's rows of ``mean(g)`` over the set
grouped_allgather           the same, tensor by tensor
broadcast                   ``mean(g)`` over the set on the root, zeros elsewhere
alltoall                    alltoall of ``g`` with the received splits
reducescatter Average       allgather of ``g``
reducescatter Sum           allgather of ``g * set size``
grouped_reducescatter       the same, tensor by tensor
==========================  ===================================================

Both reducescatter rules also multiply by the pre- and postscale factors.
Backward collectives are named ``<forward name>.grad`` when the forward had a
name; unnamed ones are numbered in call order, which agrees across ranks as
long as every rank runs the same backward.
"""

from __future__ import annotations

from typing import Optional

import torch

from hvdlike.core import api
from hvdlike.core.process_sets import global_process_set
from hvdlike.frontend.compile_guard import eager

from . import ops
from .compression import Compression


def _grad_name(name: Optional[str]) -> Optional[str]:
    return None if name is None else f"{name}.grad"


def _wants_grad(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale, process_set, compression):
        ctx.args = (name, op, prescale, postscale, process_set, compression)
        out = ops.allreduce(tensor.detach(), name=name, compression=compression, op=op,
                            prescale_factor=prescale, postscale_factor=postscale,
                            process_set=process_set)
        if op in (ops.Min, ops.Max):
            ctx.save_for_backward(tensor.detach(), out)
        return out

    @staticmethod
    def backward(ctx, grad):
        name, op, prescale, postscale, process_set, compression = ctx.args
        gname = _grad_name(name)
        if op in (ops.Sum, ops.Average):
            g = ops.allreduce(grad.contiguous(), name=gname, compression=compression, op=op,
                              prescale_factor=prescale, postscale_factor=postscale,
                              process_set=process_set)
        elif op in (ops.Min, ops.Max):
            tensor, out = ctx.saved_tensors
            mask = (tensor == out).to(grad.dtype)
            ties = ops.allreduce(mask, name=None if gname is None else f"{gname}.ties",
                                 op=ops.Sum, process_set=process_set)
            total = ops.allreduce(grad.contiguous(), name=gname, op=ops.Sum,
                                  process_set=process_set)
            g = mask * total / ties.clamp_min(1)
        else:
            raise RuntimeError(f"allreduce with op {ops.ReduceOp(op).name.title()} is not "
                               "differentiable")
        return g, None, None, None, None, None, None


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale, postscale, process_set, compression, *tensors):
        ctx.args = (name, op, prescale, postscale, process_set, compression)
        outs = ops.grouped_allreduce([t.detach() for t in tensors], name=name,
                                     compression=compression, op=op, prescale_factor=prescale,
                                     postscale_factor=postscale, process_set=process_set)
        if op in (ops.Min, ops.Max):
            ctx.save_for_backward(*[t.detach() for t in tensors], *outs)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        name, op, prescale, postscale, process_set, compression = ctx.args
        gname = _grad_name(name)
        grads = [g.contiguous() for g in grads]
        if op in (ops.Sum, ops.Average):
            outs = ops.grouped_allreduce(grads, name=gname, compression=compression, op=op,
                                         prescale_factor=prescale, postscale_factor=postscale,
                                         process_set=process_set)
        elif op in (ops.Min, ops.Max):
            # Per tensor as for allreduce: the gradient goes to the ranks holding
            # the extreme, shared among ties.
            saved = ctx.saved_tensors
            count = len(grads)
            masks = [(t == o).to(g.dtype)
                     for t, o, g in zip(saved[:count], saved[count:], grads)]
            ties = ops.grouped_allreduce(masks, name=None if gname is None else f"{gname}.ties",
                                         op=ops.Sum, process_set=process_set)
            totals = ops.grouped_allreduce(grads, name=gname, op=ops.Sum,
                                           process_set=process_set)
            outs = [m * t / n.clamp_min(1) for m, t, n in zip(masks, totals, ties)]
        else:
            raise RuntimeError(f"grouped_allreduce with op {ops.ReduceOp(op).name.title()} is "
                               "not differentiable")
        return (None,) * 6 + tuple(outs)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.args = (name, process_set, tuple(tensor.shape))
        return ops.allgather(tensor.detach(), name=name, process_set=process_set)

    @staticmethod
    def backward(ctx, grad):
        name, process_set, shape = ctx.args
        return _own_rows([grad], [shape], _grad_name(name), process_set)[0], None, None


def _own_rows(grads, shapes, gname, process_set):
    """Average ``grads`` over the set and cut out this rank's rows of each."""
    means = ops.grouped_allreduce([g.contiguous() for g in grads], name=gname, op=ops.Average,
                                  process_set=process_set)
    rows = torch.tensor([s[0] if s else 1 for s in shapes], dtype=torch.int64).reshape(1, -1)
    counts = ops.allgather(rows, name=None if gname is None else f"{gname}.rows",
                           process_set=process_set)
    starts = counts[:process_set.rank()].sum(dim=0)
    return [m[int(st):int(st) + (s[0] if s else 1)].reshape(s)
            for m, st, s in zip(means, starts.tolist(), shapes)]


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.args = (name, process_set, [tuple(t.shape) for t in tensors])
        return tuple(ops.grouped_allgather([t.detach() for t in tensors], name=name,
                                           process_set=process_set))

    @staticmethod
    def backward(ctx, *grads):
        name, process_set, shapes = ctx.args
        return (None, None) + tuple(_own_rows(grads, shapes, _grad_name(name), process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.args = (root_rank, name, process_set)
        return ops.broadcast(tensor.detach(), root_rank, name=name, process_set=process_set)

    @staticmethod
    def backward(ctx, grad):
        root_rank, name, process_set = ctx.args
        mean = ops.allreduce(grad.contiguous(), name=_grad_name(name), op=ops.Average,
                             process_set=process_set)
        # root_rank is a global rank, also inside a process set.
        if api.rank() != root_rank:
            mean = torch.zeros_like(mean)
        return mean, None, None, None


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = ops.alltoall(tensor.detach(), splits=splits, name=name,
                                     process_set=process_set)
        ctx.args = (received, name, process_set)
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        received, name, process_set = ctx.args
        g, _ = ops.alltoall(grad.contiguous(), splits=received, name=_grad_name(name),
                            process_set=process_set)
        return g, None, None, None


def _scatter_grad_factor(op, process_set, prescale, postscale) -> float:
    factor = float(prescale) * float(postscale)
    if ops.ReduceOp(op) == ops.Sum:
        factor *= process_set.size()
    return factor


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale, postscale, compression):
        ctx.args = (name, op, process_set, prescale, postscale)
        return ops.reducescatter(tensor.detach(), name=name, compression=compression, op=op,
                                 process_set=process_set, prescale_factor=prescale,
                                 postscale_factor=postscale)

    @staticmethod
    def backward(ctx, grad):
        name, op, process_set, prescale, postscale = ctx.args
        factor = _scatter_grad_factor(op, process_set, prescale, postscale)
        g = grad.contiguous() if factor == 1.0 else grad * factor
        g = ops.allgather(g, name=_grad_name(name), process_set=process_set)
        return g, None, None, None, None, None, None


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale, postscale, compression, *tensors):
        ctx.args = (name, op, process_set, prescale, postscale)
        return tuple(ops.grouped_reducescatter(
            [t.detach() for t in tensors], name=name, compression=compression, op=op,
            process_set=process_set, prescale_factor=prescale, postscale_factor=postscale))

    @staticmethod
    def backward(ctx, *grads):
        name, op, process_set, prescale, postscale = ctx.args
        factor = _scatter_grad_factor(op, process_set, prescale, postscale)
        scaled = [g.contiguous() if factor == 1.0 else g * factor for g in grads]
        outs = ops.grouped_allgather(scaled, name=_grad_name(name), process_set=process_set)
        return (None,) * 6 + tuple(outs)


# -- the synchronous forms hvdlike.torch exports -------------------------------------


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` across ranks (default op Average); differentiable.

    Example:
        >>> total = hvd.allreduce(torch.ones(3), op=hvd.Sum)   # == size() * ones
    """
    if not _wants_grad(tensor):
        return ops.allreduce(tensor, average, name, compression, op, prescale_factor,
                             postscale_factor, process_set)
    reduce_op = ops.core.check_op(ops._reduce_op(average, op, "allreduce"), "allreduce")
    return _Allreduce.apply(tensor, name, reduce_op, prescale_factor,
                            postscale_factor, process_set, compression)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set):
    """Allreduce a list of tensors as one unit; differentiable as :func:`allreduce` is
    (Sum, Average, Min, Max; with Product or Adasum the forward runs and only a
    backward through it raises)."""
    if not (isinstance(tensors, (list, tuple)) and any(_wants_grad(t) for t in tensors)):
        return ops.grouped_allreduce(tensors, average, name, compression, op, prescale_factor,
                                     postscale_factor, process_set)
    reduce_op = ops.core.check_op(ops._reduce_op(average, op, "grouped_allreduce"),
                                  "grouped_allreduce")
    return list(_GroupedAllreduce.apply(name, reduce_op, prescale_factor, postscale_factor,
                                        process_set, compression, *tensors))


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along dimension 0; differentiable."""
    if not _wants_grad(tensor):
        return ops.allgather(tensor, name, process_set)
    return _Allgather.apply(tensor, name, process_set)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Return ``root_rank``'s ``tensor`` on every rank; differentiable."""
    if not _wants_grad(tensor):
        return ops.broadcast(tensor, root_rank, name, process_set)
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Exchange slices of ``tensor`` between ranks; differentiable.

    Returns the received tensor, or ``(received, received_splits)`` when
    ``splits`` is given (see :func:`hvdlike.torch.ops.alltoall`).
    """
    if not _wants_grad(tensor):
        return ops.alltoall(tensor, splits, name, process_set)
    explicit = splits
    if splits is None:
        n = process_set.size()
        if tensor.dim() == 0 or tensor.shape[0] % n:
            return ops.alltoall(tensor, None, name, process_set)  # raises the usual error
        # Explicit even splits make the forward report what it received,
        # which the backward needs to send gradients back.
        explicit = [tensor.shape[0] // n] * n
    out, received = _Alltoall.apply(tensor, explicit, name, process_set)
    return out if splits is None else (out, received)


def reducescatter(tensor, name=None, compression=Compression.none, op=ops.Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce across ranks and keep this rank's part of dimension 0; differentiable."""
    if not _wants_grad(tensor):
        return ops.reducescatter(tensor, name, compression, op, process_set, prescale_factor,
                                 postscale_factor)
    return _Reducescatter.apply(tensor, name, op, process_set, prescale_factor,
                                postscale_factor, compression)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Allgather a list of tensors as one unit; differentiable."""
    if not (isinstance(tensors, (list, tuple)) and any(_wants_grad(t) for t in tensors)):
        return ops.grouped_allgather(tensors, name, process_set)
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=ops.Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """Reducescatter a list of tensors as one unit; differentiable."""
    if not (isinstance(tensors, (list, tuple)) and any(_wants_grad(t) for t in tensors)):
        return ops.grouped_reducescatter(tensors, name, compression, op, process_set,
                                         prescale_factor, postscale_factor)
    return list(_GroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                            postscale_factor, compression, *tensors))


# Called while torch.compile traces, these run as graph breaks (see
# hvdlike.frontend.compile_guard).
(allreduce, grouped_allreduce, allgather, grouped_allgather, broadcast, alltoall, reducescatter,
 grouped_reducescatter) = map(eager, (allreduce, grouped_allreduce, allgather, grouped_allgather,
                                      broadcast, alltoall, reducescatter,
                                      grouped_reducescatter))
