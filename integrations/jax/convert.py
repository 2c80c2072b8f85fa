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


def is_float0(dtype) -> bool:
    """The dtype of gradients w.r.t. integer inputs (``jax.grad(..., allow_int=True)``)."""
    return dtype == jax.dtypes.float0


def _is_key(dtype) -> bool:
    try:
        return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    except TypeError:
        return False


def check_dtype(dtype, what: str) -> None:
    """Refuse the JAX dtypes that hold no plain numbers, saying what to do instead.

    Typed PRNG keys and float0 would otherwise fail deep inside DLPack or the
    numpy adapter, with a message about capsules or numpy dtypes.
    """
    if _is_key(dtype):
        raise TypeError(f"{FRONTEND}.{what}: typed PRNG key arrays ({dtype}, from "
                        f"jax.random.key) cannot be communicated; convert them with "
                        f"jax.random.key_data(keys) and back with "
                        f"jax.random.wrap_key_data(data)")
    if is_float0(dtype):
        raise TypeError(f"{FRONTEND}.{what}: float0 arrays (gradients w.r.t. integer inputs, "
                        f"from jax.grad(..., allow_int=True)) carry no values, so there is "
                        f"nothing to communicate; allreduce_pytree and allreduce_gradients "
                        f"pass float0 leaves through unchanged")


def _renamed(exc: Exception) -> Exception:
    """``exc`` from the numpy adapter, naming this front end's function instead."""
    message = str(exc)
    prefix = NumpyAdapter.frontend + "."
    if not message.startswith(prefix):
        return exc
    try:
        return type(exc)(FRONTEND + "." + message[len(prefix):])
    except Exception:  # noqa: BLE001 - an exception type with another signature
        return exc


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
        dtype = getattr(value, "dtype", None)
        if dtype is not None:
            check_dtype(dtype, what)
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
            try:
                return self._numpy.to_torch(value, what)
            except (TypeError, ValueError) as exc:
                raise _renamed(exc) from None
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
