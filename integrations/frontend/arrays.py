"""The collective grid for any array type, generated from two conversions.

A front end supplies an :class:`Adapter`: ``to_torch`` wraps one of its
arrays as a torch tensor for the core (without copying when the layout
allows) and ``from_torch`` turns a result back into its array type.
:class:`ArrayOps` builds Horovod's naming grid on top::

    allreduce  allreduce_async  allreduce_  allreduce_async_  grouped_allreduce ...

Entries come from :mod:`hvdlike.core.collectives`; the conversion back runs in
each entry's ``finish`` hook, on the runtime's completion thread, so handles
hold front-end arrays and :func:`~.submit.synchronize` stays generic.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch

from hvdlike.core import api, collectives as core
from hvdlike.core.errors import HvdlikeError
from hvdlike.core.handles import Handle
from hvdlike.core.messages import ReduceOp
from hvdlike.core.process_sets import global_process_set

from .submit import GroupHandle, name_for, run, set_size, submit, synchronize

Average = ReduceOp.AVERAGE
_REDUCING = ("allreduce", "grouped_allreduce", "reducescatter", "grouped_reducescatter")
# Unsigned integers wider than a byte (JAX's PRNG keys and RNG states are uint32)
# can be broadcast, gathered and exchanged, not reduced (core.WIDE_UNSIGNED).
_WIDE_UNSIGNED = core.WIDE_UNSIGNED


class Adapter:
    """How one front end's arrays cross into the core and back.

    Attributes:
        frontend: the module users import, used in error messages.
        inplace: whether arrays can be written in place (``allreduce_`` etc.).
    """

    frontend = "hvdlike"
    inplace = False

    def to_torch(self, value: Any, what: str, writable: bool = False) -> torch.Tensor:
        """``value`` as a torch tensor; a view of its memory when possible.

        Raises:
            TypeError: ``value`` is not an array this front end accepts; the
                message names the type and the front end.
        """
        raise NotImplementedError

    def from_torch(self, tensor: torch.Tensor, like: Any) -> Any:
        """The core's result ``tensor`` as this front end's array, shaped like ``like``."""
        raise NotImplementedError

    def write_back(self, like: Any, result: torch.Tensor) -> Any:
        """Finish an in-place call: make sure ``like`` holds ``result``; return ``like``.

        ``result`` already is ``like``'s memory when ``to_torch`` could wrap it
        without copying; otherwise it must be copied in.
        """
        raise NotImplementedError


def _chain(entry, convert: Callable[[Any], Any]) -> None:
    inner = entry.finish
    entry.finish = convert if inner is None else (lambda result: convert(inner(result)))


class ArrayOps:
    """Every collective of the grid, for the arrays of one :class:`Adapter`."""

    def __init__(self, adapter: Adapter):
        self.adapter = adapter
        self.frontend = adapter.frontend

    # -- plumbing ---------------------------------------------------------------------

    def _tensor(self, value, what: str, writable: bool = False) -> torch.Tensor:
        tensor = self.adapter.to_torch(value, what, writable)
        reducing = what.rstrip("_") in _REDUCING
        allowed = core.REDUCIBLE if reducing else core.MOVABLE
        if tensor.dtype not in allowed:
            names = ", ".join(sorted(core.dtype_name(d) for d in allowed))
            note = ""
            if tensor.dtype in _WIDE_UNSIGNED:
                note = (" (unsigned integers wider than 8 bits can be broadcast, gathered "
                        "and exchanged with alltoall, not reduced)")
            raise TypeError(f"{self.frontend}.{what}: cannot handle {type(value).__name__} of "
                            f"dtype {core.dtype_name(tensor.dtype)}; supported dtypes: "
                            f"{names}{note}")
        return tensor

    def _build(self, what: str, make: Callable[[], Any]):
        """Run a core entry builder, naming this front end in its argument errors."""
        try:
            return make()
        except (TypeError, ValueError, HvdlikeError) as exc:
            message = str(exc)
            # The core's messages mostly start with the op's name already.
            if message.startswith(what.rstrip("_")):
                message = f"{self.frontend}.{message}"
            else:
                message = f"{self.frontend}.{what}: {message}"
            kind = type(exc) if isinstance(exc, (TypeError, ValueError)) else HvdlikeError
            raise kind(message) from None

    def _convert(self, entry, like, inplace: bool = False):
        if inplace:
            _chain(entry, lambda result: self.adapter.write_back(like, result))
        else:
            _chain(entry, lambda result: self.adapter.from_torch(result, like))
        return entry

    def _submit(self, entries, process_set) -> List[Handle]:
        return submit(entries, process_set, self.frontend)

    def _run(self, entry, process_set):
        return run(entry, process_set, self.frontend)

    def _check_op(self, op, what: str):
        reduce_op = self._build(what, lambda: core.check_op(op, what))
        if reduce_op == ReduceOp.ADASUM:
            raise HvdlikeError(f"{self.frontend}.{what}: op Adasum is only available in "
                               f"hvdlike.torch; use Average or Sum")
        return reduce_op

    def _check_inplace(self, what: str) -> None:
        if not self.adapter.inplace:
            raise TypeError(f"{self.frontend}.{what}: arrays of this front end are immutable; "
                            f"use the variant without the trailing underscore")

    def _list(self, values, what: str) -> list:
        if not isinstance(values, (list, tuple)):
            raise TypeError(f"{self.frontend}.{what} expects a list of arrays, "
                            f"got {type(values).__name__}")
        return list(values)

    # -- allreduce -----------------------------------------------------------------------

    def _allreduce_entries(self, values, name, op, prescale_factor, postscale_factor,
                           inplace, grouped, process_set):
        what = base = "grouped_allreduce" if grouped else "allreduce"
        op = self._check_op(op, what)
        if inplace:
            what += "_"
            self._check_inplace(what)
        items = self._list(values, what) if grouped else [values]
        tensors = [self._tensor(v, what, inplace) for v in items]
        kwargs = dict(op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                      inplace=inplace)
        if grouped:
            entries = self._build(what, lambda: core.grouped(
                core.allreduce_entry, tensors, name_for(name, base, process_set), what, **kwargs))
        else:
            entries = [self._build(what, lambda: core.allreduce_entry(
                tensors[0], name_for(name, base, process_set), **kwargs))]
        return [self._convert(e, v, inplace) for e, v in zip(entries, items)]

    def allreduce_async(self, tensor, name: Optional[str] = None, op=Average,
                        prescale_factor=1.0, postscale_factor=1.0,
                        process_set=global_process_set) -> Handle:
        """Start an allreduce of ``tensor``; returns a handle for ``synchronize``."""
        entries = self._allreduce_entries(tensor, name, op, prescale_factor, postscale_factor,
                                          False, False, process_set)
        return self._submit(entries, process_set)[0]

    def allreduce(self, tensor, name: Optional[str] = None, op=Average, prescale_factor=1.0,
                  postscale_factor=1.0, process_set=global_process_set):
        """Reduce ``tensor`` across ranks (default op Average); returns a new array.

        ``prescale_factor`` multiplies the input before the reduction and
        ``postscale_factor`` the result after it. The result has the input's
        dtype and shape.
        """
        entries = self._allreduce_entries(tensor, name, op, prescale_factor, postscale_factor,
                                          False, False, process_set)
        return self._run(entries[0], process_set)

    def allreduce_async_(self, tensor, name: Optional[str] = None, op=Average,
                         prescale_factor=1.0, postscale_factor=1.0,
                         process_set=global_process_set) -> Handle:
        """In-place :meth:`allreduce_async`: the result overwrites ``tensor``."""
        entries = self._allreduce_entries(tensor, name, op, prescale_factor, postscale_factor,
                                          True, False, process_set)
        return self._submit(entries, process_set)[0]

    def allreduce_(self, tensor, name: Optional[str] = None, op=Average, prescale_factor=1.0,
                   postscale_factor=1.0, process_set=global_process_set):
        """In-place :meth:`allreduce`; returns ``tensor``."""
        entries = self._allreduce_entries(tensor, name, op, prescale_factor, postscale_factor,
                                          True, False, process_set)
        return self._run(entries[0], process_set)

    def grouped_allreduce_async(self, tensors, name: Optional[str] = None, op=Average,
                                prescale_factor=1.0, postscale_factor=1.0,
                                process_set=global_process_set) -> GroupHandle:
        """Start reducing a list of arrays as one unit (negotiated and fused together)."""
        entries = self._allreduce_entries(tensors, name, op, prescale_factor, postscale_factor,
                                          False, True, process_set)
        return GroupHandle(self._submit(entries, process_set))

    def grouped_allreduce(self, tensors, name: Optional[str] = None, op=Average,
                          prescale_factor=1.0, postscale_factor=1.0,
                          process_set=global_process_set) -> list:
        """Allreduce a list of arrays as one unit; returns the list of results."""
        return synchronize(self.grouped_allreduce_async(tensors, name, op, prescale_factor,
                                                        postscale_factor, process_set))

    def grouped_allreduce_async_(self, tensors, name: Optional[str] = None, op=Average,
                                 prescale_factor=1.0, postscale_factor=1.0,
                                 process_set=global_process_set) -> GroupHandle:
        entries = self._allreduce_entries(tensors, name, op, prescale_factor, postscale_factor,
                                          True, True, process_set)
        return GroupHandle(self._submit(entries, process_set))

    def grouped_allreduce_(self, tensors, name: Optional[str] = None, op=Average,
                           prescale_factor=1.0, postscale_factor=1.0,
                           process_set=global_process_set) -> list:
        """In-place :meth:`grouped_allreduce`; returns the input arrays."""
        return synchronize(self.grouped_allreduce_async_(tensors, name, op, prescale_factor,
                                                         postscale_factor, process_set))

    # -- allgather -----------------------------------------------------------------------

    def allgather_async(self, tensor, name: Optional[str] = None,
                        process_set=global_process_set) -> Handle:
        """Start gathering ``tensor`` from every rank along dimension 0."""
        t = self._tensor(tensor, "allgather")
        entry = self._build("allgather", lambda: core.allgather_entry(
            t, name_for(name, "allgather", process_set)))
        return self._submit([self._convert(entry, tensor)], process_set)[0]

    def allgather(self, tensor, name: Optional[str] = None, process_set=global_process_set):
        """Concatenate every rank's ``tensor`` along dimension 0 (first sizes may differ)."""
        return synchronize(self.allgather_async(tensor, name, process_set))

    def grouped_allgather_async(self, tensors, name: Optional[str] = None,
                                process_set=global_process_set) -> GroupHandle:
        what = "grouped_allgather"
        items = self._list(tensors, what)
        ts = [self._tensor(v, what) for v in items]
        entries = self._build(what, lambda: core.grouped(
            core.allgather_entry, ts, name_for(name, what, process_set), what))
        return GroupHandle(self._submit([self._convert(e, v) for e, v in zip(entries, items)],
                                        process_set))

    def grouped_allgather(self, tensors, name: Optional[str] = None,
                          process_set=global_process_set) -> list:
        """Allgather a list of arrays as one unit."""
        return synchronize(self.grouped_allgather_async(tensors, name, process_set))

    # -- broadcast -----------------------------------------------------------------------

    def _broadcast_async(self, tensor, root_rank, name, process_set, inplace) -> Handle:
        what = "broadcast_" if inplace else "broadcast"
        if inplace:
            self._check_inplace(what)
        t = self._tensor(tensor, what, inplace)
        # root_rank is a global rank, as in Horovod; the runtime maps it into the set.
        entry = self._build(what, lambda: core.broadcast_entry(
            t, root_rank, api.size(), name_for(name, "broadcast", process_set), inplace=inplace))
        return self._submit([self._convert(entry, tensor, inplace)], process_set)[0]

    def broadcast_async(self, tensor, root_rank: int, name: Optional[str] = None,
                        process_set=global_process_set) -> Handle:
        """Start broadcasting ``tensor`` from ``root_rank``; returns a handle."""
        return self._broadcast_async(tensor, root_rank, name, process_set, False)

    def broadcast(self, tensor, root_rank: int, name: Optional[str] = None,
                  process_set=global_process_set):
        """Return ``root_rank``'s ``tensor`` on every rank (as a new array)."""
        return synchronize(self.broadcast_async(tensor, root_rank, name, process_set))

    def broadcast_async_(self, tensor, root_rank: int, name: Optional[str] = None,
                         process_set=global_process_set) -> Handle:
        return self._broadcast_async(tensor, root_rank, name, process_set, True)

    def broadcast_(self, tensor, root_rank: int, name: Optional[str] = None,
                   process_set=global_process_set):
        """Overwrite ``tensor`` with ``root_rank``'s value; returns ``tensor``."""
        return synchronize(self.broadcast_async_(tensor, root_rank, name, process_set))

    # -- alltoall ------------------------------------------------------------------------

    def alltoall_async(self, tensor, splits=None, name: Optional[str] = None,
                       process_set=global_process_set) -> Handle:
        """Start an alltoall; ``splits[i]`` rows of ``tensor`` go to rank ``i``."""
        t = self._tensor(tensor, "alltoall")
        if splits is not None and not isinstance(splits, (list, tuple, torch.Tensor)):
            splits = _flat(splits)  # not int(): fractional splits are refused, not truncated
        entry = self._build("alltoall", lambda: core.alltoall_entry(
            t, splits, set_size(process_set), name_for(name, "alltoall", process_set)))
        convert = self.adapter.from_torch
        if splits is None:
            _chain(entry, lambda result: convert(result[0], tensor))
        else:
            _chain(entry, lambda result: (convert(result[0], tensor),
                                          convert(result[1], splits)))
        return self._submit([entry], process_set)[0]

    def alltoall(self, tensor, splits=None, name: Optional[str] = None,
                 process_set=global_process_set):
        """Scatter slices of ``tensor`` to every rank and gather theirs.

        Returns the received array; when ``splits`` is given, returns
        ``(received, received_splits)`` where ``received_splits[i]`` rows came
        from rank ``i``.
        """
        return synchronize(self.alltoall_async(tensor, splits, name, process_set))

    # -- reducescatter -------------------------------------------------------------------

    def reducescatter_async(self, tensor, name: Optional[str] = None, op=Average,
                            process_set=global_process_set, prescale_factor=1.0,
                            postscale_factor=1.0) -> Handle:
        """Start a reducescatter: reduce across ranks, keep this rank's slice of dim 0."""
        t = self._tensor(tensor, "reducescatter")
        entry = self._build("reducescatter", lambda: core.reducescatter_entry(
            t, name_for(name, "reducescatter", process_set), op, prescale_factor, postscale_factor))
        return self._submit([self._convert(entry, tensor)], process_set)[0]

    def reducescatter(self, tensor, name: Optional[str] = None, op=Average,
                      process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
        """Reduce ``tensor`` across ranks and return this rank's part of dimension 0.

        Rank ``r`` receives ``d // size`` rows, plus one if ``r < d % size``.
        """
        return synchronize(self.reducescatter_async(tensor, name, op, process_set,
                                                    prescale_factor, postscale_factor))

    def grouped_reducescatter_async(self, tensors, name: Optional[str] = None, op=Average,
                                    process_set=global_process_set, prescale_factor=1.0,
                                    postscale_factor=1.0) -> GroupHandle:
        what = "grouped_reducescatter"
        items = self._list(tensors, what)
        ts = [self._tensor(v, what) for v in items]
        entries = self._build(what, lambda: core.grouped(
            core.reducescatter_entry, ts, name_for(name, what, process_set), what, op=op,
            prescale_factor=prescale_factor, postscale_factor=postscale_factor))
        return GroupHandle(self._submit([self._convert(e, v) for e, v in zip(entries, items)],
                                        process_set))

    def grouped_reducescatter(self, tensors, name: Optional[str] = None, op=Average,
                              process_set=global_process_set, prescale_factor=1.0,
                              postscale_factor=1.0) -> list:
        """Reducescatter a list of arrays as one unit."""
        return synchronize(self.grouped_reducescatter_async(
            tensors, name, op, process_set, prescale_factor, postscale_factor))


def _flat(values):
    """Split counts given as any array type, flattened to Python scalars."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    out = []
    for v in values if isinstance(values, (list, tuple)) else [values]:
        out.extend(_flat(v) if isinstance(v, (list, tuple)) else [v])
    return out

