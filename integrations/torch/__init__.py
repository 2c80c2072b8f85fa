"""hvdlike.torch: a drop-in for ``horovod.torch``.

    import hvdlike.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size()),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
"""

from hvdlike.core.api import (
    ccl_built, check_extension, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
    gloo_enabled, init, is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
    mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size,
    start_timeline, stop_timeline,
)
from hvdlike.core.errors import HorovodInternalError, HvdlikeInternalError
from hvdlike.core.process_sets import (
    ProcessSet, add_process_set, global_process_set, remove_process_set,
)

from . import elastic
from .compression import Compression
from hvdlike.frontend.objects import allgather_object, broadcast_object
from .ops import (
    Adasum, Average, Max, Min, Product, Sum, allgather_async, allreduce_, allreduce_async,
    allreduce_async_, alltoall_async, barrier, broadcast_, broadcast_async, broadcast_async_,
    grouped_allgather_async, grouped_allreduce_,
    grouped_allreduce_async, grouped_allreduce_async_,
    grouped_reducescatter_async, join, poll, reducescatter_async, synchronize,
)
# The synchronous forms are differentiable when their input requires grad.
from .autograd import (
    allgather, allreduce, alltoall, broadcast, grouped_allgather, grouped_allreduce,
    grouped_reducescatter, reducescatter,
)
from .functions import broadcast_optimizer_state, broadcast_parameters
from .optimizer import DistributedOptimizer
from .sparse import sparse_allreduce_async
from .sync_batch_norm import SyncBatchNorm
from . import mpi_ops  # noqa: F401 - hvd.mpi_ops without an import, as in Horovod

