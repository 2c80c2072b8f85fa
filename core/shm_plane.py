"""Shared memory as the CPU data plane of the ranks of one host.

Gloo moves bytes between two processes of one host through loopback TCP:
every byte is copied into a socket, through the kernel and out again, in
small pieces, by Gloo's threads. Here the members of a process set that all
run on one host map one segment (see :mod:`.shm_segment`) and move tensors
with plain torch copies and reductions on it.

:class:`ShmDataGroup` mimics the slice of the torch ``ProcessGroup`` interface
the executor uses (``allreduce``, ``broadcast``, ``allgather``,
``alltoall_base``, ``barrier``); anything else (the point-to-point traffic of
Adasum) goes to the set's Gloo group. Each call returns a work object whose
``wait()`` runs the collective. The executor calls it at once on the thread
that launched it (``inline``: the background thread), in launch order, which
is the same order on every member: a transfer through memory is short next to
a thread hand-off to the finisher on a busy host.

Algorithms, on a data area of two buffers of ``(members + 1) * chunk_bytes``,
used alternately, one per chunk (a buffer is written again only after every
member passed a sync point that followed its last read of it):

* allreduce, per chunk of ``1.5 * chunk_bytes`` for two members (the buffer
  holds ``members ** 2`` portions, see ``ShmDataGroup._publish``): member ``i``
  owns the ``i``-th portion; every member publishes the portions it does not
  own; sync; every member reduces its portion (its own data and the others'
  publications, in member order: each element is reduced once, so every
  member gets the identical result) into the buffer's result region; sync;
  every member copies the other portions' results out. Pipelined: the step
  before a sync point publishes chunk ``s``, reduces chunk ``s - 1`` and reads
  the results of chunk ``s - 2`` (in other regions of the same buffer), so an
  allreduce of ``k`` chunks takes ``k + 1`` sync points, not ``2k``;
* allreduce from ``ACROSS_MIN_BYTES`` (64 MiB) on, where every member may read
  the others' memory (probed when the plane is set up): the same portions, but
  each member reads the others' inputs for its portion, and then the others'
  results, straight out of their tensors with ``process_vm_readv`` (one
  kernel copy, see ``shm_segment.read_peer``) -- no staging in the segment,
  three sync points whatever the size;
* broadcast, per chunk: the root copies into the result slot; sync; others copy out;
* allgather, per chunk: every member copies its part into its slot; sync;
  every member copies all slots out;
* alltoall: the send counts go through the header first, then each member's
  send buffer is streamed through its slot as in allgather and every member
  picks the pieces addressed to it.

Waiting never busy-polls for long (futex sleeps, see :mod:`.shm_segment`);
while a member is missing the wait checks, every 0.1 s, whether the job has
failed, whether the missing member's process has exited, and whether
``HVDLIKE_GLOO_TIMEOUT_SECONDS`` has passed -- each raises an error naming
the rank, which the executor turns into the job's failure (with the health
watcher's diagnosis).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import shm_segment, store_wait
from .errors import HvdlikeInternalError
from .memo import BoundedMemo
from .shm_segment import Segment, job_tag  # noqa: F401 - job_tag re-exported

# Per slot; a segment holds two buffers of (members + 1) slots: 24 MiB for two
# members. Every sync point is a wake-up of the peer on a busy host: 4 MiB
# slots (allreduce chunks of 6 MiB for two members) took 64 MiB in 0.5-0.75x
# the time 1 MiB slots did; 6 MiB slots (36 MiB) were no faster than 4 MiB.
CHUNK_BYTES = 4 << 20
# Allreduces from this size on read the other members' tensors directly where
# the host allows it (``_allreduce_across``): three sync points, about 1.25
# copies of the tensor instead of ~2.25, but each read is a system call that
# pins the peer's pages first. Once that looked cheaper from 3 MiB on (0.77-0.92x
# the chunked path at 3-4 MiB). Measured again on 2 ranks with the tensors out
# of cache (several distinct ones per size, Average, alternated in one process
# pair), the chunked path took 0.72-0.75x at 2 MiB, 0.99-1.00x at 4 MiB,
# 0.84-0.93x at 8-16 MiB and 0.96-0.97x at 32 MiB, and 0.98-1.23x at 64 MiB;
# in training steps of eight 4 MiB gradients it saved 1.0-1.2 ms a step in
# three of three alternated runs. Reading across is kept for the largest.
ACROSS_MIN_BYTES = 64 << 20
# Read and reduced a block at a time into private memory. A block small enough
# to stay in cache until the reduction (and the average's scaling) reads it:
# 512 KiB blocks took 0.86x the time of 2 MiB ones for 64 MiB and 0.94x for
# 4 MiB (in-process A/B on 2 ranks); 256 KiB lost to the per-block Python.
ACROSS_BLOCK_BYTES = 512 << 10
# Allreduces up to this size take one sync point (every member reduces all of it).
ONE_SYNC_BYTES = 256 * 1024
# Allreduces of this size and up are not staged in fusion buffers (``alone_bytes``,
# see Executor._alone): a lone one is copied through the segment or read across
# once, a fused one is also copied into the buffer and out of it. 8 allreduces
# submitted at once on 2 ranks, fused and not: 8 x 1 MiB 3.6-4.5 ms fused against
# 1.7 ms, 8 x 2 MiB 8.5 against 3.3, 8 x 4 MiB 20 against 8.5-9; at 256 KiB
# and below fusing costs nothing more, at 512 KiB it was a draw.
ALONE_BYTES = 1 << 20
_ALIGN_BYTES = 64


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every process set of a runtime needs to build its shared-memory plane.

    Attributes:
        tag: public one-way derivation of the job secret; starts every segment name.
        host: identifies this host (ranks with equal ``host`` share memory).
        timeout_seconds: how long a member waits for a missing one.
        start_timeout_seconds: how long members wait for each other to map the segment.
    """

    tag: str
    host: str
    timeout_seconds: float
    start_timeout_seconds: float
    hierarchical_allreduce: Optional[bool] = None  # None: auto (see shm_hierarchy.wanted)
    hierarchical_allgather: Optional[bool] = None


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def settings(cfg, topology, rendezvous) -> Optional[Settings]:
    """The plane's settings for this runtime, or None when it is off for the whole job.

    Only job-wide facts decide (``HVDLIKE_SHM``, the job size, the secret): every
    member of a set must take part in the host exchange of :func:`for_set`, or
    those who do would wait for those who do not. A host without ``/dev/shm``
    takes part under a host name nobody else has.
    """
    if not cfg.shm or topology.size < 2 or not rendezvous.secret:
        if (not cfg.shm and topology.rank == 0
                and (cfg.hierarchical_allreduce or cfg.hierarchical_allgather)):
            from .log import logger

            logger.warning("hierarchical collectives need the shared-memory plane inside "
                           "each host; HVDLIKE_SHM=0 keeps every collective on flat Gloo")
        return None
    host = f"{topology.hostname}|{boot_id()}"
    if not os.path.isdir(shm_segment.SHM_DIR):
        host = f"{host}|rank{topology.rank}"  # shares with nobody
    return Settings(tag=job_tag(rendezvous.secret), host=host,
                    timeout_seconds=cfg.gloo_timeout_seconds,
                    start_timeout_seconds=cfg.start_timeout,
                    # Horovod's torus allreduce has the same two levels.
                    hierarchical_allreduce=(True if cfg.hierarchical_allreduce is None
                                            and cfg.torus_allreduce
                                            else cfg.hierarchical_allreduce),
                    hierarchical_allgather=cfg.hierarchical_allgather)


