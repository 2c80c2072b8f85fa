"""JAX arrays to torch tensors and back, through DLPack (no copy on CPU).

The core runs on torch tensors; a CPU ``jax.Array`` is viewed as one through
DLPack and results come back the same way. Collectives never write into
their inputs unless asked to in place, which JAX (immutable arrays) never
asks, so sharing the input buffer is safe. Only CPU arrays on a single device
are accepted: the data plane for JAX is Gloo.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from hvdlike.frontend.arrays import Adapter
from hvdlike.numpy.convert import NumpyAdapter, to_numpy

FRONTEND = "hvdlike.jax"


def is_traced(value) -> bool:
    """True for abstract values seen while JAX traces (jit, grad, vmap...)."""
    return isinstance(value, jax.core.Tracer)


def check_array(value, what: str) -> None:
    """Refuse JAX arrays this front end cannot communicate, naming why."""
    if value.is_deleted():
        raise ValueError(f"{FRONTEND}.{what}: the jax.Array has been deleted (donated?)")
    devices = value.devices()
    if len(devices) != 1:
        raise TypeError(f"{FRONTEND}.{what}: the jax.Array is sharded over {len(devices)} "
                        f"devices; hvdlike.jax communicates single-device CPU arrays")
    device = next(iter(devices))
    if device.platform != "cpu":
        raise TypeError(
            f"{FRONTEND}.{what}: got a jax.Array on {device.platform} device {device}; "
            f"hvdlike.jax supports CPU arrays only (move it with "
            f"jax.device_put(x, jax.devices('cpu')[0]))")


class JaxAdapter(Adapter):
    """JAX arrays (or numpy arrays and scalars) in, JAX arrays out."""

    frontend = FRONTEND
    inplace = False

    def __init__(self):
        self._numpy = NumpyAdapter()

    def to_torch(self, value, what: str, writable: bool = False) -> torch.Tensor:
        if is_traced(value):
            raise TypeError(f"{FRONTEND}.{what}: got a traced value; inside jax.jit only "
                            f"allreduce, grouped_allreduce, broadcast, allgather, alltoall and "
                            f"reducescatter are available (call this one outside the traced "
                            f"function)")
        if isinstance(value, jax.Array):
            check_array(value, what)
            try:
                return torch.from_dlpack(value)
            except (TypeError, RuntimeError, BufferError) as exc:
                raise TypeError(f"{FRONTEND}.{what}: JAX dtype {value.dtype} cannot be "
                                f"communicated: {exc}") from None
        if isinstance(value, (bool, int, float)):
            value = np.asarray(jnp.asarray(value))  # JAX's default dtype for Python scalars
        if isinstance(value, (np.ndarray, np.generic)):
            return self._numpy.to_torch(value, what)
        raise TypeError(f"{FRONTEND}.{what} expects a jax.Array, got "
                        f"{type(value).__module__}.{type(value).__qualname__}")

    def from_torch(self, tensor: torch.Tensor, like) -> jax.Array:
        if tensor.numel() and tensor.is_contiguous():
            try:
                return jnp.from_dlpack(tensor)
            except Exception:  # alignment or dtype JAX will not alias: copy instead
                pass
        return jnp.asarray(to_numpy(tensor.contiguous()))

    def write_back(self, like, result):  # pragma: no cover - inplace is False
        raise TypeError(f"{FRONTEND}: JAX arrays are immutable")
