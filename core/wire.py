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


def scale(tensor: torch.Tensor, factor: float, divisor: int = 1) -> None:
    """Multiply by ``factor / divisor`` in place; integers truncate toward zero.

    An average (``divisor`` > 1, ``factor`` 1) of floating-point values is a true
    division, correctly rounded: ``(k * t) / size`` exactly as the user computes
    it, where multiplying by a rounded ``1 / size`` can be one unit in the last
    place off (with 3 ranks, say). Integers scale in float64 and truncate.
    """
    if tensor.is_floating_point() and divisor > 1 and factor == 1.0:
        tensor.div_(divisor)
        return
    factor = factor / divisor
    if factor == 1.0:
        return
    if tensor.is_floating_point():
        tensor.mul_(factor)
    else:
        tensor.copy_(torch.trunc(tensor.to(torch.float64) * factor))
