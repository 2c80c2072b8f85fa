"""Tensor fusion: pack many small allreduces into few large ones.

:func:`plan` is pure and deterministic: given the ordered responses of a
cycle, it returns batches -- lists of response indices -- that every rank
computes identically. :class:`BufferPool` recycles the flat buffers fused
batches are staged in, so steady state allocates nothing.
"""

from __future__ import annotations

import functools
import threading
from typing import Dict, List, Mapping, Optional, Sequence

import torch

from .messages import Response


@functools.lru_cache(maxsize=None)
def element_size(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def plan(responses: Sequence[Response], threshold_bytes: int,
         separate_groups: bool = False,
         alone: Optional[Mapping[str, int]] = None) -> List[List[int]]:
    """Group fusable responses into batches of at most ``threshold_bytes``.

    Responses fuse when their :meth:`Response.fusion_key` is equal (same op,
    dtype, device, reduction and scaling). With ``separate_groups`` (the
    ``disable_group_fusion`` knob) the members of a grouped collective fuse
    only with each other, never with ungrouped tensors or another group. A batch is closed when the next
    member would overflow it; a tensor larger than the threshold, or any
    response when the threshold is 0, is a batch of its own. Batches are
    ordered by their first member, so the order of execution follows the
    order of negotiation.

    ``alone`` maps a device (``Response.device``) to a size from which its
    tensors are batches of their own: on a data plane where such a tensor
    costs little more alone than fused (shared memory, MPI), a fusion buffer
    would only add two copies of it.
    """
    if threshold_bytes <= 0:
        return [[i] for i in range(len(responses))]
    batches: List[List[int]] = []
    open_batch: Dict[object, list] = {}  # class -> [batch, bytes so far]
    for i, response in enumerate(responses):
        key, nbytes = response.fusion_terms
        if key is None or nbytes >= threshold_bytes or (
                alone and nbytes >= alone.get(response.device, threshold_bytes)):
            # Alone; a large tensor leaves the open batch of its class open.
            batches.append([i])
            continue
        if separate_groups:
            key = (key, response.group)
        current = open_batch.get(key)
        if current is not None and current[1] + nbytes <= threshold_bytes:
            current[0].append(i)
            current[1] += nbytes
        else:
            batch = [i]
            batches.append(batch)
            open_batch[key] = [batch, nbytes]
    return batches


class BufferPool:
    """Flat staging buffers, reused by (device, dtype); grows to the largest request."""

    def __init__(self):
        self._lock = threading.Lock()
        self._free: Dict[tuple, List[torch.Tensor]] = {}
        # Bumped whenever the pool makes or lets go of a buffer: what others keep
        # about its buffers (Executor._split_views) is current while it is unchanged.
        self.generation = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of at least ``numel`` elements; slice it, give it back whole."""
        key = (str(device), dtype)
        with self._lock:
            free = self._free.get(key, [])
            for i, buf in enumerate(free):
                if buf.numel() >= numel:
                    return free.pop(i)
            if free:
                free.pop(0)  # too small: drop it, a larger one replaces it
            self.generation += 1
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer obtained from :meth:`take` (the whole buffer, not a view)."""
        with self._lock:
            free = self._free.setdefault((str(buffer.device), buffer.dtype), [])
            if len(free) < 4:
                free.append(buffer)
            else:
                self.generation += 1

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.generation += 1
