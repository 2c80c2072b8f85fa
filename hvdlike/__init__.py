"""hvdlike: Horovod-style data-parallel training on torch.distributed.

Framework-neutral entry points live here; collectives live in the front
ends (``hvdlike.torch``, ``hvdlike.numpy``, ...). The runtime's names are
resolved on first use, so ``import hvdlike`` (and the ``hvdlike-run``
launcher, which lives inside the package) costs no torch import, and no
front end ever imports jax or keras unless asked to.
"""

import importlib

from hvdlike.core.errors import (
    ConfigError, HorovodInternalError, HvdlikeError, HvdlikeInternalError, MismatchError,
)

__version__ = "0.1.0"

_API = (
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built",
    "gloo_enabled", "init", "is_homogeneous", "is_initialized", "local_rank", "local_size",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "rocm_built",
    "shutdown", "size", "start_timeline", "stop_timeline",
)
_PROCESS_SETS = ("ProcessSet", "add_process_set", "global_process_set", "remove_process_set")
_LAZY = {**{name: "hvdlike.core.api" for name in _API},
         **{name: "hvdlike.core.process_sets" for name in _PROCESS_SETS}}

__all__ = sorted([*_LAZY, "ConfigError", "HorovodInternalError", "HvdlikeError",
                  "HvdlikeInternalError", "MismatchError", "run", "__version__"])


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hvdlike' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def run(fn, args=(), kwargs=None, np=None, hosts=None, **options):
    """Run ``fn(*args, **kwargs)`` on ``np`` ranks (default: every slot of ``hosts``,
    else 1, as in Horovod) and return the per-rank results. Takes ``horovod.run``'s arguments too.

    See :func:`hvdlike.launcher.api.run` for every option.
    """
    from hvdlike.launcher.api import run as _run

    return _run(fn, args=args, kwargs=kwargs, np=np, hosts=hosts, **options)
