"""Collectives on torch tensors, with Horovod's names and signatures.

Each collective is implemented once, as an entry builder in
:mod:`hvdlike.core.collectives`; the forms of Horovod's naming grid

    allreduce  allreduce_async  allreduce_  allreduce_async_  grouped_allreduce ...

are thin wrappers here: ``*_async`` submits and returns a handle, the plain
form synchronizes it, ``_`` asks the builder to write into the input, and
``grouped_*`` submits a list as one unit.
"""

from __future__ import annotations

import numbers
from typing import Any, List, Optional

import torch

from hvdlike.core import api, collectives as core
from hvdlike.core.handles import Handle
from hvdlike.core.messages import ReduceOp
from hvdlike.core.process_sets import global_process_set
from hvdlike.frontend.caller import deprecated_average
from hvdlike.frontend.compile_guard import eager, is_compiling, outside
from hvdlike.frontend.submit import (  # noqa: F401  (shared by every front end)
    GroupHandle, barrier, join, name_for as _name, poll, run as _run_one,
    set_size as _set_size, submit, submit_one as _submit_one, synchronize, wait as _wait,
)

from .compression import Compression

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT


def _reduce_op(average: Optional[bool], op: Any, what: str) -> ReduceOp:
    if average is not None:
        if op is not None:
            raise ValueError(f"{what}: pass either op or the deprecated average, not both")
        deprecated_average(what)
        return Average if average else Sum
    return Average if op is None else op


def _check_device(tensor, what: str) -> None:
    """Only CPU and CUDA tensors can be communicated.

    Anything else (a ``meta`` tensor of a model built for deferred
    initialization, say) would reach the data plane and fail the runtime for
    every later collective, so it is refused here, before it is submitted.
    """
    if not isinstance(tensor, torch.Tensor):
        return
    if type(tensor) is not torch.Tensor and not tensor.is_sparse:
        problem = core.kind_problem(tensor)  # a subclass: DTensor, FakeTensor ...
        if problem is not None:
            raise TypeError(f"{what}: cannot communicate {problem}")
    if not tensor.is_cpu and not tensor.is_cuda:
        raise TypeError(f"{what}: cannot communicate a tensor on device "
                        f"{tensor.device.type!r}; hvdlike.torch moves CPU and CUDA tensors "
                        "(materialize it or move it with .cpu() / .cuda() first)")


def _check_devices(tensors, what: str) -> None:
    if isinstance(tensors, (list, tuple)):
        for t in tensors:
            _check_device(t, what)
    else:
        _check_device(tensors, what)


def _scale(value, argument: str, what: str) -> float:
    """``value`` as a float, or a TypeError naming ``argument``."""
    if type(value) is float:
        return value
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor)) or (
            isinstance(value, torch.Tensor) and (value.numel() != 1 or value.is_complex())):
        raise TypeError(f"{what}: {argument} must be a real number, got "
                        f"{type(value).__name__} {value!r:.60}")
    return float(value)


def _check_compression(compression, what: str) -> None:
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError(f"{what}: compression needs compress() and decompress() (use "
                        "Compression.none/.fp16/.bf16 or a Compressor subclass), got "
                        f"{type(compression).__name__}")


def _submit(entries, process_set):
    return submit(entries, process_set, "hvdlike.torch")


def _run(entry, process_set):
    return _run_one(entry, process_set, "hvdlike.torch")


# -- allreduce -----------------------------------------------------------------------


def _allreduce_entries(tensors, name, inplace, op, prescale_factor, postscale_factor,
                       process_set, grouped):
    what = "grouped_allreduce" if grouped else "allreduce"
    reduce_op = core.check_op(op, what)  # before naming: a bad op takes no automatic name
    _check_devices(tensors, what)
    prescale_factor = _scale(prescale_factor, "prescale_factor", what)
    postscale_factor = _scale(postscale_factor, "postscale_factor", what)
    if grouped:
        return core.grouped(core.allreduce_entry, tensors, _name(name, what, process_set), what,
                            op=reduce_op, prescale_factor=prescale_factor,
                            postscale_factor=postscale_factor, inplace=inplace)
    return [core.allreduce_entry(tensors, _name(name, what, process_set), reduce_op,
                                 prescale_factor, postscale_factor, inplace)]


def _allreduce_async(tensor, name, inplace, op, prescale_factor, postscale_factor,
                     process_set, layout: str = "") -> Handle:
    # _allreduce_entries and _submit for one tensor, flattened: the call
    # submitted by the hundred per step, where each Python call layer counts.
    if is_compiling():  # see hvdlike.frontend.compile_guard
        return _allreduce_async_outside(tensor, name, inplace, op, prescale_factor,
                                        postscale_factor, process_set, layout)
    reduce_op = core.check_op(op, "allreduce")  # before naming, as there
    if type(tensor) is not torch.Tensor or not tensor.is_cpu:
        _check_device(tensor, "allreduce")
    if type(prescale_factor) is not float or type(postscale_factor) is not float:
        prescale_factor = _scale(prescale_factor, "prescale_factor", "allreduce")
        postscale_factor = _scale(postscale_factor, "postscale_factor", "allreduce")
    if type(name) is str and name:
        name = "allreduce." + name  # name_for's prefix, without its call
    else:
        name = _name(name, "allreduce", process_set)
    entry = core.allreduce_entry(tensor, name, reduce_op, prescale_factor, postscale_factor,
                                 inplace, layout=layout)
    if process_set is global_process_set:
        return _submit_one(entry, "hvdlike.torch")
    return submit([entry], process_set, "hvdlike.torch")[0]


