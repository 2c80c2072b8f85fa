"""Framework-neutral public functions: init, shutdown, topology, build queries.

These delegate to the one current :class:`~hvdlike.core.runtime.Runtime`.
Every front end re-exports them, so ``hvdlike.rank()`` and
``hvdlike.torch.rank()`` are the same function.
"""

from __future__ import annotations

import atexit
import sys
from typing import Optional, Sequence, Union

from . import current as _current
from . import process_sets as ps
from . import world as _world
from .runtime import Runtime

_SLOT = _current.SLOT


def runtime() -> Runtime:
    """The live runtime; raises :class:`NotInitializedError` before ``init()``."""
    return _current.require()


def init(comm=None, process_sets: Optional[Union[Sequence[ps.ProcessSet], str]] = None,
         **settings) -> None:
    """Start hvdlike in this process.

    Reads the rank layout from whatever launched the process (``hvdlike-run``,
    ``torchrun``, ``mpirun``, ``srun``; nothing means a job of size 1),
    connects to the other ranks and starts the background coordinator.
    Calling it again while initialized does nothing; after ``shutdown()`` it
    starts a fresh runtime.

    Args:
        comm: run on part of the launched job, as Horovod's ``comm``: a
            list of launched ranks (``COMM_WORLD`` numbering under mpirun) or,
            under mpirun, an mpi4py communicator. Its members call ``init``
            with the same list and become ranks ``0..len-1`` in its order
            (with their own local and cross ranks); disjoint lists give
            independent runtimes. None or ``[]``: every launched rank.
        process_sets: extra :class:`ProcessSet` objects to register, the same
            list in the same order on every rank (checked: a difference raises
            on every rank); or ``"dynamic"`` to allow ``add_process_set`` and
            ``remove_process_set`` later (like ``HVDLIKE_DYNAMIC_PROCESS_SETS=1``).
        **settings: knob overrides by config field name (e.g.
            ``fusion_threshold=0``); they win over the environment.

    Raises:
        ConfigError: a knob has a bad value.
        TypeError, ValueError: a bad ``comm`` (or members passed different lists).
        HvdlikeInternalError: the other ranks could not be reached.

    Example:
        >>> import hvdlike
        >>> hvdlike.init()
        >>> hvdlike.rank(), hvdlike.size()
        (0, 1)
    """
    world = _world.parse(comm)
    if isinstance(process_sets, str):
        if process_sets != "dynamic":
            raise ValueError(f"init: process_sets must be a list of ProcessSet or "
                             f"'dynamic', got {process_sets!r}")
        settings.setdefault("dynamic_process_sets", True)
        process_sets = None
    elif process_sets is not None and not isinstance(process_sets, (list, tuple)):
        raise TypeError(f"init: process_sets must be a list of ProcessSet or 'dynamic', "
                        f"got {type(process_sets).__name__}")
    start(process_sets or (), settings, world=world)
    # Horovod's global set names the communicator init() was given.
    ps.global_process_set.mpi_comm = world.comm if world is not None else None


def start(process_sets: Sequence[ps.ProcessSet], settings: dict, carried=None,
          world=None) -> None:
    """Build and start a runtime unless one is live (``init`` after its checks).

    ``carried``: what an elastic re-form takes from the previous runtime
    (see :mod:`hvdlike.core.elastic.carry`).
    """
    with _SLOT.lock:
        if _SLOT.runtime is not None and _SLOT.runtime.alive_error() is None:
            return
        if _SLOT.runtime is not None and _SLOT.runtime.forked:
            # Its environment names the parent's rank: a runtime built here would
            # join the parent's job as a second copy of that rank.
            raise _SLOT.runtime.fatal
        if _SLOT.runtime is not None:
            _SLOT.runtime.shutdown()
            _SLOT.runtime = None
        if not _SLOT.exit_hooks_installed:
            # Before the build: a rank whose init() fails (a bad knob on one
            # host) must still end an mpirun job, whose other ranks are past
            # their own init() by then and wait for it.
            atexit.register(_at_exit)
            _chain_excepthook()
            _SLOT.exit_hooks_installed = True
        built = Runtime.build(process_sets=process_sets, generation=_SLOT.next_generation(),
                              carried=carried, world=world, **settings)
        try:
            _SLOT.runtime = built.start()
        except BaseException:
            built.close()
            raise


