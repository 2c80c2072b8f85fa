"""Adasum: adaptive summation of gradients across ranks.

Adasum (Maleki et al., "Scaling Distributed Training with Adaptive
Summation", MLSys 2021) combines two gradients ``a`` and ``b`` as

    (1 - a.b / (2 |a|^2)) a  +  (1 - a.b / (2 |b|^2)) b

Orthogonal gradients are summed; parallel ones are averaged; anything in
between gets a proportionate mix, which keeps large-batch training stable
without retuning the learning rate. The pairwise rule is applied over a
recursive-doubling pattern: at level ``d`` rank ``r`` exchanges its current
vector with rank ``r XOR 2^d`` and both compute the same combination (the
lower rank's vector always as ``a``, so both get identical bits). After
``log2(p)`` levels every rank holds the result.

Rank counts that are not a power of two: with ``q`` the largest power of two
below ``p``, rank ``q + i`` first hands its vector to rank ``i``, which
combines the two (its own as ``a``); the ``q`` lower ranks run the doubling;
rank ``i`` then sends the result back to rank ``q + i``. :func:`reference`
computes the same tree in one process, for tests and for users who want to
check the numbers.

Each tensor is combined on its own (never fused with others): the dot
products are per tensor, i.e. per layer, as the method intends. Vectors
travel on a dedicated Gloo group of the process set, point to point; CUDA
tensors are staged through host memory. A rank that has joined contributes
zeros, which the rule leaves out (``combine(a, 0) == a``).

CUDA tensors (or every tensor, with ``HVDLIKE_ADASUM_HIERARCHICAL=1``) are
combined hierarchically, as Horovod's GPU Adasum: an average inside each host,
Adasum across hosts (:meth:`AdasumRunner.hierarchical_reduce`,
:func:`hierarchical_reference`).
"""

from __future__ import annotations

import hashlib
from typing import List, Optional, Sequence

import torch

from .errors import HvdlikeInternalError
from .wire import scale

_TAG_LEVELS = 64  # tags per operation: levels plus the fold steps
_HOST_TAGS = 2  # hierarchical: tags of the transfers inside a host, before the leaders'


# Below this squared norm a vector's Adasum coefficient stays 1 (Horovod's
# threshold): the parameter changes the Adasum optimizer combines (lr x
# gradient) of biases and small layers often are that small, and must move
# parameters as much as they do under Horovod.
TINY_NORM_SQUARED = 1e-8


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The Adasum of two vectors of the same shape (a new tensor, dtype of ``a``).

    Dot products run in float64. A vector whose squared norm is below
    :data:`TINY_NORM_SQUARED` keeps its coefficient 1, as in Horovod: two such
    vectors are summed (a zero vector contributes nothing either way).
    """
    a64 = a.reshape(-1).to(torch.float64)
    b64 = b.reshape(-1).to(torch.float64)
    dot = float(torch.dot(a64, b64))
    aa = float(torch.dot(a64, a64))
    bb = float(torch.dot(b64, b64))
    ca = 1.0 - dot / (2.0 * aa) if aa >= TINY_NORM_SQUARED else 1.0
    cb = 1.0 - dot / (2.0 * bb) if bb >= TINY_NORM_SQUARED else 1.0
    work = a.dtype if a.dtype in (torch.float32, torch.float64) else torch.float32
    out = a.to(work) * ca + b.to(work) * cb
    return out.to(a.dtype)


def _largest_power_of_two(n: int) -> int:
    q = 1
    while q * 2 <= n:
        q *= 2
    return q


def reference(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Adasum of one tensor per rank, in rank order, computed in one process.

    Follows exactly the pairing the distributed version uses, so results
    agree to rounding.
    """
    p = len(tensors)
    if p == 0:
        raise ValueError("adasum reference needs at least one tensor")
    q = _largest_power_of_two(p)
    vals: List[torch.Tensor] = [t.clone() for t in tensors[:q]]
    for i in range(p - q):
        vals[i] = combine(vals[i], tensors[q + i])
    distance = 1
    while distance < q:
        vals = [combine(vals[r], vals[r ^ distance]) if r < r ^ distance
                else combine(vals[r ^ distance], vals[r]) for r in range(q)]
        distance *= 2
    return vals[0]


def hierarchical_reference(tensors: Sequence[torch.Tensor],
                           hosts: Sequence[Sequence[int]]) -> torch.Tensor:
    """The hierarchical Adasum (:meth:`AdasumRunner.hierarchical_reduce`) in one process.

    ``hosts``: the ranks of each host (hosts ordered by their first rank). The
    tensors of a host are summed in rank order and divided by their number (an
    average), then the averages are combined by :func:`reference` in host order.
    """
    means = []
    for ranks in hosts:
        total = tensors[ranks[0]].clone()
        for r in ranks[1:]:
            total = total + tensors[r]
        means.append(total / len(ranks) if len(ranks) > 1 else total)
    return reference(means)


def host_code(host: str) -> int:
    """A 63-bit number naming ``host`` (members compare numbers, not strings)."""
    return int.from_bytes(hashlib.sha256(host.encode()).digest()[:8], "little") >> 1


