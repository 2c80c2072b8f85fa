"""How tensors look on the wire: dtypes Gloo lacks, in-place scaling.

Shared by the executor and Adasum; depends on torch only.
"""

from __future__ import annotations

import torch

# Same-width stand-ins for moving bytes of dtypes Gloo does not handle.
_MOVE_AS = {torch.bool: torch.uint8, torch.int16: torch.float16}
for _bits, _stand_in in ((16, torch.float16), (32, torch.int32), (64, torch.int64)):
    if hasattr(torch, f"uint{_bits}"):  # torch 2.3 and up
        _MOVE_AS[getattr(torch, f"uint{_bits}")] = _stand_in


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
    """``tensor`` as Gloo can move it: a view (written through) in a same-width
    stand-in dtype, complex as pairs of reals in a trailing dimension (Gloo's
    allgather and alltoall refuse complex; dimension 0, which they split,
    stays as it is)."""
    if tensor.is_complex():
        return torch.view_as_real(tensor.resolve_conj() if tensor.is_conj() else tensor)
    stand_in = _MOVE_AS.get(tensor.dtype)
    return tensor if stand_in is None else tensor.view(stand_in)


# Largest power-of-two divisor whose reciprocal every floating dtype holds as
# a normal number (float16 down to 2**-14), so the product is exact scaling.
_EXACT_RECIPROCAL_MAX = 1 << 14


def scale(tensor: torch.Tensor, factor: float, divisor: int = 1) -> None:
    """Multiply by ``factor / divisor`` in place; integers truncate toward zero.

    An average (``divisor`` > 1, ``factor`` 1) of floating-point values is a true
    division, correctly rounded: ``(k * t) / size`` exactly as the user computes
    it, where multiplying by a rounded ``1 / size`` can be one unit in the last
    place off (with 3 ranks, say). A power-of-two ``divisor`` has an exact
    reciprocal, so multiplying by it rounds the same real number the division
    does: the same bits, at about half the cost of a division pass.
    Integers scale in float64 and truncate.
    """
    if tensor.is_floating_point() and divisor > 1 and factor == 1.0:
        if divisor & (divisor - 1) or divisor > _EXACT_RECIPROCAL_MAX:
            tensor.div_(divisor)
        else:
            tensor.mul_(1.0 / divisor)
        return
    factor = factor / divisor
    if factor == 1.0:
        return
    if tensor.is_floating_point():
        tensor.mul_(factor)
    else:
        tensor.copy_(torch.trunc(tensor.to(torch.float64) * factor))
