"""numpy arrays to torch tensors and back, sharing memory where the layout allows.

``torch.from_numpy`` wraps any native-endian array whose strides are
non-negative multiples of its item size, so most arrays -- including
non-contiguous slices -- cross without a copy. bfloat16 arrays (the
``ml_dtypes`` type JAX uses) cross as their 16-bit pattern. Everything else
that numpy can hold but torch cannot (object, string, datetime, ...) is
refused with a message naming the dtype.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from hvdlike.frontend.arrays import Adapter

FRONTEND = "hvdlike.numpy"
_KINDS = "biufc"  # bool, signed, unsigned, float, complex


def _hint(value) -> str:
    module = type(value).__module__.split(".")[0]
    if module == "torch":
        return " (use hvdlike.torch for torch tensors)"
    if module in ("jax", "jaxlib"):
        return " (use hvdlike.jax for JAX arrays)"
    return ""


def _is_bfloat16(dtype: np.dtype) -> bool:
    return dtype.name == "bfloat16"


def _wrap(array: np.ndarray) -> torch.Tensor:
    if _is_bfloat16(array.dtype):
        return _wrap(array.view(np.int16)).view(torch.bfloat16)
    if array.dtype.byteorder == ">" or any(s < 0 or s % array.itemsize for s in array.strides):
        array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("="))
    with warnings.catch_warnings():
        # Read-only arrays are only ever read by non-in-place collectives.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A torch result as a numpy array sharing its memory."""
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


class NumpyAdapter(Adapter):
    """numpy arrays (and numpy scalars) in, numpy arrays of the input dtype out."""

    frontend = FRONTEND
    inplace = True

    def to_torch(self, value, what: str, writable: bool = False) -> torch.Tensor:
        if isinstance(value, np.generic) and not writable:
            value = np.asarray(value)
        if not isinstance(value, np.ndarray):
            kind = "a writable numpy.ndarray" if writable else "a numpy.ndarray"
            raise TypeError(f"{FRONTEND}.{what} expects {kind}, got "
                            f"{type(value).__module__}.{type(value).__qualname__}{_hint(value)}")
        if isinstance(value, np.ma.MaskedArray):
            raise TypeError(f"{FRONTEND}.{what}: got a numpy masked array; collectives would "
                            f"ignore its mask and communicate the masked-out values too (pass "
                            f"value.filled(fill) or value.data to choose what travels)")
        if value.dtype.kind not in _KINDS and not _is_bfloat16(value.dtype):
            raise TypeError(f"{FRONTEND}.{what}: numpy arrays of dtype {value.dtype} cannot be "
                            f"communicated; use a numeric or bool dtype (for Python objects "
                            f"use broadcast_object / allgather_object)")
        if writable and not value.flags.writeable:
            raise ValueError(f"{FRONTEND}.{what}: the array is read-only; in-place collectives "
                             f"need a writable array (use the variant without '_')")
        try:
            return _wrap(value)
        except TypeError as exc:  # a dtype torch has no counterpart for
            raise TypeError(f"{FRONTEND}.{what}: numpy dtype {value.dtype} is not supported: "
                            f"{exc}") from None

    def from_torch(self, tensor: torch.Tensor, like) -> np.ndarray:
        return to_numpy(tensor)

    def write_back(self, like: np.ndarray, result: torch.Tensor) -> np.ndarray:
        out = to_numpy(result)
        if not np.shares_memory(like, out):
            np.copyto(like, out.reshape(like.shape))
        return like