_allreduce_async_outside = outside(_allreduce_async)


def fused_allreduce_async_(tensor, name, op, prescale_factor, postscale_factor, process_set,
                           layout: str) -> Handle:
    """:func:`allreduce_async_` of a buffer that fuses tensors of the shapes ``layout``
    names (``DistributedOptimizer``'s buckets): ranks whose buffers fuse other
    shapes fail with a ``MismatchError``, even where the total sizes agree."""
    return _allreduce_async(tensor, name, True, op, prescale_factor, postscale_factor,
                            process_set, layout)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set) -> Handle:
    """Start an allreduce of ``tensor``; returns a handle for :func:`synchronize`."""
    op = _reduce_op(average, op, "allreduce_async")
    return _allreduce_async(tensor, name, False, op, prescale_factor, postscale_factor,
                            process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set) -> Handle:
    """In-place :func:`allreduce_async`: the result overwrites ``tensor``."""
    op = _reduce_op(average, op, "allreduce_async_")
    return _allreduce_async(tensor, name, True, op, prescale_factor, postscale_factor,
                            process_set)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` across ranks (default op Average) and return the result.

    Example:
        >>> total = hvd.allreduce(torch.ones(3), op=hvd.Sum)   # == size() * ones
    """
    _check_compression(compression, "allreduce")
    compressed, ctx = compression.compress(tensor)
    op = _reduce_op(average, op, "allreduce")
    entries = _allreduce_entries(compressed, name, False, op, prescale_factor, postscale_factor,
                                 process_set, False)
    return compression.decompress(_run(entries[0], process_set), ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """In-place :func:`allreduce`; returns ``tensor``."""
    op = _reduce_op(average, op, "allreduce_")
    entries = _allreduce_entries(tensor, name, True, op, prescale_factor, postscale_factor,
                                 process_set, False)
    return _run(entries[0], process_set)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> GroupHandle:
    op = _reduce_op(average, op, "grouped_allreduce_async")
    entries = _allreduce_entries(tensors, name, False, op, prescale_factor, postscale_factor,
                                 process_set, True)
    return GroupHandle(_submit(entries, process_set))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> GroupHandle:
    op = _reduce_op(average, op, "grouped_allreduce_async_")
    entries = _allreduce_entries(tensors, name, True, op, prescale_factor, postscale_factor,
                                 process_set, True)
    return GroupHandle(_submit(entries, process_set))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set) -> List:
    """Allreduce a list of tensors as one unit (negotiated and fused together)."""
    _check_compression(compression, "grouped_allreduce")
    op, average = _reduce_op(average, op, "grouped_allreduce"), None
    pairs = [compression.compress(t) for t in tensors] if isinstance(tensors, (list, tuple)) \
        else tensors
    if isinstance(pairs, list):
        handle = grouped_allreduce_async([p[0] for p in pairs], average, name, op,
                                         prescale_factor, postscale_factor, process_set)
        return [compression.decompress(out, ctx)
                for out, (_, ctx) in zip(synchronize(handle), pairs)]
    return synchronize(grouped_allreduce_async(tensors, average, name, op, prescale_factor,
                                               postscale_factor, process_set))


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set) -> List:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


# -- allgather -----------------------------------------------------------------------


def allgather_async(tensor, name=None, process_set=global_process_set) -> Handle:
    """Start gathering ``tensor`` from every rank along dimension 0."""
    _check_device(tensor, "allgather")
    entry = core.allgather_entry(tensor, _name(name, "allgather", process_set))
    return _submit([entry], process_set)[0]


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along dimension 0 (sizes may differ)."""
    _check_device(tensor, "allgather")
    return _run(core.allgather_entry(tensor, _name(name, "allgather", process_set)), process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> GroupHandle:
    _check_devices(tensors, "grouped_allgather")
    entries = core.grouped(core.allgather_entry, tensors,
                           _name(name, "grouped_allgather", process_set),
                           "grouped_allgather")
    return GroupHandle(_submit(entries, process_set))


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> List:
    return synchronize(grouped_allgather_async(tensors, name, process_set))


# -- broadcast -----------------------------------------------------------------------


def _broadcast_entry(tensor, root_rank, name, process_set, inplace):
    # root_rank is a global rank, as in Horovod; the runtime maps it into the set.
    _check_device(tensor, "broadcast")
    return core.broadcast_entry(tensor, root_rank, api.size(),
                                _name(name, "broadcast", process_set), inplace=inplace)


def _broadcast_async(tensor, root_rank, name, process_set, inplace) -> Handle:
    return _submit([_broadcast_entry(tensor, root_rank, name, process_set, inplace)],
                   process_set)[0]


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    """Start broadcasting ``tensor`` from ``root_rank``; returns a handle."""
    return _broadcast_async(tensor, root_rank, name, process_set, False)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    return _broadcast_async(tensor, root_rank, name, process_set, True)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Return ``root_rank``'s ``tensor`` on every rank."""
    return _run(_broadcast_entry(tensor, root_rank, name, process_set, False), process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``tensor`` with ``root_rank``'s value; returns ``tensor``."""
    return _run(_broadcast_entry(tensor, root_rank, name, process_set, True), process_set)


# -- alltoall ------------------------------------------------------------------------


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> Handle:
    """Start an alltoall; ``splits[i]`` rows of ``tensor`` go to rank ``i``.

    ``synchronize()`` of the handle returns ``(received, received_splits)``
    whether or not ``splits`` was given, as Horovod's does (only the
    synchronous :func:`alltoall` drops the splits when none were passed).
    """
    return _submit([_alltoall_entry(tensor, splits, name, process_set)], process_set)[0]


def _alltoall_entry(tensor, splits, name, process_set, bare: bool = False):
    _check_device(tensor, "alltoall")
    entry = core.alltoall_entry(tensor, splits, _set_size(process_set),
                                _name(name, "alltoall", process_set))
    if bare:
        entry.finish = lambda result: result[0]
    return entry


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Scatter slices of ``tensor`` to every rank and gather theirs.

    Returns the received tensor; when ``splits`` is given, returns
    ``(received, received_splits)`` where ``received_splits[i]`` rows came
    from rank ``i``.
    """
    return _run(_alltoall_entry(tensor, splits, name, process_set, bare=splits is None),
                process_set)


# -- reducescatter -------------------------------------------------------------------


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> Handle:
    """Start a reducescatter: reduce across ranks, keep this rank's slice of dim 0."""
    _check_device(tensor, "reducescatter")
    prescale_factor = _scale(prescale_factor, "prescale_factor", "reducescatter")
    postscale_factor = _scale(postscale_factor, "postscale_factor", "reducescatter")
    entry = core.reducescatter_entry(tensor, _name(name, "reducescatter", process_set), op,
                                     prescale_factor, postscale_factor)
    return _submit([entry], process_set)[0]


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` across ranks and return this rank's part of dimension 0.

    Rank ``r`` receives ``d // size`` rows, plus one if ``r < d % size``.
    """
    _check_compression(compression, "reducescatter")
    compressed, ctx = compression.compress(tensor)
    handle = reducescatter_async(compressed, name, op, process_set, prescale_factor,
                                 postscale_factor)
    return compression.decompress(synchronize(handle), ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> GroupHandle:
    _check_devices(tensors, "grouped_reducescatter")
    prescale_factor = _scale(prescale_factor, "prescale_factor", "grouped_reducescatter")
    postscale_factor = _scale(postscale_factor, "postscale_factor", "grouped_reducescatter")
    entries = core.grouped(core.reducescatter_entry, tensors,
                           _name(name, "grouped_reducescatter", process_set),
                           "grouped_reducescatter", op=op,
                           prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    return GroupHandle(_submit(entries, process_set))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0) -> List:
    _check_compression(compression, "grouped_reducescatter")
    if not isinstance(tensors, (list, tuple)):
        raise TypeError("grouped_reducescatter expects a list of tensors, got "
                        f"{type(tensors).__name__}")
    pairs = [compression.compress(t) for t in tensors]
    handle = grouped_reducescatter_async([p[0] for p in pairs], name, op, process_set,
                                         prescale_factor, postscale_factor)
    return [compression.decompress(out, ctx) for out, (_, ctx) in zip(synchronize(handle), pairs)]


# -- barrier and join ----------------------------------------------------------------


# Called while torch.compile traces, these run as graph breaks (see
# hvdlike.frontend.compile_guard).
(allreduce, allreduce_, grouped_allreduce_async, grouped_allreduce_async_, grouped_allreduce,
 grouped_allreduce_, allgather_async, allgather, grouped_allgather_async, grouped_allgather,
 broadcast_async, broadcast_async_, broadcast, broadcast_, alltoall_async, alltoall,
 reducescatter_async, reducescatter, grouped_reducescatter_async, grouped_reducescatter) = map(
    eager, (allreduce, allreduce_, grouped_allreduce_async, grouped_allreduce_async_,
            grouped_allreduce, grouped_allreduce_, allgather_async, allgather,
            grouped_allgather_async, grouped_allgather, broadcast_async, broadcast_async_,
            broadcast, broadcast_, alltoall_async, alltoall, reducescatter_async, reducescatter,
            grouped_reducescatter_async, grouped_reducescatter))