def host_layout(store, settings_: Settings, rank: int, size: int,
                ranks: Optional[Sequence[int]] = None,
                abandon: Callable[[], Optional[BaseException]] = lambda: None,
                gone: store_wait.Gone = lambda ranks: "") -> List[List[int]]:
    """The set's ranks grouped by host, hosts ordered by their lowest set rank.

    Collective over the set: every member publishes its host. ``ranks`` are
    the set's global ranks; ``abandon`` and ``gone`` end the wait for the
    others early (see :mod:`.store_wait`).
    """
    ranks = list(ranks) if ranks is not None else list(range(size))
    store.set(f"host/{rank}", settings_.host)
    others = [r for r in range(size) if r != rank]
    store_wait.await_keys(store, [f"host/{r}" for r in others], [ranks[r] for r in others],
                          settings_.start_timeout_seconds, abandon, gone,
                          f"the shared-memory plane of ranks {ranks}")
    hosts = [settings_.host if r == rank else store.get(f"host/{r}").decode()
             for r in range(size)]
    layout: Dict[str, List[int]] = {}
    for r, host in enumerate(hosts):
        layout.setdefault(host, []).append(r)
    return list(layout.values())


def host_members(store, settings_: Settings, rank: int, size: int) -> List[int]:
    """Set ranks on this host (collective over the set: every member publishes its host)."""
    return next(h for h in host_layout(store, settings_, rank, size) if rank in h)


