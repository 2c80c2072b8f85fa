"""hvdlike.keras: Horovod's Keras API for Keras 3 on the torch or JAX backend.

    import os
    os.environ.setdefault("KERAS_BACKEND", "torch")    # or "jax"; before importing keras
    import keras
    import hvdlike.keras as hvd

    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x_shard, y_shard, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(0.01 * hvd.size(), warmup_epochs=3),
    ], verbose=1 if hvd.rank() == 0 else 0)

Gradients are averaged by the backend's own front end (``hvdlike.torch`` or
``hvdlike.jax``; on JAX from inside the jitted train step). No TensorFlow is
needed. Knobs, errors and process sets are those of every other front end.
"""

from hvdlike.core.api import (
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init,
    is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
    mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size, start_timeline,
    stop_timeline,
)
from hvdlike.core.errors import HorovodInternalError, HvdlikeInternalError, MismatchError
from hvdlike.core.messages import ReduceOp
from hvdlike.core.process_sets import (
    ProcessSet, add_process_set, global_process_set, remove_process_set,
)
from hvdlike.frontend import barrier, join
from hvdlike.frontend.objects import allgather_object, broadcast_object_for

from .backend import (
    Compression, allgather, allreduce, broadcast, broadcast_variables, grouped_allreduce,
    reducescatter,
)
from . import callbacks  # after .backend: its import error is the helpful one
from . import elastic
from .callbacks import (
    BestModelCheckpoint, BroadcastGlobalVariablesCallback, LearningRateScheduleCallback,
    LearningRateWarmupCallback, MetricAverageCallback,
)
from .errors import original_error, original_errors
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer
from .saving import broadcast_global_variables, load_model

broadcast_object = broadcast_object_for("hvdlike.keras")

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

__all__ = [
    "Adasum", "Average", "BestModelCheckpoint", "BroadcastGlobalVariablesCallback",
    "Compression", "DistributedOptimizer", "HorovodInternalError", "HvdlikeInternalError",
    "LearningRateScheduleCallback", "LearningRateWarmupCallback", "Max",
    "MetricAverageCallback", "Min", "MismatchError", "PartialDistributedOptimizer",
    "ProcessSet", "Product", "Sum",
    "add_process_set", "allgather", "allgather_object", "allreduce", "barrier", "broadcast",
    "broadcast_global_variables", "broadcast_object", "broadcast_variables", "callbacks",
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic",
    "gloo_built", "gloo_enabled", "global_process_set", "grouped_allreduce", "init",
    "is_homogeneous", "is_initialized", "join", "load_model", "local_rank", "local_size",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "original_error",
    "original_errors", "rank",
    "reducescatter", "remove_process_set", "rocm_built", "shutdown", "size", "start_timeline",
    "stop_timeline",
]
