"""``horovod.torch.mpi_ops`` under its Horovod name: the collectives and basics.

Horovod users import from here (``from horovod.torch.mpi_ops import
allreduce_async_, synchronize, Average``); the same names resolve to the
functions :mod:`hvdlike.torch` exports. No MPI is involved: the name is kept
so imports keep working.
"""

from hvdlike.core.api import (  # noqa: F401
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init,
    is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
    mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size, start_timeline,
    stop_timeline,
)
from hvdlike.core.errors import HorovodInternalError  # noqa: F401
from hvdlike.core.process_sets import (  # noqa: F401
    ProcessSet, add_process_set, global_process_set, remove_process_set,
)

from .ops import (  # noqa: F401
    Adasum, Average, Max, Min, Product, Sum, allgather_async, allreduce_, allreduce_async,
    allreduce_async_, alltoall_async, barrier, broadcast_, broadcast_async, broadcast_async_,
    grouped_allgather_async, grouped_allreduce_,
    grouped_allreduce_async, grouped_allreduce_async_,
    grouped_reducescatter_async, join, poll, reducescatter_async, synchronize,
)
from .autograd import (  # noqa: F401
    allgather, allreduce, alltoall, broadcast, grouped_allgather, grouped_allreduce,
    grouped_reducescatter, reducescatter,
)
from .sparse import sparse_allreduce_async  # noqa: F401
