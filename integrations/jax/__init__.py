"""hvdlike.jax: Horovod-style collectives and optax integration for JAX (CPU).

    import jax, optax
    import hvdlike.jax as hvd

    hvd.init()
    params = hvd.broadcast_pytree(init_params(jax.random.key(0)), root_rank=0)
    tx = hvd.DistributedOptimizer(optax.sgd(0.1))      # averages gradients over ranks
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

CPU ``jax.Array`` inputs are shared with the core through DLPack (no copy);
results are JAX arrays of the input dtype. The synchronous collectives also
work inside ``jax.jit`` (staged as ordered host callbacks); ``*_async``
handles are for eager code. Knobs, errors and process sets are those of every
other front end.

JAX reports an exception raised inside a jitted function as
``jax.errors.JaxRuntimeError``; ``hvd.jit`` (``jax.jit`` with the same
arguments) and ``with hvd.original_errors():`` raise the hvdlike exception
instead (``HorovodInternalError`` for a lost peer, ``MismatchError`` ...),
and ``hvd.elastic.run`` sees through the JAX error on its own.
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
from hvdlike.frontend import barrier, join, poll, synchronize
from hvdlike.frontend.objects import allgather_object, broadcast_object_for

from . import elastic
from .errors import jit, original_error, original_errors
from .ops import allgather, allreduce, alltoall, broadcast, grid, grouped_allreduce, reducescatter
from .optimizer import DistributedOptimizer, allreduce_gradients
from .pytree import allreduce_pytree, broadcast_pytree, broadcast_variables

broadcast_object = broadcast_object_for("hvdlike.jax")

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

allreduce_async = grid.allreduce_async
grouped_allreduce_async = grid.grouped_allreduce_async
allgather_async = grid.allgather_async
grouped_allgather = grid.grouped_allgather
grouped_allgather_async = grid.grouped_allgather_async
broadcast_async = grid.broadcast_async
alltoall_async = grid.alltoall_async
reducescatter_async = grid.reducescatter_async
grouped_reducescatter = grid.grouped_reducescatter
grouped_reducescatter_async = grid.grouped_reducescatter_async

__all__ = [
    "Average", "DistributedOptimizer", "HorovodInternalError", "HvdlikeInternalError", "Max",
    "Min", "MismatchError", "ProcessSet", "Product", "Sum", "add_process_set", "allgather",
    "allgather_async", "allgather_object", "allreduce", "allreduce_async",
    "allreduce_gradients", "allreduce_pytree", "alltoall", "alltoall_async", "barrier",
    "broadcast", "broadcast_async", "broadcast_object", "broadcast_pytree",
    "broadcast_variables", "cross_rank", "cross_size", "global_process_set",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
    "grouped_allreduce_async", "grouped_reducescatter", "grouped_reducescatter_async", "init",
    "is_homogeneous", "is_initialized", "jit", "join", "local_rank", "local_size",
    "original_error", "original_errors", "poll", "rank", "reducescatter",
    "reducescatter_async", "remove_process_set", "shutdown", "size", "synchronize", "start_timeline", "stop_timeline",
]
