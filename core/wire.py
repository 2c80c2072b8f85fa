"""How tensors look on the wire: dtypes Gloo lacks, in-place scaling.

Shared by the executor and Adasum; depends on torch only.
"""

from __future__ import annotations

import torch

# Same-width stand-ins for moving bytes of dtypes Gloo does not handle.
_MOVE_AS = {torch.bool: torch.uint8, torch.int16: torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reduction of ``dtype`` runs in on Gloo."""
    if dtype == torch.int16:
        return torch.int32
    if dtype == torch.bool:
        return torch.uint8
    return dtype


def movable(tensor: torch.Tensor) -> torch.Tensor:
    stand_in = _MOVE_AS.get(tensor.dtype)
    return tensor if stand_in is None else tensor.view(stand_in)


def scale(tensor: torch.Tensor, factor: float) -> None:
    """Multiply in place; integers truncate toward zero like Horovod's scaling."""
    if factor == 1.0:
        return
    if tensor.is_floating_point():
        tensor.mul_(factor)
    else:
        tensor.copy_(torch.trunc(tensor.to(torch.float64) * factor))
