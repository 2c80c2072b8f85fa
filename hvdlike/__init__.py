"""hvdlike: Horovod-style data-parallel training on torch.distributed.

Framework-neutral entry points live here; collectives live in the front
ends (``hvdlike.torch``, ``hvdlike.numpy``, ...), which import their framework
lazily so ``import hvdlike`` pulls in none of them.
"""

from hvdlike.core.api import (
    ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init,
    is_homogeneous, is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
    mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size, start_timeline,
    stop_timeline,
)
from hvdlike.core.errors import (
    ConfigError, HorovodInternalError, HvdlikeError, HvdlikeInternalError, MismatchError,
)
from hvdlike.core.process_sets import (
    ProcessSet, add_process_set, global_process_set, remove_process_set,
)

__version__ = "0.1.0"


def run(fn, args=(), kwargs=None, np=2, hosts=None, **options):
    """Run ``fn(*args, **kwargs)`` on ``np`` ranks and return the per-rank results.

    See :func:`hvdlike.launcher.api.run` for every option.
    """
    from hvdlike.launcher.api import run as _run

    return _run(fn, args=args, kwargs=kwargs, np=np, hosts=hosts, **options)