def _at_exit() -> None:
    """The runtime's shutdown, then MPI's finalization (hvdlike's own, see
    ``mpi_bootstrap.select_libmpi``): after the MPI planes are closed."""
    try:
        shutdown()
    finally:
        from . import mpi_bootstrap

        mpi_bootstrap.finalize_at_exit()


def _chain_excepthook() -> None:
    """On an uncaught exception, leave at once instead of negotiating a shutdown.

    The traceback prints first (the previous hook runs), then the runtime is
    aborted: peers see this rank vanish, and their errors quote the reason.
    This rank exits before them, so a launcher names it as the failure.
    """
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        if _SLOT.inherited:
            return  # a forked child's failure is not its parent rank's (see current._forked)
        current = _SLOT.runtime
        if current is not None and current.topology.size > 1:
            text = str(exc).splitlines()[0] if str(exc) else ""
            current.abort(f"exited with an uncaught {exc_type.__name__}"
                          + (f": {text}" if text else ""), exiting=True)
            _abort_mpi()
        elif current is None:  # init() failed, or the job was shut down before
            if "mpi4py.MPI" not in sys.modules:
                _start_mpi_to_abort()
            _abort_mpi(only_with_peers=True)

    sys.excepthook = hook


def _start_mpi_to_abort(deadline_seconds: float = 10.0) -> None:
    """Start MPI in a rank of an mpirun job whose ``init()`` failed before it did.

    A bad knob fails ``init()`` before the bootstrap starts MPI, while the
    other ranks already wait for this one in their bootstrap's MPI calls: only
    ``MPI_Abort`` (which needs MPI started) tells mpirun to end the job; an
    MPICH job otherwise hung. Only for a rank the bootstrap would have started
    MPI in (an MPI launch of several ranks, no ``HVDLIKE_RANK``), and never
    for longer than ``deadline_seconds``: the start runs on a daemon thread
    and a rank it cannot start in exits as before.
    """
    import os
    import threading

    from . import mpi_bootstrap

    environ = os.environ
    if "HVDLIKE_RANK" in environ:
        return
    for _name, rank_var, size_var in mpi_bootstrap.MPI_FLAVOURS:
        if rank_var in environ and environ.get(size_var, "1").strip() not in ("", "0", "1"):
            break
    else:
        return

    def start() -> None:
        try:
            mpi_bootstrap.select_libmpi(environ)
            from mpi4py import MPI  # noqa: F401 - importing starts MPI
        except BaseException:  # noqa: BLE001 - no MPI: nothing to abort
            pass

    starter = threading.Thread(target=start, name="hvdlike-mpi-abort", daemon=True)
    starter.start()
    starter.join(deadline_seconds)


def _abort_mpi(only_with_peers: bool = False) -> None:
    """End the whole MPI job (``MPI_Abort``) when this process runs under MPI.

    Otherwise the dying rank blocks in ``MPI_Finalize`` at exit, waiting for
    peers that wait in a collective for it: an ``mpirun`` job with an uncaught
    exception on one rank hung forever. mpi4py's own ``python -m mpi4py`` does
    the same for an uncaught exception; the traceback is already printed.
    ``only_with_peers``: not when this process is MPI's only rank.
    """
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return
    try:
        if mpi.Is_initialized() and not mpi.Is_finalized():
            if only_with_peers and mpi.COMM_WORLD.Get_size() < 2:
                return
            for stream in (sys.stdout, sys.stderr):  # Abort skips the interpreter's exit
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001 - a closed stream: nothing to keep
                    pass
            mpi.COMM_WORLD.Abort(1)
    except Exception:  # noqa: BLE001 - the process is exiting anyway
        pass


def shutdown() -> None:
    """Stop hvdlike on this rank (and, through negotiation, on every rank)."""
    with _SLOT.lock:
        current, _SLOT.runtime = _SLOT.runtime, None
        earlier, _SLOT.closing = _SLOT.closing, []
    if current is not None:
        current.shutdown()
    for runtime_ in earlier:  # shut down from a signal handler: finish freeing them
        runtime_.shutdown()


def is_initialized() -> bool:
    current = _SLOT.runtime
    # A forked child's copy answers as its parent (a DataLoader worker sharding by
    # rank() behind this check), though it refuses collectives.
    return current is not None and (current.forked or current.alive_error() is None)


def rank() -> int:
    return runtime().topology.rank


