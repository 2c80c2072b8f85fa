"""MPI (mpi4py) as the control plane and the CPU data plane.

Ranks started by ``mpirun`` (directly, or through ``hvdlike-run --mpi``)
already share an MPI world. Between processes of one host MPI moves data
through shared memory, which is far cheaper than Gloo's loopback TCP: on two
ranks of a 2-core machine a 1-element allreduce takes ~5 us with MPICH against
~0.2-0.3 ms with Gloo, and a 4 MiB one ~0.75 ms against ~5 ms. Across hosts MPI
uses its own network transport.

:func:`choose` decides, per job, which engine carries negotiation
(``HVDLIKE_CONTROLLER``) and CPU tensors (``HVDLIKE_CPU_OPERATIONS``):
``auto`` means MPI when the ranks were started by mpirun and mpi4py runs at
``MPI_THREAD_MULTIPLE`` (the background thread negotiates and moves data while
a user thread may be creating a process set's communicator), Gloo otherwise.

:class:`MpiDataGroup` mimics the slice of the torch ``ProcessGroup`` interface
the executor uses. Allreduce and broadcast of the dtypes MPI reduces natively
run on MPI; everything else (other dtypes, allgather, alltoall, barrier, the
Adasum point-to-point traffic) stays on the process set's Gloo group. Each
engine sees its collectives in the same order on every rank, so mixing them
cannot deadlock. An MPI collective runs at launch, on the background thread
(as Horovod's background thread runs MPI collectives itself), with the GIL
released by mpi4py; only Gloo and NCCL work goes to the executor's finisher.
"""

from __future__ import annotations

import time
from typing import Callable, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from .errors import ConfigError, HvdlikeInternalError

# Poll pacing of the control word while a peer is late (see MpiControlPlane):
# spin briefly, then nap a tenth of the time waited so far (so a late answer
# costs at most ~10 % more wait), between these bounds.
_SPIN_SECONDS = 50e-6
_MIN_NAP_SECONDS = 10e-6
_MAX_NAP_SECONDS = 2e-3



def _mpi():
    from mpi4py import MPI

    return MPI


def mpi_state() -> str:
    """Why MPI cannot carry this job's collectives ('' when it can)."""
    try:
        MPI = _mpi()  # initializes MPI unless the program turned that off
    except ImportError:
        return "mpi4py is not installed (pip install 'hvdlike[mpi]')"
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return "MPI is not initialized (or already finalized)"
    level = MPI.Query_thread()
    if level < MPI.THREAD_MULTIPLE:
        return (f"MPI runs at thread level {level}, hvdlike needs MPI_THREAD_MULTIPLE "
                "(do not lower mpi4py.rc.thread_level)")
    return ""


# Variables mpirun sets in every rank (Open MPI, MPICH/Hydra).
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK")


def choose(controller: str, cpu_operations: str, launcher: str, rank: int, size: int,
           environ: Mapping[str, str], base=None, threads_disabled: bool = False) -> tuple:
    """``(controller, cpu_operations)`` engines for this job, each 'gloo' or 'mpi'.

    A job counts as started by mpirun when the bootstrap found mpirun or when
    mpirun's variables are set (a script that also exports torchrun's
    ``RANK``/``MASTER_ADDR`` under mpirun is still an MPI job). ``base``: the
    communicator of ``init(comm=...)``'s members, else ``COMM_WORLD`` is the job.

    Raises:
        ConfigError: MPI was asked for explicitly but this job cannot use it.
    """
    started_by_mpi = launcher.startswith("mpirun") or any(v in environ for v in _MPI_RANK_VARS)
    wanted = [controller, cpu_operations]
    if "mpi" in wanted or (started_by_mpi and size > 1):
        why = "" if started_by_mpi else (
            f"the ranks were started by {launcher}, not mpirun (use hvdlike-run --mpi or "
            "mpirun)")
        if not why and threads_disabled:
            why = ("HVDLIKE_MPI_THREADS_DISABLE=1 asks for MPI without threads, and hvdlike's "
                   "background thread calls MPI")
        if not why:
            why = mpi_state()
        if not why:
            comm = _mpi().COMM_WORLD if base is None else base
            if (comm.Get_size(), comm.Get_rank()) != (size, rank):
                why = (f"MPI.COMM_WORLD has rank {comm.Get_rank()} of {comm.Get_size()} "
                       f"where the job has rank {rank} of {size}")
        if why:
            for knob, value in (("HVDLIKE_CONTROLLER", controller),
                                ("HVDLIKE_CPU_OPERATIONS", cpu_operations)):
                if value == "mpi":
                    raise ConfigError(f"{knob}=mpi, but MPI cannot carry this job: {why}")
            return "gloo", "gloo"
        return tuple("mpi" if v in ("auto", "mpi") else "gloo" for v in wanted)
    return "gloo", "gloo"


