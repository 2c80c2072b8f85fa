"""Private torch.distributed process groups: the control and data planes.

Each process set owns two private groups created straight from the store,
never through ``init_process_group``, so the user's default group is never
touched:

* the *control* group (always Gloo, on CPU) carries negotiation: one small
  allreduce per cycle, plus gather/broadcast of pickled requests on misses;
* the *data* groups carry tensors: Gloo for CPU tensors, NCCL for CUDA
  tensors (created lazily on first use, at the same point on every rank
  because responses execute in the same order everywhere).

A group created lazily is entered only once every member has arrived at it
(:func:`_arrive`, polling the store): a group's own rendezvous cannot be given
up and, with no sockets yet, does not notice a peer that has gone -- a rank
that agreed on a collective just as the job failed would otherwise wait for
the whole timeout.

The executor talks to :class:`DataPlane` only through ``group_for(device)``;
the same executor code drives Gloo and NCCL.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import store_wait
from .errors import HvdlikeInternalError
from .store_wait import Gone, Watch


def _gloo_group(store, rank: int, size: int, timeout: datetime.timedelta, local_addr: str):
    """A Gloo group bound to ``local_addr`` (an IP or interface name) when given."""
    if local_addr and hasattr(dist.ProcessGroupGloo, "_Options"):
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        if all(c.isdigit() or c in ".:" for c in local_addr):
            device = dist.ProcessGroupGloo.create_device(hostname=local_addr)
        else:
            device = dist.ProcessGroupGloo.create_device(interface=local_addr)
        opts._devices = [device]
        return dist.ProcessGroupGloo(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


# How long a member waits for the decision to be written before the job's
# failure may end the wait (see _arrive).
_DECIDER_GRACE_SECONDS = 1.0


def _arrive(store, rank: int, size: int, timeout: datetime.timedelta,
            abandon: Callable[[], Optional[BaseException]], what: str,
            members: Optional[Sequence[int]] = None, gone: Gone = lambda ranks: "") -> None:
    """Return once all ``size`` members have come to create the group under ``store``.

    Raises when ``abandon()`` reports that the job has failed, when ``gone``
    names a missing member as gone (it left word or its heartbeat stopped: see
    :mod:`.store_wait`), or when ``timeout`` passes, naming the members still
    missing (as global ranks: ``members[i]`` is member ``i``'s).
    Whether the group is made is one decision for all: the first member to
    claim it (an atomic counter) writes "go" once everyone has arrived, or
    "stop" when it gives up. A member that wanted to give up but finds "go"
    enters after all -- the others are already entering and need it.
    """
    members = list(members) if members is not None else list(range(size))
    store.set(f"arrived/{rank}", "1")
    keys = [f"arrived/{r}" for r in range(size)]
    deadline = time.monotonic() + timeout.total_seconds()
    probe_at = time.monotonic() + store_wait.PROBE_SECONDS
    nap = 0.001
    why = None
    while True:
        if store.check(["verdict"]):
            break
        everyone = store.check(keys)
        if not everyone:
            error = abandon()
            now = time.monotonic()
            if error is not None:
                why = f"gave up creating the {what} group, the job has failed: {error}"
            elif now >= probe_at or now >= deadline:
                probe_at = now + store_wait.PROBE_SECONDS
                missing = [members[r] for r in range(size)
                           if not store.check([f"arrived/{r}"])]
                left = gone(missing) if missing else ""
                if left:
                    why = f"could not create the {what} group: {left}"
                elif now >= deadline:
                    why = (f"the {what} group was not created within "
                           f"{timeout.total_seconds():g}s: rank(s) {missing} of its {size} "
                           f"member(s) never came to create it")
        if everyone or why is not None:
            if store.add("decider", 1) == 1:
                if why is not None:
                    store.set("reason", why)  # before the verdict: who reads "stop" finds it
                store.set("verdict", "stop" if why is not None else "go")
            break
        time.sleep(nap)
        nap = min(nap * 2, 0.02)
    # Whoever claimed the decision writes it next, two store calls later; wait
    # for it. A decider that has not written it after a second has most likely
    # died in between: give up then if the job has failed (nobody is told "go"
    # while it stays unwritten), else at twice the timeout.
    claimed = time.monotonic()
    while not store.check(["verdict"]):
        now = time.monotonic()
        error = abandon() if now - claimed >= _DECIDER_GRACE_SECONDS else None
        if error is not None or now >= deadline + timeout.total_seconds():
            cause = f", and the job has failed: {error}" if error is not None else ""
            raise HvdlikeInternalError(f"no decision on creating the {what} group: the "
                                       f"member that took it never wrote it{cause}")
        time.sleep(0.005)
    if bytes(store.get("verdict")) == b"go":
        return
    if why is None and store.check(["reason"]):
        why = (f"gave up creating the {what} group: another member gave up "
               f"({bytes(store.get('reason')).decode()})")
    raise HvdlikeInternalError(why or f"gave up creating the {what} group: another "
                               f"member gave up (the job has failed or a member never came)")


def _nccl_group(store, rank: int, size: int, timeout: datetime.timedelta):
    if not dist.is_nccl_available():
        raise HvdlikeInternalError("a CUDA tensor was submitted but this torch has no NCCL")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)


class Groups:
    """Creates and owns the process groups of one process set."""

    def __init__(self, store, rank: int, size: int, timeout_seconds: float, local_addr: str = "",
                 gloo_control: bool = True,
                 abandon: Callable[[], Optional[BaseException]] = lambda: None,
                 members: Optional[Sequence[int]] = None, watch: Watch = store_wait.no_watch):
        self.store = store
        self.abandon = abandon  # the runtime's fatal error, if any (see _arrive)
        self.watch = watch  # makes a probe naming members that are gone (see _arrive)
        self.rank = rank
        self.size = size
        self.members = list(members) if members is not None else list(range(size))
        self.timeout = datetime.timedelta(seconds=timeout_seconds)
        self.local_addr = local_addr
        self._lock = threading.Lock()
        self._data: Dict[str, object] = {}
        # Set by close(). The background thread's teardown may close the groups
        # while a user thread still executes a cycle; that thread must then
        # fail, not make a group afresh under the keys of the first one.
        self._closed = False
        # None when negotiation runs on MPI (see mpi_plane.py).
        self.control = None
        if gloo_control:
            control_store = dist.PrefixStore("control/", store)
            if size > 1:
                self._arrive(control_store, rank, size, "control")
            self.control = _gloo_group(control_store, rank, size, self.timeout, local_addr)
        # The group CPU tensors use when it is not Gloo (an mpi_plane.MpiDataGroup).
        self.cpu_plane = None
        self.closers: List = []  # extra releases (an MPI control plane) run by close()

    def data(self, device_type: str):
        """The data-plane group for tensors on ``device_type`` ('cpu' or 'cuda')."""
        if device_type == "cpu" and self.cpu_plane is not None:
            return self.cpu_plane
        return self.torch_group(device_type)

    def torch_group(self, device_type: str):
        """The torch.distributed group (Gloo, or NCCL for 'cuda') for ``device_type``."""
        with self._lock:
            group = self._data.get(device_type)
            if group is None:
                self._refuse_if_closed(f"{device_type} data")
                prefix = dist.PrefixStore(f"data-{device_type}/", self.store)
                if self.size > 1:
                    self._arrive(prefix, self.rank, self.size, f"{device_type} data")
                if device_type == "cuda":
                    group = _nccl_group(prefix, self.rank, self.size, self.timeout)
                else:
                    group = _gloo_group(prefix, self.rank, self.size, self.timeout,
                                        self.local_addr)
                self._data[device_type] = group
            return group

    def subgroup(self, prefix: str, rank: int, members: Sequence[int]):
        """A Gloo group of some members only (collective over them), under ``prefix``.

        ``members``: the set ranks taking part, in subgroup rank order; ``rank``
        is this member's index among them.
        """
        self._refuse_if_closed(repr(prefix))
        store = dist.PrefixStore(prefix, self.store)
        size = len(members)
        if size > 1:
            self._arrive(store, rank, size, f"{prefix!r}", [self.members[m] for m in members])
        return _gloo_group(store, rank, size, self.timeout, self.local_addr)

    def _arrive(self, store, rank: int, size: int, what: str,
                members: Optional[Sequence[int]] = None) -> None:
        _arrive(store, rank, size, self.timeout, self.abandon, what,
                members if members is not None else self.members, self.watch())

    def _refuse_if_closed(self, what: str) -> None:
        if self._closed:
            raise HvdlikeInternalError(f"the {what} group cannot be created: this process "
                                       f"set's groups are closed (hvdlike has shut down or "
                                       f"the job has failed)")

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for group in [self.control, self.cpu_plane, *self._data.values()]:
            if group is None:
                continue
            shutdown = getattr(group, "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown()
                except Exception:  # already broken: nothing more to release
                    pass
        self._data.clear()
        for release in self.closers:
            release()
        self.closers = []


class GlooControlPlane:
    """Negotiation collectives over the control group (see controller.ControlPlane)."""

    def __init__(self, group, rank: int, size: int):
        self.group = group
        self.rank = rank
        self.size = size

    def allreduce_sum(self, values: Sequence[int]) -> List[int]:
        if self.size == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.int32)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self.group.allreduce([tensor], opts).wait()
        return tensor.tolist()

    def allreduce_min(self, value: int) -> int:
        """Minimum of one integer over ranks: the steady-state negotiation word.

        A 1-element Gloo allreduce is markedly cheaper than any longer one (a
        single chunk travels the ring), which is why the fast path is one word.
        """
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([tensor], opts).wait()
        return int(tensor.item())

    def _lengths(self, n: int) -> List[int]:
        mine = torch.tensor([n], dtype=torch.int64)
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self.group.allgather([out], [mine]).wait()
        return [int(t.item()) for t in out]

    def gather(self, payload: bytes) -> Optional[List[bytes]]:
        if self.size == 1:
            return [payload]
        lengths = self._lengths(len(payload))
        longest = max(lengths)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
            self.group.gather([out], [mine], opts).wait()
            return [bytes(t[:n].numpy()) for t, n in zip(out, lengths)]
        self.group.gather([], [mine], opts).wait()
        return None

    def broadcast(self, payload: Optional[bytes]) -> bytes:
        if self.size == 1:
            return payload
        length = torch.tensor([len(payload) if self.rank == 0 else 0], dtype=torch.int64)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([length], opts).wait()
        if self.rank == 0:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            data = torch.empty(int(length.item()), dtype=torch.uint8)
        if data.numel():
            self.group.broadcast([data], opts).wait()
        return payload if self.rank == 0 else bytes(data.numpy())