class AdasumRunner:
    """Runs Adasum allreduces of one process set over point-to-point Gloo transfers.

    ``hierarchical`` (``HVDLIKE_ADASUM_HIERARCHICAL``): None runs CUDA tensors
    hierarchically and CPU tensors flat, as Horovod does; True / False force it.
    Hierarchical: the members of each host (``host``, this member's host key)
    average their vectors at the host's first member, those members combine
    the averages with Adasum, and each sends the result back to its host's
    members -- Horovod's GPU Adasum (NCCL's averaging inside each node, Adasum
    across nodes), so on one host it is the average.
    """

    def __init__(self, groups, rank: int, size: int, host: str = "",
                 hierarchical: Optional[bool] = None):
        self.groups = groups
        self.rank = rank
        self.size = size
        self.host = host
        self.hierarchical = hierarchical
        self._hosts: Optional[List[List[int]]] = None
        self.count = 0  # operations launched; identical on every rank (same order)

    def next_tag(self) -> int:
        """Tag base of the next operation; taken in launch order, so ranks agree."""
        tag = (self.count % (1 << 20)) * _TAG_LEVELS
        self.count += 1
        return tag

    def _exchange(self, group, mine: torch.Tensor, peer: int, tag: int) -> torch.Tensor:
        theirs = torch.empty_like(mine)
        send = group.send([mine], peer, tag)
        group.recv([theirs], peer, tag).wait()
        send.wait()
        return theirs

    def reduce(self, vector: torch.Tensor, tag: int) -> torch.Tensor:
        """This rank's Adasum result for its contiguous CPU ``vector``."""
        if self.size == 1:
            return vector
        group = self.groups.data("adasum")  # private: p2p never meets the data collectives
        return self._adasum_over(group, vector, list(range(self.size)), self.rank, tag)

    def _adasum_over(self, group, vector: torch.Tensor, members: List[int], r: int,
                     tag: int) -> torch.Tensor:
        """Adasum among ``members`` (set ranks, in order); ``r``: this member's index."""
        p = len(members)
        if p == 1:
            return vector
        q = _largest_power_of_two(p)
        x = vector
        if r >= q:  # fold in, wait for the result, done
            group.send([x], members[r - q], tag).wait()
            out = torch.empty_like(x)
            group.recv([out], members[r - q], tag + 1).wait()
            return out
        if r + q < p:
            extra = torch.empty_like(x)
            group.recv([extra], members[r + q], tag).wait()
            x = combine(x, extra)
        distance, level = 1, 2
        while distance < q:
            peer = r ^ distance
            theirs = self._exchange(group, x.contiguous(), members[peer], tag + level)
            x = combine(x, theirs) if r < peer else combine(theirs, x)
            distance *= 2
            level += 1
        if r + q < p:
            group.send([x.contiguous()], members[r + q], tag + 1).wait()
        return x

    def hosts(self, group) -> List[List[int]]:
        """The set's ranks by host, hosts ordered by their first rank.

        Collective over the set the first time (an allgather of host codes):
        every member asks at the same operation, the first hierarchical one.
        """
        if self._hosts is None:
            mine = torch.tensor([host_code(self.host)], dtype=torch.int64)
            codes = [torch.empty(1, dtype=torch.int64) for _ in range(self.size)]
            group.allgather([codes], [mine]).wait()
            layout: dict = {}
            for r, code in enumerate(codes):
                layout.setdefault(int(code), []).append(r)
            self._hosts = list(layout.values())
        return self._hosts

    def hierarchical_reduce(self, vector: torch.Tensor, tag: int) -> torch.Tensor:
        """Average inside each host, Adasum between hosts, the result back to every member."""
        if self.size == 1:
            return vector
        group = self.groups.data("adasum")
        layout = self.hosts(group)
        mine = next(ranks for ranks in layout if self.rank in ranks)
        leader = mine[0]
        if self.rank != leader:
            group.send([vector], leader, tag).wait()
            out = torch.empty_like(vector)
            group.recv([out], leader, tag + 1).wait()
            return out
        x = vector
        for member in mine[1:]:  # in rank order, as hierarchical_reference sums
            theirs = torch.empty_like(vector)
            group.recv([theirs], member, tag).wait()
            x = x + theirs
        if len(mine) > 1:
            x = x / len(mine)
        leaders = [ranks[0] for ranks in layout]
        # Leaders' own tags start past the two used inside hosts.
        x = self._adasum_over(group, x.contiguous(), leaders, leaders.index(self.rank),
                              tag + _HOST_TAGS)
        for member in mine[1:]:
            group.send([x], member, tag + 1).wait()
        return x

    def finalizer(self, items):
        """The completion of one Adasum allreduce (``items`` holds a single response).

        Takes the operation's tag now, in launch order; the returned callable
        runs the exchanges on the executor's completion thread, so the
        background thread keeps negotiating meanwhile.
        """
        (response, entry), = items
        tag = self.next_tag()
        hierarchical = self.hierarchical
        if hierarchical is None:  # Horovod: hierarchical on GPUs, flat on CPUs
            hierarchical = response.device.startswith("cuda")
        if entry is not None:
            source = entry.tensor
        else:  # a joined rank stands in with zeros, which Adasum leaves out
            source = torch.zeros(response.shape, dtype=getattr(torch, response.dtype),
                                 device=response.device)

        def finalize():
            vector = source.detach().reshape(-1).to("cpu", copy=True).contiguous()
            scale(vector, response.prescale)
            try:
                if hierarchical:
                    result = self.hierarchical_reduce(vector, tag)
                else:
                    result = self.reduce(vector, tag)
            except HvdlikeInternalError:
                raise
            except Exception as exc:
                raise HvdlikeInternalError(f"Adasum exchange of {response.name!r} failed: "
                                           f"{exc}") from exc
            scale(result, response.postscale)
            if entry is None:
                return [None]
            entry.output.view(-1).copy_(result)
            return [entry.output]

        return finalize