def world_comm():
    """mpi4py's ``COMM_WORLD`` (the job's communicator under a plain mpirun)."""
    return _mpi().COMM_WORLD


def duplicate_world(base=None):
    """A runtime's private duplicate of COMM_WORLD, or of ``base`` (``init(comm=...)``'s
    communicator); collective; free it with :func:`free`."""
    return (_mpi().COMM_WORLD if base is None else base).Dup()


def set_comm(base, ranks: Sequence[int], set_id: int):
    """A communicator over ``ranks`` (global ranks, in this order) made from ``base``.

    Collective over the members; ``base`` is the runtime's :func:`duplicate_world`.
    """
    if list(ranks) == list(range(base.Get_size())):
        return base.Dup()
    group = base.Get_group().Incl(list(ranks))
    try:
        return base.Create_group(group, tag=set_id)
    finally:
        group.Free()


def _array(tensor: torch.Tensor):
    """A numpy view sharing ``tensor``'s memory (contiguous CPU tensors only)."""
    return tensor.detach().numpy()


class MpiControlPlane:
    """Negotiation collectives on an MPI communicator (see controller.ControlPlane).

    Every call is non-blocking and polled with short naps: a blocking MPI
    call would spin a core at 100 % while a peer is still computing, which on
    a busy host slows the very training it waits for -- and it could never
    be given up. ``abandon()`` is asked between polls; once it returns an
    error (the job failed: a stall shutdown, a dead peer) the wait raises it
    instead of waiting for peers that will never come.
    """

    def __init__(self, comm, rank: int, size: int,
                 abandon: Callable[[], Optional[BaseException]] = lambda: None):
        self.comm = comm
        self.rank = rank
        self.size = size
        self.abandon = abandon
        import numpy as np

        self._word = np.zeros(1, dtype=np.int64)

    def _wait(self, request) -> None:
        started = time.perf_counter()
        while not request.Test():
            waited = time.perf_counter() - started
            if waited >= _SPIN_SECONDS:
                error = self.abandon()
                if error is not None:
                    raise HvdlikeInternalError(
                        f"negotiation abandoned, the job has failed: {error}") from None
                time.sleep(min(_MAX_NAP_SECONDS, max(_MIN_NAP_SECONDS, waited * 0.1)))

    def allreduce_sum(self, values: Sequence[int]) -> List[int]:
        import numpy as np

        if self.size == 1:
            return list(values)
        buf = np.asarray(values, dtype=np.int64)
        self._wait(self.comm.Iallreduce(_mpi().IN_PLACE, buf, op=_mpi().SUM))
        return buf.tolist()

    def allreduce_min(self, value: int) -> int:
        if self.size == 1:
            return value
        word = self._word
        word[0] = value
        self._wait(self.comm.Iallreduce(_mpi().IN_PLACE, word, op=_mpi().MIN))
        return int(word[0])

    def gather(self, payload: bytes) -> Optional[List[bytes]]:
        import numpy as np

        if self.size == 1:
            return [payload]
        MPI = _mpi()
        lengths = np.zeros(self.size, dtype=np.int64)
        mine = np.array([len(payload)], dtype=np.int64)
        self._wait(self.comm.Igather(mine, lengths if self.rank == 0 else None, root=0))
        data = np.frombuffer(payload, dtype=np.uint8) if payload else np.zeros(0, np.uint8)
        if self.rank != 0:
            self._wait(self.comm.Igatherv(data, None, root=0))
            return None
        counts = [int(n) for n in lengths]
        out = np.empty(sum(counts), dtype=np.uint8)
        self._wait(self.comm.Igatherv(data, [out, counts, MPI.UNSIGNED_CHAR], root=0))
        pieces, start = [], 0
        for n in counts:
            pieces.append(out[start:start + n].tobytes())
            start += n
        return pieces

    def broadcast(self, payload: Optional[bytes]) -> bytes:
        import numpy as np

        if self.size == 1:
            return payload
        length = np.array([len(payload) if self.rank == 0 else 0], dtype=np.int64)
        self._wait(self.comm.Ibcast(length, root=0))
        if self.rank == 0:
            data = np.frombuffer(payload, dtype=np.uint8).copy()
        else:
            data = np.empty(int(length[0]), dtype=np.uint8)
        if data.size:
            self._wait(self.comm.Ibcast(data, root=0))
        return payload if self.rank == 0 else data.tobytes()

    def close(self) -> None:
        free(self.comm)