def size() -> int:
    return runtime().topology.size


def local_rank() -> int:
    return runtime().topology.local_rank


def local_size() -> int:
    return runtime().topology.local_size


def cross_rank() -> int:
    return runtime().topology.cross_rank


def cross_size() -> int:
    return runtime().topology.cross_size


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks."""
    topo = runtime().topology
    return topo.local_size * topo.cross_size == topo.size


# -- build and feature queries (truthful for this installation) -----------------


def gloo_built() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


def gloo_enabled() -> bool:
    """Gloo carries the control plane and CPU tensors whenever it is built."""
    return gloo_built()


def nccl_built() -> bool:
    import torch
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_nccl_available() and torch.version.cuda)


def cuda_built() -> bool:
    import torch

    return torch.version.cuda is not None


def rocm_built() -> bool:
    import torch

    return getattr(torch.version, "hip", None) is not None


def mpi_built() -> bool:
    """True when mpi4py is importable (MPI launch and bootstrap are possible)."""
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """True when MPI carries this job's negotiation or CPU tensors (see mpi_plane.py)."""
    current = _SLOT.runtime
    return current is not None and "mpi" in current.engines


def mpi_threads_supported() -> bool:
    if not mpi_enabled():
        return False
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False



def check_extension(ext_name: str, ext_env_var: str, pkg_path: str, *args) -> None:
    """Horovod's check that a framework extension is usable; raises ImportError if not.

    Horovod verifies its compiled library here. hvdlike has no compiled part:
    a front end is usable when its framework imports and, for torch, when
    ``torch.distributed`` offers Gloo (the control plane always runs on it).

    Args:
        ext_name: the front end, e.g. ``"hvdlike.torch"`` or ``"horovod.torch"``.
        ext_env_var: the build variable Horovod would name (only echoed in errors).
        pkg_path: the caller's ``__file__`` (accepted for compatibility).
        *args: library names Horovod would look for (ignored).

    Raises:
        TypeError: an argument is not a string.
        ImportError: the front end cannot work in this installation.
    """
    import importlib

    for what, value in (("ext_name", ext_name), ("ext_env_var", ext_env_var),
                        ("pkg_path", pkg_path)):
        if not isinstance(value, str):
            raise TypeError(f"check_extension: {what} must be a str, got {type(value).__name__}")
    framework = ext_name.rsplit(".", 1)[-1]
    if framework not in ("torch", "numpy", "jax", "keras"):
        raise ImportError(f"Extension {ext_name} is not available: hvdlike has front ends for "
                          f"torch, numpy, jax and keras only ({ext_env_var} has no effect)")
    try:
        importlib.import_module(framework)
    except ImportError as exc:
        raise ImportError(f"Extension {ext_name} is not available: {framework} cannot be "
                          f"imported ({exc})") from None
    if not gloo_built():
        raise ImportError(f"Extension {ext_name} is not available: this torch build has no "
                          f"torch.distributed Gloo backend")


def start_timeline(file_path: str, mark_cycles: bool = False,
                   max_bytes: Optional[int] = None) -> None:
    """Start recording a Chrome-trace timeline of every collective to ``file_path``.

    As in Horovod, rank 0 writes the file (other ranks do nothing); a path
    containing ``{rank}`` is formatted per rank and every rank writes its own.
    A timeline already recording to another path is closed first; the path
    being recorded goes on (only ``mark_cycles`` follows the new call). See
    :mod:`hvdlike.core.timeline`.

    Args:
        file_path: the JSON file to write (truncated).
        mark_cycles: also mark the start of every background cycle.
        max_bytes: the file stops growing at this size (an int >= 4096); None:
            the ``HVDLIKE_TIMELINE_MAX_BYTES`` knob (1 GiB unless set).

    Raises:
        ValueError: the path is empty or cannot be written, or ``max_bytes`` is
            not an int >= 4096.

    Example:
        >>> hvd.start_timeline("/tmp/timeline.json", mark_cycles=True)
        >>> hvd.allreduce(torch.ones(4), name="x")
        >>> hvd.stop_timeline()   # the file is complete JSON now
    """
    recording = runtime().recording
    recording.open(file_path, mark_cycles, max_bytes)
    recording.start()


def stop_timeline() -> None:
    """Stop recording the timeline and close its file (a no-op when not recording)."""
    runtime().recording.close()