class _Work:
    """A collective run by ``wait()`` (on the launching thread, see ``inline``)."""

    __slots__ = ("_run", "_done", "scaled")
    inline = True  # run by the launching thread, in launch order (Executor._submit)
    engine = "SHM"  # the timeline's name for the transfer (SHM_ALLREDUCE...)

    def __init__(self, run: Callable[[], None], scaled: bool = False):
        self._run = run
        self._done = False
        self.scaled = scaled  # the allreduce applied the caller's ``post`` itself

    def wait(self, timeout=None) -> bool:
        if not self._done:
            self._done = True
            self._run()
        return True

    def is_completed(self) -> bool:
        return self._done


def _chain(fn):
    def reduce(parts: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        fn(parts[0], parts[1], out=out)
        for part in parts[2:]:
            fn(out, part, out=out)
    return reduce


_REDUCERS = (
    (dist.ReduceOp.SUM, _chain(torch.add)),
    (dist.ReduceOp.PRODUCT, _chain(torch.mul)),
    (dist.ReduceOp.MIN, _chain(torch.minimum)),
    (dist.ReduceOp.MAX, _chain(torch.maximum)),
)


def _reducer(opts):
    wanted = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
    # ReduceOp == RedOpType holds only in this order (torch compares one way).
    return next((fn for op, fn in _REDUCERS if wanted == op), None)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _closed():
    raise HvdlikeInternalError("the shared-memory plane of this process set is closed")


class ShmDataGroup:
    """CPU collectives of a one-host process set on shared memory, the rest on Gloo.

    Args:
        settings_: the runtime's :class:`Settings`.
        store: the set's store (prefixed), for the segment name.
        rank, size: this member's rank in the set and the set's size.
        ranks: the set's global ranks (for error messages).
        gloo: returns the set's Gloo group (created on first use).
        abandon: returns the job's failure once there is one.
    """

    def __init__(self, settings_: Settings, store, rank: int, size: int, ranks: Sequence[int],
                 gloo: Callable[[], object],
                 abandon: Callable[[], Optional[BaseException]] = lambda: None,
                 chunk_bytes: int = 0, gone: store_wait.Gone = lambda ranks: ""):
        self.settings = settings_
        self.rank = rank
        self.size = size
        self.ranks = list(ranks)
        self._gloo = gloo
        self.abandon = abandon
        self.chunk_bytes = chunk_bytes or CHUNK_BYTES
        # Bytes of one allreduce portion (see _publish): a multiple of 64.
        self._share_bytes = ((size + 1) * self.chunk_bytes // (size * size)
                             // _ALIGN_BYTES * _ALIGN_BYTES)
        if self._share_bytes == 0:
            raise HvdlikeInternalError(
                f"shared-memory chunk of {self.chunk_bytes} bytes is too small for "
                f"{size} members")
        self.name = ""
        self._step = 0
        self._views: Dict[tuple, torch.Tensor] = {}
        # (buffer, dtype, elements) -> every member's slot as a view: indexing a
        # tensor costs microseconds, and small allreduces repeat the same shape.
        self._slots = BoundedMemo()
        self._reducers: Dict[object, Optional[Callable]] = {}
        self.pids: List[int] = []
        self.segment = self._attach(store, gone)
        try:
            self.reads_across = self._probe_across()
        except BaseException:
            self.shutdown()
            raise
        # The executor does not stage tensors of this many bytes in fusion buffers.
        self.alone_bytes = ALONE_BYTES
        self._spare: Optional[torch.Tensor] = None

    # -- setup ---------------------------------------------------------------------------

    def _attach(self, store, gone: store_wait.Gone) -> Segment:
        n = self.size
        header = shm_segment.header_bytes(n, 16 * n + 24)
        total = header + 2 * (n + 1) * self.chunk_bytes
        segment = shm_segment.attach(store, "segment", self.settings.tag, self.rank, n, header,
                                     total, self.ranks, self.settings.start_timeout_seconds,
                                     self.abandon, gone)
        self.name = segment.name
        self.pids = segment.pids
        mm = segment.mm
        self.data = torch.frombuffer(mm, dtype=torch.uint8, offset=header,
                                     count=total - header).view(2, n + 1, self.chunk_bytes)
        self.meta = torch.frombuffer(mm, dtype=torch.int64, offset=n * shm_segment.LINE,
                                     count=2 * n * n).view(2, n, n)
        # Per member: the address of its tensor in an allreduce read across
        # (row 0); the setup probe's token (row 1) and verdict (row 2).
        self.across = torch.frombuffer(mm, dtype=torch.int64,
                                       offset=n * shm_segment.LINE + 16 * n * n,
                                       count=3 * n).view(3, n)
        return segment

    def _probe_across(self) -> bool:
        """Whether every member can read every other's memory (collective; two sync points).

        Each member reads a random token out of every other member's memory:
        a member in another PID namespace, or a host that forbids the read,
        turns the path off for all.
        """
        n, me = self.size, self.rank
        token = torch.tensor([secrets.randbits(62) + 1], dtype=torch.int64)
        self.across[0, me] = token.data_ptr()
        self.across[1, me] = int(token)
        self._sync("setup")
        seen = torch.zeros(1, dtype=torch.int64)
        ok = True
        for m in range(n):
            if m != me:
                try:
                    shm_segment.read_peer(self.pids[m], int(self.across[0, m]),
                                          seen.data_ptr(), 8)
                except OSError:
                    ok = False
                    break
                ok = ok and int(seen) == int(self.across[1, m])
        self.across[2, me] = 1 if ok else 2
        self._sync("setup")
        return all(v == 1 for v in self.across[2].tolist())

    # -- synchronisation ---------------------------------------------------------------

    def _sync(self, what: str) -> None:
        self.segment.sync(what, self.ranks, self.settings.timeout_seconds, self.abandon)

    def _buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """The next buffer (alternating), as ``[members + 1, chunk elements]`` of ``dtype``."""
        self._step += 1
        return self._view(self._step & 1, dtype)

    def _view(self, which: int, dtype: torch.dtype) -> torch.Tensor:
        key = (which, dtype)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self.data[which].view(dtype)
        return view

    # -- collectives ---------------------------------------------------------------------

    # allreduce() takes ``post``: an in-place function (the average's division,
    # a postscale) applied to the reduced values by the member that reduced
    # them, before the others read them, instead of a pass of every member
    # over the whole result afterwards. The returned work's ``scaled`` says
    # whether it was applied (not on the Gloo fallback).
    scales = True

    def allreduce(self, tensors, opts=None, post: Optional[Callable[[torch.Tensor], None]] = None,
                  key=None):
        # ``key``: a hashable the caller names ``opts``'s operation by (equal keys,
        # same operation), so that a repeated operation is not read back out of
        # the torch options object: that costs microseconds per call.
        reduce = self._reduction(opts, key)
        if len(tensors) != 1 or reduce is None or not tensors[0].is_contiguous():
            return self._gloo().allreduce(tensors, opts)
        flat = tensors[0]
        if flat.dim() != 1:
            flat = flat.reshape(-1)
        return _Work(lambda: self._allreduce(flat, reduce, post=post), scaled=post is not None)

    def _reduction(self, opts, key=None):
        """The reduce function for ``opts`` (None: not on this plane), kept per ``key``."""
        if key is None:
            return _reducer(opts)
        if key not in self._reducers:
            self._reducers[key] = _reducer(opts)
        return self._reducers[key]

    def can_reduce(self, opts=None, key=None) -> bool:
        """Whether this plane reduces ``opts``'s operation itself (else Gloo does)."""
        return self._reduction(opts, key) is not None

    def reduce_parts(self, parts: Sequence[torch.Tensor], out: torch.Tensor, opts=None,
                     key=None) -> None:
        """Reduce every member's input ``parts`` (in member order) into ``out``,
        as :meth:`allreduce` reduces them (see ``Executor.offer``)."""
        self._reduction(opts, key)(parts, out)

    def _allreduce(self, flat: torch.Tensor, reduce, root: Optional[int] = None,
                   post: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        # Per chunk, member ``me`` owns portion ``me``: it publishes the other
        # portions, reduces its own from its private copy and the others'
        # publications (in member order, so the result does not depend on who
        # owns an element) into the buffer's result region and reads the other
        # portions' results from there. Pipelined: before sync point ``s`` a
        # member publishes chunk ``s``, reduces chunk ``s - 1`` and reads the
        # results of chunk ``s - 2``: chunks + 1 sync points in all. With
        # ``root`` only that member reads results (a reduce: the others'
        # ``flat`` is left as it was, or, read across, holds their portion's result).
        count = flat.numel()
        if count == 0:
            return
        size = flat.element_size()
        if count * size <= min(self.chunk_bytes, ONE_SYNC_BYTES):
            self._allreduce_small(flat, reduce)
            if post is not None:
                post(flat)
            return
        if self.reads_across and count * size >= ACROSS_MIN_BYTES:
            self._allreduce_across(flat, reduce, root, post)
            return
        share = self._share_bytes // size
        per_chunk = self.size * share
        reads = root is None or self.rank == root
        reducing = reading = None
        for start in range(0, count + per_chunk, per_chunk):
            publishing = None
            if start < count:
                publishing = self._publish(flat[start:start + per_chunk], share)
            if reducing is not None:
                self._reduce_portion(reducing, share, reduce, reads, post)
            if reading is not None and reads:
                self._read_results(reading, share)
            self._sync("allreduce")
            reading, reducing = reducing, publishing
        if reading is not None and reads:
            self._read_results(reading, share)

    # An allreduce chunk in a buffer of ``(n + 1) * chunk_bytes`` bytes, in
    # portions of at most ``share`` elements: member ``j`` publishes its n - 1
    # non-owned portions packed at ``j * (n - 1) * share``, the owners' results
    # follow at ``n * (n - 1) * share`` (``_share_bytes``: n * n portions fill
    # the buffer, 1.5 slots of data per chunk for two members). Portion bounds
    # are multiples of 64 bytes: no two writers share a cache line.

    def _portions(self, length: int, element_size: int) -> List[tuple]:
        """Each member's ``(start, end)`` of ``length`` elements, on 64-byte bounds."""
        n = self.size
        unit = max(1, _ALIGN_BYTES // element_size)
        part = -(-length // (n * unit)) * unit
        return [(min(m * part, length), min((m + 1) * part, length)) for m in range(n)]

    def _publish(self, chunk: torch.Tensor, share: int) -> tuple:
        n, me = self.size, self.rank
        area = self._buffer(chunk.dtype).view(-1)
        bounds = self._portions(chunk.numel(), chunk.element_size())
        at = me * (n - 1) * share
        for m, (a, b) in enumerate(bounds):
            if m != me:
                if b > a:
                    area[at:at + b - a].copy_(chunk[a:b])
                at += share
        return chunk, area, bounds

    def _reduce_portion(self, published: tuple, share: int, reduce, keep: bool,
                        post: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        chunk, area, bounds = published
        n, me = self.size, self.rank
        lo, hi = bounds[me]
        if hi == lo:
            return
        parts = []
        for m in range(n):
            if m == me:
                parts.append(chunk[lo:hi])
            else:  # my portion is the ``me``-th (or, after mine, ``me - 1``-th) of member m's
                at = (m * (n - 1) + (me if me < m else me - 1)) * share
                parts.append(area[at:at + hi - lo])
        results = n * (n - 1) * share
        result = area[results + lo:results + hi]
        if keep and me < 2:  # the output may alias the first two operands only
            # Into private memory first, then one copy out to the segment: the
            # lines of the result region were last read by the other members,
            # so every pass writing there pays for taking them back (8 allreduces
            # of 4 MiB on 2 ranks: 0.88-0.94x the time of reducing into the
            # region and copying it back, three alternated runs).
            mine = chunk[lo:hi]
            reduce(parts, mine)
            if post is not None:
                post(mine)
            result.copy_(mine)
            return
        reduce(parts, result)
        if post is not None:
            post(result)
        if keep:
            chunk[lo:hi].copy_(result)

    def _read_results(self, published: tuple, share: int) -> None:
        chunk, area, bounds = published
        results = self.size * (self.size - 1) * share
        for m, (a, b) in enumerate(bounds):
            if m != self.rank and b > a:
                chunk[a:b].copy_(area[results + a:results + b])

    def _allreduce_across(self, flat: torch.Tensor, reduce, root: Optional[int],
                          post: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        # Each member publishes its tensor's address; sync; reduces its own
        # portion, a block at a time, from its tensor and the blocks it reads
        # out of the others' tensors (in member order, like the chunked path:
        # identical results) into its tensor; sync; reads the other portions'
        # results out of their owners' tensors; sync (nobody returns, and may
        # change its tensor, while another member still reads it).
        n, me = self.size, self.rank
        count, size = flat.numel(), flat.element_size()
        self.across[0, me] = flat.data_ptr()
        self._sync("allreduce")
        where = self.across[0].tolist()
        bounds = self._portions(count, size)
        lo, hi = bounds[me]
        block = ACROSS_BLOCK_BYTES // size
        if self._spare is None:
            self._spare = torch.empty(n * ACROSS_BLOCK_BYTES, dtype=torch.uint8)
        spare = self._spare.view(flat.dtype).view(n, block)
        for a in range(lo, hi, block):
            b = min(hi, a + block)
            parts = []
            for m in range(n):
                if m == me:
                    parts.append(flat[a:b])
                else:
                    parts.append(spare[m, :b - a])
                    self._read(m, where[m] + a * size, spare[m].data_ptr(), (b - a) * size)
            if me < 2:  # the output may alias the first two operands only
                reduce(parts, flat[a:b])
            else:
                reduce(parts, spare[me, :b - a])
                flat[a:b].copy_(spare[me, :b - a])
            if post is not None:
                post(flat[a:b])
        self._sync("allreduce")
        if root is None or me == root:
            for m, (a, b) in enumerate(bounds):
                if m != me and b > a:
                    self._read(m, where[m] + a * size, flat[a:].data_ptr(), (b - a) * size)
        self._sync("allreduce")

    def _read(self, member: int, remote: int, local: int, nbytes: int) -> None:
        pid = self.pids[member]
        try:
            shm_segment.read_peer(pid, remote, local, nbytes)
        except OSError as exc:
            if shm_segment.process_gone(pid):
                raise HvdlikeInternalError(
                    f"rank {self.ranks[member]} (pid {pid}) exited during a shared-memory "
                    "allreduce") from None
            raise HvdlikeInternalError(
                f"cannot read the memory of rank {self.ranks[member]} (pid {pid}) in a "
                f"shared-memory allreduce: {exc.strerror}") from None

    def _allreduce_small(self, flat: torch.Tensor, reduce) -> None:
        # One sync point instead of two: every member publishes all of its
        # data and reduces every element itself, in member order like the
        # portioned algorithm (identical results on every member, and equal to
        # it). Worth it while n reads of the data cost less than a sync point.
        count = flat.numel()
        self._step += 1
        key = (self._step & 1, flat.dtype, count)
        parts = self._slots.get(key)
        if parts is None:
            slots = self._view(key[0], key[1])
            parts = self._slots.add(key, [slots[m, :count] for m in range(self.size)])
        parts[self.rank].copy_(flat)
        self._sync("allreduce")
        reduce(parts, flat)

    def broadcast(self, tensors, opts=None):
        if len(tensors) != 1 or not tensors[0].is_contiguous():
            return self._gloo().broadcast(tensors, opts)
        root = opts.rootRank if opts is not None else 0
        flat = _bytes(tensors[0])
        return _Work(lambda: self._broadcast(flat, root))

    def _broadcast(self, flat: torch.Tensor, root: int) -> None:
        n, me = self.size, self.rank
        count = flat.numel()
        for start in range(0, count, self.chunk_bytes):
            length = min(self.chunk_bytes, count - start)
            slots = self._buffer(torch.uint8)
            if me == root:
                slots[n, :length].copy_(flat[start:start + length])
            self._sync("broadcast")
            if me != root:
                flat[start:start + length].copy_(slots[n, :length])

    def allgather(self, output_lists, inputs):
        outs = output_lists[0] if len(output_lists) == 1 else None
        if (outs is None or len(inputs) != 1 or len(outs) != self.size
                or not all(t.is_contiguous() for t in [inputs[0], *outs])):
            return self._gloo().allgather(output_lists, inputs)
        mine = _bytes(inputs[0])
        targets = [_bytes(t) for t in outs]
        return _Work(lambda: self._allgather(mine, targets))

    def _allgather(self, mine: torch.Tensor, targets: List[torch.Tensor],
                   root: Optional[int] = None) -> None:
        """Every member's ``mine`` into ``targets`` (with ``root``: only that member's)."""
        n, me = self.size, self.rank
        count = mine.numel()
        reads = root is None or me == root
        if reads:
            targets[me].copy_(mine)
        for start in range(0, count, self.chunk_bytes):
            length = min(self.chunk_bytes, count - start)
            slots = self._buffer(torch.uint8)
            slots[me, :length].copy_(mine[start:start + length])
            self._sync("allgather")
            if not reads:
                continue
            for m in range(n):
                if m != me:
                    targets[m][start:start + length].copy_(slots[m, :length])

    def alltoall_base(self, output, source, output_split_sizes, input_split_sizes, opts=None):
        if not (output.is_contiguous() and source.is_contiguous()):
            return self._gloo().alltoall_base(output, source, output_split_sizes,
                                              input_split_sizes)
        shape = output.shape[1:] if output.dim() else ()
        row = output.element_size()
        for d in shape:
            row *= d
        sends = list(input_split_sizes)
        return _Work(lambda: self._alltoall(_bytes(output), _bytes(source), sends, row))

    def _alltoall(self, out: torch.Tensor, src: torch.Tensor, sends: List[int],
                  row: int) -> None:
        n, me = self.size, self.rank
        self._buffer(torch.uint8)  # the counts travel in the header, alternating like data
        meta = self.meta[self._step & 1]
        meta[me].copy_(torch.tensor(sends, dtype=torch.int64))
        self._sync("alltoall")
        rows = meta.tolist()  # rows[i][j]: rows member i sends to member j
        send_off = [[0] * (n + 1) for _ in range(n)]
        for i in range(n):
            for j in range(n):
                send_off[i][j + 1] = send_off[i][j] + rows[i][j] * row
        recv_off = [0] * (n + 1)
        for i in range(n):
            recv_off[i + 1] = recv_off[i] + rows[i][me] * row
        longest = max(send_off[i][n] for i in range(n))
        for start in range(0, longest, self.chunk_bytes):
            end = start + self.chunk_bytes
            slots = self._buffer(torch.uint8)
            mine = min(end, send_off[me][n])
            if mine > start:
                slots[me, :mine - start].copy_(src[start:mine])
            self._sync("alltoall")
            for i in range(n):
                lo = max(start, send_off[i][me])
                hi = min(end, send_off[i][me + 1])
                if hi > lo:
                    at = recv_off[i] + lo - send_off[i][me]
                    out[at:at + hi - lo].copy_(slots[i, lo - start:hi - start])

    def barrier(self, opts=None):
        def run():
            self._buffer(torch.uint8)
            self._sync("barrier")
        return _Work(run)

    def __getattr__(self, name):
        # send/recv (Adasum), and whatever else: the Gloo group's.
        return getattr(self._gloo(), name)

    def shutdown(self) -> None:
        # Drop the callbacks into the process set: they close a reference cycle
        # that would keep its Gloo sockets open until the cyclic GC runs.
        self._gloo = self.abandon = _closed
        segment = self.__dict__.get("segment")
        if segment is None:
            return
        self.segment = None
        self._views.clear()
        self._slots.clear()
        self.data = self.meta = self.across = self._spare = None
        segment.close()


def for_set(settings_: Settings, store, rank: int, ranks: Sequence[int],
            gloo: Callable[[], object], abandon: Callable[[], Optional[BaseException]],
            data: bool = True, control: bool = True,
            across_hosts: Optional[Callable[[object, List[List[int]]], object]] = None,
            watch: store_wait.Watch = store_wait.no_watch) -> tuple:
    """``(data plane, control plane)`` of a process set on shared memory, or ``(None, None)``.

    Collective over the set's members (each publishes its host in the set's
    store). When its members span hosts, negotiation stays on Gloo and the data
    plane is ``across_hosts(store, layout)`` (the hierarchical plane of
    :mod:`.shm_hierarchy`, or None: Gloo); ``layout`` lists the set's ranks
    per host. ``data``/``control`` False leave that plane to another engine (MPI).
    ``abandon`` and ``watch`` end the waits for the other members early when
    the job fails or a member is gone (see :mod:`.store_wait`).
    """
    from .shm_control import ShmControlPlane

    store = dist.PrefixStore("shm/", store)
    layout = host_layout(store, settings_, rank, len(ranks), ranks, abandon, watch())
    if len(layout) > 1:
        if not data or across_hosts is None:
            return None, None
        return across_hosts(store, layout), None
    planes = [None, None]
    try:
        if data:
            planes[0] = ShmDataGroup(settings_, store, rank, len(ranks), ranks, gloo, abandon,
                                     gone=watch())
        if control:
            planes[1] = ShmControlPlane(settings_, store, rank, len(ranks), ranks, abandon,
                                        gone=watch())
    except BaseException:
        if planes[0] is not None:
            planes[0].shutdown()
        raise
    return tuple(planes)