class _Deferred:
    """A blocking MPI collective, run by the executor on the background thread.

    ``inline`` tells the executor to run it at launch rather than hand it to
    the finisher: every MPI call on the communicator then comes from one
    thread, in the launch order all ranks share.
    """

    __slots__ = ("_run", "_done")
    inline = True
    engine = "MPI"  # the timeline's name for the transfer (MPI_ALLREDUCE...)

    def __init__(self, run: Callable[[], None]):
        self._run = run
        self._done = False

    def wait(self, timeout=None) -> bool:
        if not self._done:
            self._run()
            self._done = True
        return True


def _reduce_ops():
    # MPI.MIN / MPI.MAX leave NaN undefined (implementations keep or drop it by
    # rank order): a min or max of floating tensors comes from the executor as
    # the integer image of nan_order, float16 and bfloat16 ones as int32.
    MPI = _mpi()
    return {
        dist.ReduceOp.SUM: MPI.SUM,
        dist.ReduceOp.MIN: MPI.MIN,
        dist.ReduceOp.MAX: MPI.MAX,
        dist.ReduceOp.PRODUCT: MPI.PROD,
    }


# dtypes MPI reduces natively through numpy views; others stay on Gloo.
_MPI_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.int8)


class MpiDataGroup:
    """CPU allreduce and broadcast on MPI, the rest on the set's Gloo group."""

    scales = False  # allreduce() takes no ``post`` (see ShmDataGroup)
    # Allreduces of 1 MiB and up are not staged in fusion buffers (Executor._alone):
    # 8 allreduces at once under mpirun on 2 ranks took 3.3-3.6 ms one by one against
    # 4.8-5.2 fused at 1 MiB each, 5.2-5.3 against 11.4-12.1 at 2 MiB, 10-16 against
    # 29-31 at 4 MiB; fused won at 256 KiB (0.9-1.0 against 1.5-2.3 ms).
    alone_bytes = 1 << 20

    def __init__(self, comm, gloo: Callable[[], object]):
        self.comm = comm
        self._gloo = gloo
        self._ops = _reduce_ops()

    def _mpi_ok(self, tensors) -> bool:
        return (len(tensors) == 1 and tensors[0].dtype in _MPI_DTYPES
                and tensors[0].is_contiguous() and tensors[0].device.type == "cpu")

    def allreduce(self, tensors, opts=None):
        op = None
        if self._mpi_ok(tensors):
            wanted = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
            # ReduceOp == RedOpType holds only in this order (torch compares one way).
            op = next((m for d, m in self._ops.items() if wanted == d), None)
        if op is None:
            return self._gloo().allreduce(tensors, opts)
        buf = _array(tensors[0])
        comm, in_place = self.comm, _mpi().IN_PLACE
        return _Deferred(lambda: comm.Allreduce(in_place, buf, op=op))

    def broadcast(self, tensors, opts=None):
        if not self._mpi_ok(tensors):
            return self._gloo().broadcast(tensors, opts)
        buf = _array(tensors[0])
        root = opts.rootRank if opts is not None else 0
        comm = self.comm
        return _Deferred(lambda: comm.Bcast(buf, root=root))

    def __getattr__(self, name):
        # allgather, alltoall_base, barrier, send/recv...: the Gloo group's.
        return getattr(self._gloo(), name)

    def shutdown(self) -> None:
        free(self.comm)


def free(comm) -> None:
    try:
        if comm is not None and comm != _mpi().COMM_NULL:
            comm.Free()
    except Exception:  # MPI already finalized at interpreter exit
        pass
