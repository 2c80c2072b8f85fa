"""hvdlike.numpy: Horovod-style collectives on numpy arrays.

    import numpy as np
    import hvdlike.numpy as hvd

    hvd.init()
    total = hvd.allreduce(np.ones(3, np.float32), op=hvd.Sum)   # == size() * ones
    parts = hvd.allgather(np.full((hvd.rank() + 1, 2), hvd.rank()))

Arrays are wrapped for the core without copying wherever their layout allows
(any native-endian array with non-negative strides); results are new numpy
arrays of the input's dtype, or the input itself for the in-place ``*_``
forms. Knobs, errors and process sets are those of every other front end.
"""

from hvdlike.core.api import (
    cross_rank, cross_size, init, is_homogeneous, is_initialized, local_rank, local_size, rank,
    shutdown, size, start_timeline, stop_timeline,
)
from hvdlike.core.errors import HorovodInternalError, HvdlikeInternalError, MismatchError
from hvdlike.core.messages import ReduceOp
from hvdlike.core.process_sets import (
    ProcessSet, add_process_set, global_process_set, remove_process_set,
)
from hvdlike.frontend import ArrayOps, barrier, join, poll, synchronize
from hvdlike.frontend.objects import allgather_object, broadcast_object_for

from . import elastic
from .convert import NumpyAdapter

broadcast_object = broadcast_object_for("hvdlike.numpy")

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

_ops = ArrayOps(NumpyAdapter())

allreduce = _ops.allreduce
allreduce_async = _ops.allreduce_async
allreduce_ = _ops.allreduce_
allreduce_async_ = _ops.allreduce_async_
grouped_allreduce = _ops.grouped_allreduce
grouped_allreduce_async = _ops.grouped_allreduce_async
grouped_allreduce_ = _ops.grouped_allreduce_
grouped_allreduce_async_ = _ops.grouped_allreduce_async_
allgather = _ops.allgather
allgather_async = _ops.allgather_async
grouped_allgather = _ops.grouped_allgather
grouped_allgather_async = _ops.grouped_allgather_async
broadcast = _ops.broadcast
broadcast_async = _ops.broadcast_async
broadcast_ = _ops.broadcast_
broadcast_async_ = _ops.broadcast_async_
alltoall = _ops.alltoall
alltoall_async = _ops.alltoall_async
reducescatter = _ops.reducescatter
reducescatter_async = _ops.reducescatter_async
grouped_reducescatter = _ops.grouped_reducescatter
grouped_reducescatter_async = _ops.grouped_reducescatter_async

__all__ = [
    "Average", "HorovodInternalError", "HvdlikeInternalError", "Max", "Min", "MismatchError",
    "ProcessSet", "Product", "Sum", "add_process_set", "allgather", "allgather_async", "allgather_object",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
    "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "cross_rank", "cross_size", "global_process_set",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join",
    "local_rank", "local_size", "poll", "rank", "reducescatter", "reducescatter_async",
    "remove_process_set", "shutdown", "size", "start_timeline", "stop_timeline", "synchronize",
]
