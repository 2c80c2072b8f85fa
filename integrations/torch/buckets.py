"""Gradient buckets of ``DistributedOptimizer``: many small gradients, one allreduce.

A bucket is a flat buffer with one view per member parameter. Members are
assigned at construction from the parameter list alone (so identically on
every rank), in reverse registration order -- the order backward produces
gradients -- so the first bucket can leave while backward still runs.

Per gradient, the hook only counts (:meth:`Bucket.mark`); once every member
is ready the bucket copies all gradients in with one batched call
(:meth:`Bucket.pack`), and after the reduction copies them back out the same
way (:meth:`Bucket.unpack`). Hundreds of small tensors thus cost a handful of
torch calls instead of two per gradient.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional

import torch

# Largest bucket, like DDP's default; a smaller core fusion threshold wins.
BUCKET_CAP_BYTES = 25 * 1024 * 1024
# Gradients this large (or above the cap) skip buckets: their per-gradient cost
# is small next to their transfer, reducing them in place saves two copies, and
# each can leave as soon as backward produces it.
LARGE_GRADIENT_BYTES = 1024 * 1024

_foreach_copy = getattr(torch, "_foreach_copy_", None)


def _copy_all(destinations: List[torch.Tensor], sources: List[torch.Tensor]) -> None:
    if not destinations:
        return
    if _foreach_copy is not None:
        _foreach_copy(destinations, sources)
    else:  # older torch: one call per tensor
        for dst, src in zip(destinations, sources):
            dst.copy_(src)


class Bucket:
    """A flat buffer holding several parameters' gradients, reduced as one tensor."""

    def __init__(self, index: int, name: str, members: List[torch.Tensor]) -> None:
        self.index = index
        self.name = name
        self.members = members
        total = sum(p.numel() for p in members)
        self.flat = torch.empty(total, dtype=members[0].dtype, device=members[0].device)
        self.views = []
        offset = 0
        for p in members:
            self.views.append(self.flat[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        self.reset()

    def reset(self) -> None:
        self.marked = [False] * len(self.members)
        self.pending = len(self.members)

    def mark(self, slot: int) -> bool:
        """Member ``slot``'s gradient is final for this round; True once all are."""
        if not self.marked[slot]:
            self.marked[slot] = True
            self.pending -= 1
        return self.pending == 0

    def pack(self, sparse: Callable[[torch.Tensor], Optional[torch.Tensor]]) -> None:
        """Copy every member's gradient into the flat buffer (zeros where there is none).

        ``sparse(p)`` is called for a member holding a sparse gradient and
        returns the dense gradient to pack, or None when the gradient travels
        on its own (its slot then carries zeros).
        """
        destinations, sources = [], []
        for p, view in zip(self.members, self.views):
            # A parameter frozen since construction contributes zeros, as it is not reduced.
            grad = p.grad if p.requires_grad else None
            if grad is not None and grad.is_sparse:
                grad = sparse(p)
            if grad is None:
                view.zero_()
            else:
                destinations.append(view)
                sources.append(grad)
        _copy_all(destinations, sources)

    def unpack(self) -> None:
        """Copy the reduced values back into each trainable member's ``.grad``."""
        destinations, sources = [], []
        for p, view in zip(self.members, self.views):
            if not p.requires_grad:
                continue  # frozen since construction: its gradient is left alone
            grad = p.grad
            if grad is not None and grad.is_sparse:
                continue  # reduced by its own sparse handle
            if grad is None:
                grad = p.grad = torch.empty_like(p, memory_format=torch.preserve_format)
            destinations.append(grad)
            sources.append(view)
        _copy_all(destinations, sources)


def plan(params: Iterable[torch.Tensor], names: Dict[torch.Tensor, str],
         threshold: int) -> List[Bucket]:
    """Buckets for the dense trainable ``params`` (in registration order).

    Gradients of ``min(threshold, BUCKET_CAP_BYTES, LARGE_GRADIENT_BYTES)``
    bytes or more, and sparse parameters, stay out. Buckets hold one dtype
    and device each, up to ``min(threshold, BUCKET_CAP_BYTES)`` bytes; a
    threshold of 0 (fusion disabled) gives no buckets.
    """
    if threshold == 0:
        return []
    cap = min(threshold, BUCKET_CAP_BYTES)
    open_by_kind: Dict[tuple, List[torch.Tensor]] = {}
    sizes: Dict[tuple, int] = {}
    closed: List[List[torch.Tensor]] = []
    for p in reversed(list(params)):
        if not p.requires_grad or p.is_sparse:
            continue
        kind = (p.dtype, p.device)
        nbytes = p.numel() * p.element_size()
        if nbytes >= min(cap, LARGE_GRADIENT_BYTES):
            continue
        members = open_by_kind.setdefault(kind, [])
        if members and sizes[kind] + nbytes > cap:
            closed.append(members)
            members = open_by_kind[kind] = []
            sizes[kind] = 0
        members.append(p)
        sizes[kind] = sizes.get(kind, 0) + nbytes
    closed.extend(m for m in open_by_kind.values() if m)
    buckets = []
    for i, members in enumerate(closed):
        # The span of member names tells a stall report which gradients are late.
        first, last = names[members[0]], names[members[-1]]
        span = first if len(members) == 1 else f"{first}..{last}"
        buckets.append(Bucket(i, f"DistributedOptimizer.bucket.{i}.{span}", members))
    return buckets
