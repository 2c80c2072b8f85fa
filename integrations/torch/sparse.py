"""Allreduce of sparse COO tensors by gathering indices and values.

A sparse gradient (``nn.Embedding(sparse=True)``) touches a few rows. Summing
it as a dense tensor moves every row; gathering each rank's ``(index, value)``
pairs moves only the touched ones. As in Horovod, the result is the
concatenation in rank order, not coalesced: rows several ranks touched appear
once per rank and add up when it is coalesced or used. The cost grows with the
number of ranks, so for dense-ish gradients ``sparse_as_dense=True`` is the
better choice.
"""

from __future__ import annotations

from typing import Any, List

import torch

from hvdlike.core.process_sets import global_process_set
from hvdlike.frontend.compile_guard import eager

from . import ops


class SparseHandle(ops.GroupHandle):
    """Handle of :func:`sparse_allreduce_async`; :func:`synchronize` returns a sparse tensor."""

    def __init__(self, handles, shape, average: bool, size: int):
        super().__init__(handles)
        self._shape = shape
        self._average = average
        self._size = size

    def __call__(self) -> torch.Tensor:
        """Wait and return the result: Horovod's sparse handle is a callable."""
        return ops.synchronize(self)

    def result(self, results: List[Any]) -> torch.Tensor:
        indices, values = results[:2]
        if self._average:
            values = values / self._size
        # Indices come from every rank's tensor of this shape: valid by construction.
        return torch.sparse_coo_tensor(indices.t(), values, self._shape, check_invariants=False)


def sparse_allreduce_async(tensor, name=None, op=ops.Average,
                           process_set=global_process_set) -> SparseHandle:
    """Start reducing a sparse COO tensor across ranks (op Average or Sum).

    Returns:
        A handle; ``hvd.synchronize(handle)`` (or calling it) returns the sum
        (or average) of every rank's ``tensor`` as a sparse tensor holding every
        rank's entries in rank order, uncoalesced (as Horovod's).

    Raises:
        TypeError: ``tensor`` is not a sparse COO tensor.
        ValueError: ``op`` is neither Average nor Sum.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError("sparse_allreduce_async expects a sparse COO tensor, got "
                        f"{type(tensor).__name__ if not isinstance(tensor, torch.Tensor) else tensor.layout}")
    op = ops.ReduceOp(op)
    if op not in (ops.Average, ops.Sum):
        raise ValueError(f"sparse_allreduce_async supports op Average or Sum, got {op.name.title()}")
    if name is None:
        name = ops._name(None, "sparse_allreduce", process_set)
    # Gather (nnz, sparse_dim) index rows so ranks may hold different nnz; the
    # entries as they are, duplicates included (Horovod sends them so too).
    indices = tensor._indices().t().contiguous()
    values = tensor._values().contiguous()
    # The indices say nothing of the dense size: ranks holding tensors of
    # different shapes would build a result whose indices fall outside it.
    # An empty tensor whose trailing dimensions are that shape makes the
    # coordinator compare the shapes (a MismatchError on every rank) and moves
    # no data.
    shape = torch.empty((0,) + tuple(tensor.shape), dtype=torch.uint8)
    handles = [ops.allgather_async(indices, name=f"{name}.indices", process_set=process_set),
               ops.allgather_async(values, name=f"{name}.values", process_set=process_set),
               ops.allgather_async(shape, name=f"{name}.dense_shape", process_set=process_set)]
    size = ops._set_size(process_set)
    return SparseHandle(handles, tuple(tensor.shape), op == ops.Average, size)


# Called while torch.compile traces, these run as graph breaks (see
# hvdlike.frontend.compile_guard).
sparse_allreduce_async = eager(sparse_allreduce_async)
