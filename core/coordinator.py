"""Rank 0's side of negotiation: collect requests, validate, order, respond.

Pure logic, no communication: :class:`Coordinator` is fed the requests each
rank sent this cycle and returns the responses that became ready, in the one
order every rank will execute them. Tested without processes.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from .messages import OpType, Request, Response


def _mismatch(name: str, what: str, requests: Sequence[Request],
              ranks: Optional[Sequence[int]] = None) -> str:
    lines = [f"ranks disagree on {what} of collective {name!r}; each rank submitted:"]
    for req in sorted(requests, key=lambda r: r.rank):
        lines.append(f"  rank {_global(req.rank, ranks)}: {req.describe()}")
    return "\n".join(lines)


def _global(set_rank: int, ranks: Optional[Sequence[int]]) -> int:
    """The global rank of member ``set_rank`` (requests carry their rank in the set)."""
    return set_rank if ranks is None else ranks[set_rank]


def _member_failed(name: str, group: str, error: str) -> str:
    return f"collective {name!r} is a member of group {group!r}, which failed:\n{error}"


def _same(requests: Sequence[Request], key) -> bool:
    first = key(requests[0])
    return all(key(r) == first for r in requests[1:])


# Collectives that fail while some ranks have joined (Horovod refuses them too).
NOT_WITH_JOIN = frozenset({OpType.ALLGATHER, OpType.BROADCAST, OpType.ALLTOALL,
                           OpType.REDUCESCATTER})


def build_response(requests: Sequence[Request], size: int, joined: Iterable[int] = (),
                   ranks: Optional[Sequence[int]] = None) -> Response:
    """Validate the requests all ranks made for one name and build its response.

    Args:
        requests: one request per participating rank.
        size: number of ranks in the process set.
        joined: ranks that have joined and contribute neutral values instead.
        ranks: the set's global ranks, to name its members in errors (None:
            the set ranks are the global ones).

    Returns:
        A response to execute, or one whose ``error`` explains the mismatch.
    """
    first = requests[0]
    name = first.name
    joined = tuple(sorted(joined))
    base = dict(name=name, op=first.op, dtype=first.dtype, shape=first.shape,
                device=first.device, group=first.group, joined=joined,
                # Uncached only when every rank made the name for one call: a rank
                # that may submit it again keeps it cached, as a named tensor is.
                once=all(r.once for r in requests))

    def error(what: str) -> Response:
        return Response(error=_mismatch(name, what, requests, ranks), **base)

    if not _same(requests, lambda r: r.op):
        return error("the operation")
    if joined and first.op in NOT_WITH_JOIN:
        # As in Horovod: only allreduce has a neutral value a joined rank can stand in with.
        return Response(error=f"{first.op.name.lower()} {name!r} cannot run while rank(s) "
                              f"{', '.join(str(_global(r, ranks)) for r in joined)} have "
                              f"called join(); only "
                              "allreduce (and barrier) can", **base)
    if not _same(requests, lambda r: r.dtype):
        return error("the dtype")
    if not _same(requests, lambda r: r.device.split(":")[0]):
        return error("the device type")
    op = first.op
    if op in (OpType.ALLREDUCE, OpType.REDUCESCATTER, OpType.BROADCAST):
        if not _same(requests, lambda r: r.shape):
            return error("the shape")
    if op in (OpType.ALLGATHER, OpType.ALLTOALL):
        if not _same(requests, lambda r: r.shape[1:]):
            return error("the shape beyond the first dimension")
    if op in (OpType.ALLREDUCE, OpType.REDUCESCATTER):
        if not _same(requests, lambda r: r.reduce_op):
            return error("the reduction op")
        if not _same(requests, lambda r: (r.prescale, r.postscale)):
            return error("the prescale/postscale factors")
        base.update(reduce_op=first.reduce_op, prescale=first.prescale, postscale=first.postscale)
    if op == OpType.BROADCAST:
        if not _same(requests, lambda r: r.root):
            return error("the root rank")
        base.update(root=first.root)
    if op == OpType.ALLGATHER:
        dims = [0] * size
        for r in requests:
            dims[r.rank] = r.shape[0] if r.shape else 1
        base.update(first_dims=tuple(dims))
    if op == OpType.ALLTOALL:
        splits: List[Tuple[int, ...]] = [()] * size
        for r in requests:
            if r.splits is None or len(r.splits) != size:
                return error(f"the splits (each rank needs {size} entries)")
            splits[r.rank] = tuple(r.splits)
        base.update(splits=tuple(splits))
    if not _same(requests, lambda r: (r.group, r.group_size)):
        return error("the group")
    if not _same(requests, lambda r: r.layout):
        return error("the member shapes (the ranks' models differ)")
    return Response(**base)


class Coordinator:
    """Collects requests from all ranks until every rank has submitted a name."""

    def __init__(self, size: int, record_arrivals: Callable[[], bool] = lambda: False,
                 ranks: Optional[Sequence[int]] = None):
        self.size = size
        self.ranks = None if ranks is None or list(ranks) == list(range(size)) else list(ranks)
        self.joined: Set[int] = set()
        self._last_joined = -1
        # name -> {rank: request}; dict order is first-submission order.
        self._table: Dict[str, Dict[int, Request]] = {}
        self._first_seen: Dict[str, float] = {}
        # group name -> completed responses waiting for the rest of the group.
        self._groups: Dict[str, List[Response]] = {}
        # group name -> (why it failed, rank -> members that rank still owes): a group
        # fails whole; members arriving after the failure fail at once.
        self._failed: Dict[str, Tuple[str, Dict[int, int]]] = {}
        self._refused: List[Response] = []  # such members, answered at the next ready()
        # Readiness times for the timeline, recorded only while ``record_arrivals()``:
        # name -> {rank: when its request was first added}, kept until the name's
        # response is released; ``arrivals`` holds those of the last ready() call.
        self._record_arrivals = record_arrivals
        self._arrived: Dict[str, Dict[int, float]] = {}
        self.arrivals: Dict[str, Dict[int, float]] = {}

    def __len__(self) -> int:
        return len(self._table)

    def add(self, requests: Iterable[Request], now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        arrived = self._arrived if self._record_arrivals() else None
        for req in requests:
            if req.group in self._failed and self._failed[req.group][1].get(req.rank, 0) > 0:
                self._refused.append(self._group_error(req.name, req.group, [req]))
                self._owes(req.group, [req.rank])
                continue
            row = self._table.setdefault(req.name, {})
            self._first_seen.setdefault(req.name, now)
            row[req.rank] = req
            if arrived is not None:
                arrived.setdefault(req.name, {}).setdefault(req.rank, now)
            if req.op == OpType.JOIN and req.rank not in self.joined:
                self.joined.add(req.rank)
                self._last_joined = req.rank

    def ready(self) -> List[Response]:
        """Responses for every name all (non-joined) ranks have submitted."""
        out: List[Response] = self._refused
        self._refused = []
        active = [r for r in range(self.size) if r not in self.joined]
        # While some rank has joined, a collective it cannot stand in for fails at
        # once for whoever submitted it: the others may never submit the same name.
        refuse = bool(self.joined)
        complete = [n for n, row in self._table.items() if all(r in row for r in active)
                    or (refuse and next(iter(row.values())).op in NOT_WITH_JOIN)]
        # The join completes last, after every tensor the joined ranks stood in for.
        complete.sort(key=lambda n: next(iter(self._table[n].values())).op == OpType.JOIN)
        for name in complete:
            row = self._table.pop(name)
            self._first_seen.pop(name, None)
            joined = [r for r in self.joined if r not in row]
            if refuse and next(iter(row.values())).op in NOT_WITH_JOIN:
                joined = sorted(self.joined)
            resp = build_response(list(row.values()), self.size, joined, self.ranks)
            if resp.op == OpType.JOIN:
                # Every rank has joined: report the last one and start afresh.
                resp = Response(name=name, op=OpType.JOIN, dtype=resp.dtype, shape=(),
                                root=self._last_joined, error=resp.error)
                self.joined.clear()
            group_size = next(iter(row.values())).group_size
            if resp.group in self._failed:
                out.append(self._group_error(name, resp.group, list(row.values())))
                self._owes(resp.group, list(row))
                continue
            if resp.group and resp.error:
                out.extend(self._fail_group(resp, list(row.values())))
                continue
            if resp.group and group_size > 1 and not resp.error:
                members = self._groups.setdefault(resp.group, [])
                members.append(resp)
                if len(members) < group_size:
                    continue
                del self._groups[resp.group]
                out.extend(members)
            else:
                out.append(resp)
        for name in [n for n, row in self._table.items()
                     if self._failed and next(iter(row.values())).group in self._failed]:
            # Members of a failed group that not every rank submitted (a rank
            # sent more members than another): they fail for whoever sent them.
            row = self._table.pop(name)
            self._first_seen.pop(name, None)
            group = next(iter(row.values())).group
            out.append(self._group_error(name, group, list(row.values())))
            self._owes(group, list(row))
        if self._arrived:
            self.arrivals = {r.name: self._arrived.pop(r.name) for r in out
                             if r.name in self._arrived}
        elif self.arrivals:
            self.arrivals = {}
        return out

    def _fail_group(self, resp: Response, requests: Sequence[Request]) -> List[Response]:
        """``resp``, a group member's error, fails the whole group: members parked
        waiting for the rest fail with it, later ones as they come (see :meth:`add`)."""
        parked = self._groups.pop(resp.group, [])
        owed = {}
        for req in requests:  # every rank sent this member: each declared its group size
            owed[req.rank] = max(0, req.group_size - 1 - len(parked))
        if any(owed.values()):
            self._failed[resp.group] = (resp.error, owed)
        return [resp] + [dataclasses.replace(p, error=_member_failed(p.name, resp.group,
                                                                   resp.error))
                         for p in parked]

    def _owes(self, group: str, ranks: Sequence[int]) -> None:
        """Count one member of failed ``group`` from each of ``ranks``; the group is
        forgotten once no rank owes one (its name may then be used afresh)."""
        if group not in self._failed:
            return
        _, owed = self._failed[group]
        for rank in ranks:
            if owed.get(rank, 0) > 0:
                owed[rank] -= 1
        if not any(owed.values()):
            del self._failed[group]

    def _group_error(self, name: str, group: str, requests: Sequence[Request]) -> Response:
        first = requests[0]
        return Response(name=name, op=first.op, dtype=first.dtype, shape=first.shape,
                        device=first.device, group=group,
                        error=_member_failed(name, group, self._failed.get(
                            group, ("another of its members failed",))[0]))

    def pending(self, now: Optional[float] = None) -> List[Tuple[str, float, List[int]]]:
        """``(name, seconds waiting, global ranks missing)`` for every incomplete name.

        Safe to call from another thread (the health watcher's): it reads a
        snapshot of the table the negotiating thread changes."""
        now = time.monotonic() if now is None else now
        ranks = self.ranks or list(range(self.size))
        joined = set(self.joined)
        result = []
        for name, row in list(self._table.items()):
            first = self._first_seen.get(name)
            if first is None:  # released between the snapshot and this read
                continue
            missing = [ranks[r] for r in range(self.size) if r not in row and r not in joined]
            result.append((name, now - first, missing))
        return result
