"""Hierarchical allreduce and allgather for a process set that spans hosts.

The members of a set on one host share memory (:mod:`.shm_plane`); between
hosts only Gloo's sockets remain. A flat Gloo ring moves every byte between
all members over TCP, loopback included. Here a collective runs in three
phases, each on the cheapest engine for it:

* **inside each host**, on shared memory: an allreduce is reduced to the
  host's first member (the *leader*; every member reduces a portion, see
  ``ShmDataGroup._allreduce``), an allgather gathers the host's parts to it;
* **between hosts**, among the leaders only, over their own Gloo group: one
  allreduce (or allgather of the hosts' blocks) with as many participants as
  there are hosts;
* **inside each host** again: the leader's result is broadcast on shared memory.

The reduction is associative for every op the plane runs (sum, product, min,
max; average is a sum the executor scales afterwards), so a sum or product
equals the flat one up to the rounding of a different summation order. Min and
max of floating tensors never arrive here as floats: the leaders' Gloo step
would keep or drop a NaN by host order. The executor hands over their integer
image (:mod:`.nan_order`), which every phase reduces exactly, so they equal
the flat result bit for bit, NaN and the sign of zero included.

:func:`wanted` decides per collective kind: ``HVDLIKE_HIERARCHICAL_ALLREDUCE``
/ ``HVDLIKE_HIERARCHICAL_ALLGATHER`` (or their ``HOROVOD_`` names) force it on
or off; unset (``auto``) it is on when the set spans hosts and some host has
more than one of its members, since only then does a phase on shared memory
replace socket traffic. Broadcast, alltoall, barrier, reducescatter's staging
and Adasum's point-to-point traffic stay on the set's flat Gloo group.

Like :class:`~.shm_plane.ShmDataGroup`, :class:`HierarchicalGroup` offers the
slice of the ``ProcessGroup`` interface the executor uses; its work objects
run the three phases in ``wait()`` on the thread that launches them, in the
launch order every member shares, and record the phases for the timeline
(``SHM_REDUCE``, ``GLOO_CROSS_ALLREDUCE``, ``SHM_BROADCAST``...).
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import store_wait
from .errors import HvdlikeInternalError
from .shm_plane import Settings, ShmDataGroup, _bytes, _closed, _reducer


def wanted(knob: Optional[bool], layout: Sequence[Sequence[int]]) -> bool:
    """Whether a set whose members sit on hosts ``layout`` runs a kind hierarchically.

    ``knob`` True/False forces it; None (auto) chooses it when the set spans
    hosts and some host holds more than one of its members.
    """
    if len(layout) < 2:
        return False
    if knob is not None:
        return knob
    return any(len(members) > 1 for members in layout)


class _Work:
    """Runs the phases in ``wait()``; ``phases`` lists ``(name, start, end)`` afterwards."""

    __slots__ = ("_run", "_done", "phases")
    # Run by the launching thread in launch order, like the shared-memory plane's
    # (the leaders' Gloo phase blocks it only for the length of the transfer).
    inline = True
    engine = "HIER"

    def __init__(self, run: Callable[[List[tuple]], None]):
        self._run = run
        self._done = False
        self.phases: List[tuple] = []

    def wait(self, timeout=None) -> bool:
        if not self._done:
            self._done = True
            self._run(self.phases)
        return True

    def is_completed(self) -> bool:
        return self._done


def _no_gloo():
    raise HvdlikeInternalError("the host-local phase of a hierarchical collective has no "
                               "Gloo fallback")


def _adjacent(targets: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """One byte view over ``targets`` when they lie back to back in one storage."""
    first = targets[0]
    part = first.numel()
    base, storage = first.data_ptr(), first.untyped_storage().data_ptr()
    for i, t in enumerate(targets):
        if (t.numel() != part or t.data_ptr() != base + i * part
                or t.untyped_storage().data_ptr() != storage):
            return None
    return first.as_strided((part * len(targets),), (1,))


class HierarchicalGroup:
    """CPU allreduce/allgather of a multi-host set in three phases; the rest on flat Gloo.

    Args:
        layout: the set's ranks grouped by host (hosts ordered by lowest rank).
        rank: this member's rank in the set.
        local: the host's shared-memory plane (None when alone on its host).
        cross: the leaders' Gloo group (None on members that are not leaders).
        gloo: returns the set's flat Gloo group.
        allreduce, allgather: which kinds run hierarchically.
    """

    scales = False  # allreduce() takes no ``post`` (see ShmDataGroup)
    alone_bytes = 0  # every allreduce may be fused (see ShmDataGroup)

    def __init__(self, layout: Sequence[Sequence[int]], rank: int,
                 local: Optional[ShmDataGroup], cross, gloo: Callable[[], object],
                 allreduce: bool, allgather: bool):
        self.layout = [list(h) for h in layout]
        self.rank = rank
        self.size = sum(len(h) for h in layout)
        self.host = next(i for i, h in enumerate(self.layout) if rank in h)
        self.local_rank = self.layout[self.host].index(rank)
        self.local = local
        self.cross = cross
        self._gloo = gloo
        self.hierarchical_allreduce = allreduce
        self.hierarchical_allgather = allgather

    # -- allreduce ------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        reduce = _reducer(opts)
        if (not self.hierarchical_allreduce or len(tensors) != 1 or reduce is None
                or not tensors[0].is_contiguous()):
            return self._gloo().allreduce(tensors, opts)
        flat = tensors[0].reshape(-1)
        return _Work(lambda phases: self._allreduce(flat, reduce, opts, phases))

    def _allreduce(self, flat: torch.Tensor, reduce, opts, phases: List[tuple]) -> None:
        if flat.numel() == 0:
            return
        started = time.monotonic()
        if self.local is not None:
            self.local._allreduce(flat, reduce, root=0)
            phases.append(("SHM_REDUCE", started, time.monotonic()))
        if self.cross is not None:
            begun = time.monotonic()
            # Gloo compares floats with < and >: a floating min or max comes as
            # its integer image (see the module's docstring).
            self.cross.allreduce([flat], opts if opts is not None
                                 else dist.AllreduceOptions()).wait()
            phases.append(("GLOO_CROSS_ALLREDUCE", begun, time.monotonic()))
        if self.local is not None:
            begun = time.monotonic()
            self.local._broadcast(_bytes(flat), 0)
            phases.append(("SHM_BROADCAST", begun, time.monotonic()))

    # -- allgather ------------------------------------------------------------------------

    def allgather(self, output_lists, inputs):
        outs = output_lists[0] if len(output_lists) == 1 else None
        if (not self.hierarchical_allgather or outs is None or len(inputs) != 1
                or len(outs) != self.size
                or not all(t.is_contiguous() for t in [inputs[0], *outs])
                or any(t.numel() != inputs[0].numel() or t.dtype != inputs[0].dtype
                       for t in outs)):
            return self._gloo().allgather(output_lists, inputs)
        mine = _bytes(inputs[0])
        targets = [_bytes(t) for t in outs]
        return _Work(lambda phases: self._allgather(mine, targets, phases))

    def _allgather(self, mine: torch.Tensor, targets: List[torch.Tensor],
                   phases: List[tuple]) -> None:
        part = mine.numel()
        if part == 0:
            return
        members = self.layout[self.host]
        leader = self.local_rank == 0
        started = time.monotonic()
        if leader:
            widest = max(len(h) for h in self.layout)
            block = torch.empty(widest * part, dtype=torch.uint8)
            pieces = [block[j * part:(j + 1) * part] for j in range(len(members))]
        else:
            block, pieces = None, [mine] * len(members)  # not read: only the leader gathers
        if self.local is not None:
            self.local._allgather(mine, pieces, root=0)
            phases.append(("SHM_GATHER", started, time.monotonic()))
        else:
            pieces[0].copy_(mine)
        if leader:
            begun = time.monotonic()
            hosts = len(self.layout)
            gathered = torch.empty(hosts * block.numel(), dtype=torch.uint8)
            self.cross.allgather([list(gathered.chunk(hosts))], [block]).wait()
            phases.append(("GLOO_CROSS_ALLGATHER", begun, time.monotonic()))
            begun = time.monotonic()
            stride = block.numel()
            for h, ranks in enumerate(self.layout):
                for j, r in enumerate(ranks):
                    at = h * stride + j * part
                    targets[r].copy_(gathered[at:at + part])
            phases.append(("MEMCPY_OUT_HOST_BLOCKS", begun, time.monotonic()))
        if self.local is not None:
            begun = time.monotonic()
            whole = _adjacent(targets)
            staged = whole is None
            if staged:
                whole = torch.empty(part * len(targets), dtype=torch.uint8)
                if leader:
                    torch.cat(targets, out=whole)
            self.local._broadcast(whole, 0)
            if staged and not leader:
                for i, t in enumerate(targets):
                    t.copy_(whole[i * part:(i + 1) * part])
            phases.append(("SHM_BROADCAST", begun, time.monotonic()))

    # -- the rest ---------------------------------------------------------------------------

    def __getattr__(self, name):
        # broadcast, alltoall_base, barrier, send/recv (Adasum): the set's flat Gloo group.
        if name.startswith("__") or "_gloo" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self._gloo(), name)

    def shutdown(self) -> None:
        self._gloo = _closed
        local, self.local = self.__dict__.get("local"), None
        cross, self.cross = self.__dict__.get("cross"), None
        if local is not None:
            local.shutdown()
        if cross is not None:
            try:
                cross.shutdown()
            except Exception:  # already broken: nothing more to release
                pass


def build(settings_: Settings, store, rank: int, ranks: Sequence[int],
          layout: Sequence[Sequence[int]], gloo: Callable[[], object],
          abandon: Callable[[], Optional[BaseException]],
          subgroup: Callable[[str, int, Sequence[int]], object],
          watch: store_wait.Watch = store_wait.no_watch) -> Optional[HierarchicalGroup]:
    """The set's :class:`HierarchicalGroup`, or None when neither kind is wanted.

    Collective over the set: the members of each host map their segment, then
    the leaders form their Gloo group.
    """
    allreduce = wanted(settings_.hierarchical_allreduce, layout)
    allgather = wanted(settings_.hierarchical_allgather, layout)
    if not (allreduce or allgather):
        return None
    host = next(i for i, h in enumerate(layout) if rank in h)
    members = list(layout[host])
    me = members.index(rank)
    local = cross = None
    try:
        if len(members) > 1:
            local = ShmDataGroup(settings_, dist.PrefixStore(f"host{host}/", store), me,
                                 len(members), [ranks[m] for m in members], _no_gloo, abandon,
                                 gone=watch())
        if me == 0:
            cross = subgroup("hier-cross/", host, [h[0] for h in layout])
    except BaseException:
        if local is not None:
            local.shutdown()
        raise
    return HierarchicalGroup(layout, rank, local, cross, gloo, allreduce, allgather)
