"""Gradient buckets of ``DistributedOptimizer``: many small gradients, one allreduce.

A bucket is a flat buffer with one view per member parameter. Members are
assigned at construction from the parameter list alone (so identically on
every rank), in reverse registration order -- the order backward produces
gradients -- so the first buckets leave while backward still runs.

Per gradient, the hook only counts (the optimizer marks the member's slot);
once every member is ready the bucket copies the gradients that are not yet
in it with one batched call (:meth:`Bucket.pack`) and leaves as one
allreduce. After the reduction each trainable member's ``.grad`` *is* its
view into the buffer (:meth:`Bucket.unpack`), as with DDP's
``gradient_as_bucket_view``: no copy back, and a gradient zeroed in place
(``zero_grad(set_to_none=False)``) stays the view, so the next backward
accumulates straight into the buffer and the pack copies nothing.

A member whose gradient is something else when the bucket leaves (a fresh
tensor after ``zero_grad(set_to_none=True)``, one the user assigned) is
copied in; a sparse gradient travels on its own (its slot carries zeros)
unless reduced as dense; a member frozen since construction carries zeros
and keeps its ``.grad`` untouched. So a change of the graph between steps
costs a copy, never a wrong sum.

The gradients a view replaces are not dropped at once: the bucket keeps
them until the next ``zero_grad()`` (or its next pack), when a plain
training loop would have dropped them. Freed right after the reduction,
hundreds of them at once, they let glibc's allocator hand the top of its heap
back to the system, and the next backward pass pays to map it again: 2-3 ms
per step of a 400-tensor model on the test machine. Held, they cost no
memory a plain loop does not hold (its gradients live until ``zero_grad()``).
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
    """A flat buffer holding several parameters' gradients, reduced as one tensor.

    Attributes:
        marked: per member, whether its gradient is final this round.
        pending: members not marked yet; the bucket leaves when it reaches 0.
        as_views: after a reduction, members' gradients become views of
            ``flat`` (else the reduced values are copied into their own tensors).
    """

    def __init__(self, index: int, name: str, members: List[torch.Tensor],
                 as_views: bool = True) -> None:
        self.index = index
        self.name = name
        self.members = members
        # The members' shapes, negotiated with the bucket: ranks whose models differ
        # in shape but not in a bucket's total size are told apart (see Request.layout).
        self.layout = ",".join("x".join(map(str, p.shape)) or "scalar" for p in members)
        total = sum(p.numel() for p in members)
        self.flat = torch.zeros(total, dtype=members[0].dtype, device=members[0].device)
        self.views = []
        offset = 0
        for p in members:
            self.views.append(self.flat[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        # Where each view's data starts: a view handed out as ``.grad`` can be
        # re-pointed elsewhere (``module.double()`` or ``.to(memory_format=...)``
        # assigns ``param.grad.data``), keeping its identity but leaving the bucket.
        self._starts = [view.data_ptr() for view in self.views]
        # Set when a member's gradient no longer fits the bucket (left its view,
        # or has another dtype or device): the optimizer plans the buckets again.
        self.stale = False
        self.size = len(members)
        self.as_views = as_views
        # Set by the optimizer: True while one backward pass makes a step, so
        # a member's hook may count it in without the per-pass bookkeeping.
        self.direct = True
        # A view has a contiguous layout; a parameter with other strides (channels
        # last) keeps a gradient of its own layout, filled by a copy.
        self._viewable = [as_views and p.is_contiguous() for p in members]
        # Gradients replaced by views at the last unpack, dropped by release().
        self.retired: List[torch.Tensor] = []
        # (slot, gradient, its version) of every gradient the last pack copied in.
        self._copied: List[tuple] = []
        self.member_names: List[str] = []  # set by plan(): for error messages
        self.early = False  # packed during backward (set by the optimizer)
        self.reset()

    def reset(self) -> None:
        self.marked = [False] * self.size
        self.pending = self.size

    def mark(self, slot: int) -> bool:
        """Member ``slot``'s gradient is final for this round; True once all are."""
        if not self.marked[slot]:
            self.marked[slot] = True
            self.pending -= 1
        return self.pending == 0

    def pack(self, sparse: Callable[[torch.Tensor], Optional[torch.Tensor]]) -> None:
        """Bring every member's gradient into the flat buffer (zeros where there is none).

        A gradient that already is the member's view is in place. ``sparse(p)``
        is called for a member holding a sparse gradient and returns the dense
        gradient to pack, or None when the gradient travels on its own (its
        slot then carries zeros).
        """
        self.release()
        destinations, sources = [], []
        copied = self._copied = []
        flat = self.flat
        # Looked up once: per member, a dtype is compared by identity and a CPU
        # bucket's device by ``is_cpu`` (``.device`` makes a new object per call).
        dtype, device, on_cpu = flat.dtype, flat.device, flat.is_cpu
        starts = self._starts
        for i, (p, view) in enumerate(zip(self.members, self.views)):
            grad = p.grad
            if view.data_ptr() != starts[i]:
                view = self._leave(i)  # re-pointed: its values, if any, are in ``grad``
            elif grad is view:
                if p.requires_grad:
                    continue  # accumulated straight into the bucket
                # Frozen since: it contributes zeros and keeps its own gradient.
                p.grad = view.clone()
                grad = None
            if grad is not None and (grad.is_sparse or not p.requires_grad):
                grad = sparse(p) if p.requires_grad else None
            if grad is None:
                view.zero_()
            else:
                if grad.dtype is not dtype or not (grad.is_cpu if on_cpu
                                                   else grad.device == device):
                    self.stale = True  # carried converted this once; re-planned after
                destinations.append(view)
                sources.append(grad)
                copied.append((i, grad, grad._version))
        _copy_all(destinations, sources)

    def changed_since_pack(self) -> Optional[str]:
        """The name of a member whose gradient changed after the pack copied it, else None.

        A reduction that starts during backward packs the gradients then; an
        in-place change made before ``step()`` (``GradScaler.unscale_``,
        clipping) would be overwritten by the reduced values without a word.
        """
        for slot, grad, version in self._copied:
            p = self.members[slot]
            if p.grad is not grad or grad._version != version:
                return self.member_names[slot] if self.member_names else f"member {slot}"
        return None

    def _leave(self, slot: int) -> torch.Tensor:
        """Member ``slot``'s handed-out view was re-pointed: a fresh one, returned."""
        start = (self._starts[slot] - self._starts[0]) // self.flat.element_size()
        numel = self.members[slot].numel()
        view = self.views[slot] = self.flat[start:start + numel].view(self.members[slot].shape)
        self.stale = True
        return view

    def release(self) -> None:
        """Drop the gradients the last :meth:`unpack` replaced (see the module doc)."""
        self.retired = []

    def unpack(self) -> None:
        """Hand the reduced values to each trainable member's ``.grad``."""
        retired = self.retired = []
        destinations, sources = [], []
        flat = self.flat
        dtype, device, on_cpu = flat.dtype, flat.device, flat.is_cpu  # see pack()
        for p, view, viewable in zip(self.members, self.views, self._viewable):
            if not p.requires_grad:
                continue  # frozen since construction: its gradient is left alone
            grad = p.grad
            if grad is view:
                continue
            if grad is not None and grad.is_sparse:
                continue  # reduced by its own sparse handle
            if viewable and p.dtype is dtype and (p.is_cpu if on_cpu else p.device == device):
                if grad is not None:
                    retired.append(grad)
                p.grad = view
                continue
            if grad is None:
                grad = p.grad = torch.empty_like(p, memory_format=torch.preserve_format)
            destinations.append(grad)
            sources.append(view)
        _copy_all(destinations, sources)


def plan(params: Iterable[torch.Tensor], names: Dict[torch.Tensor, str], threshold: int,
         as_views: bool = True) -> List[Bucket]:
    """Buckets for the dense trainable ``params`` (in registration order).

    Gradients of ``min(threshold, BUCKET_CAP_BYTES, LARGE_GRADIENT_BYTES)``
    bytes or more, and sparse parameters, stay out. Buckets hold one dtype
    and device each, up to ``min(threshold, BUCKET_CAP_BYTES)`` bytes; a
    threshold of 0 (fusion disabled) gives no buckets. ``as_views``: see
    :class:`Bucket`.
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
        bucket = Bucket(i, f"DistributedOptimizer.bucket.{i}.{span}", members, as_views)
        bucket.member_names = [names[m] for m in members]
        buckets.append(bucket)
    return buckets
