"""Which front end carries Keras values: the one of Keras's backend.

Keras 3 tensors are torch tensors on the torch backend and JAX arrays on the
JAX backend, so gradients go through ``hvdlike.torch`` or ``hvdlike.jax``
without conversion (and, on JAX, from inside the jitted train step). Numpy
values (logs, variables read out for a broadcast) go through
``hvdlike.numpy``. Other backends are refused with a clear message.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Optional, Sequence

import numpy as np

from hvdlike.core.errors import UnsupportedOpError
from hvdlike.core.messages import ReduceOp
from hvdlike.core.process_sets import global_process_set
from hvdlike.frontend.caller import deprecated_average
from hvdlike.frontend.compression import Compressor, NoneCompressor  # noqa: F401 - re-exported
from hvdlike.frontend.objects import allgather_object
from hvdlike.frontend.submit import name_for

try:
    import keras
except ImportError as exc:  # most often: KERAS_BACKEND unset, so Keras wants tensorflow
    raise ImportError(
        f"hvdlike.keras needs Keras 3 on the torch or jax backend, and importing keras failed "
        f"({exc}); set KERAS_BACKEND=torch or KERAS_BACKEND=jax before keras is first imported "
        f"(Keras defaults to tensorflow)") from exc
if int(keras.__version__.split(".")[0]) < 3:
    raise ImportError(f"hvdlike.keras needs Keras 3, found keras {keras.__version__}")

FRONTEND = "hvdlike.keras"
SUPPORTED = ("torch", "jax")


def backend_name() -> str:
    return keras.backend.backend()


def frontend_for(value: Any = None):
    """The hvdlike module handling ``value`` (or the current backend's tensors)."""
    if isinstance(value, (np.ndarray, np.generic)):
        return importlib.import_module("hvdlike.numpy")
    name = backend_name()
    if name not in SUPPORTED:
        raise TypeError(f"{FRONTEND} supports the Keras backends {', '.join(SUPPORTED)}; this "
                        f"Keras runs on {name!r} (set KERAS_BACKEND=torch or KERAS_BACKEND=jax)")
    return importlib.import_module(f"hvdlike.{name}")


# -- compression ------------------------------------------------------------------------
# Compressor and NoneCompressor are the shared ones (hvdlike.frontend.compression).


class _CastCompressor(Compressor):
    """Send floating-point tensors in ``wire`` dtype and cast them back afterwards.

    Written with ``keras.ops`` so one class serves torch tensors, JAX arrays
    (traced ones too, inside the jitted step) and numpy values alike.
    """

    wire = "float16"

    @classmethod
    def compress(cls, tensor):
        if isinstance(tensor, (np.ndarray, np.generic)):
            dtype = np.asarray(tensor).dtype
            if np.issubdtype(dtype, np.floating) and dtype != np.dtype(cls.wire):
                return np.asarray(tensor).astype(cls.wire), dtype
            return tensor, None
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if "float" in dtype and dtype != cls.wire:
            return keras.ops.cast(tensor, cls.wire), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        if ctx is None:
            return tensor
        if isinstance(tensor, (np.ndarray, np.generic)):
            return np.asarray(tensor).astype(ctx)
        return keras.ops.cast(tensor, ctx)


class FP16Compressor(_CastCompressor):
    """Send floating-point tensors as float16, restore their dtype after."""

    wire = "float16"


class BF16Compressor(_CastCompressor):
    """Send floating-point tensors as bfloat16 (wider range than float16)."""

    wire = "bfloat16"


class Compression:
    """The built-in compressors, as Horovod names them (plus ``bf16``)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def check_compression(compression, what: str) -> None:
    if not (callable(getattr(compression, "compress", None))
            and callable(getattr(compression, "decompress", None))):
        raise TypeError(f"{FRONTEND}.{what}: compression must be a compressor with compress() "
                        f"and decompress() (e.g. hvd.Compression.fp16), got "
                        f"{type(compression).__name__}")


# -- argument handling ------------------------------------------------------------------


# Argument errors, renamed by prefixed(); errors of a running collective
# (MismatchError is a ValueError too) keep their message.
_ARGUMENT_ERRORS = (TypeError, ValueError, UnsupportedOpError)


@contextlib.contextmanager
def prefixed(what: str):
    """Name ``hvdlike.keras.<what>`` in plain TypeError/ValueError messages.

    The backend's front end reports what it refused under its own name; the
    caller used this one, so the message says both.
    """
    try:
        yield
    except (TypeError, ValueError) as exc:
        message = str(exc)
        if type(exc) not in _ARGUMENT_ERRORS or message.startswith(FRONTEND):
            raise
        if message.startswith(f"{what}:"):  # the core's own prefix: name the op once
            message = message[len(what) + 1:].lstrip()
        raise type(exc)(f"{FRONTEND}.{what}: {message}") from exc


def _tensor_compatible(value, what: str):
    """The value to hand to a front end, as Horovod's Keras API takes it.

    numpy arrays and scalars (``np.float64`` included: it subclasses
    ``float``, so it is checked first and keeps its dtype) and backend tensors
    pass through; a ``keras.Variable`` gives its value; Python numbers and
    (nested) lists become backend tensors. Anything else is refused here.
    """
    if isinstance(value, (np.ndarray, np.generic)):
        return value
    if isinstance(value, keras.Variable):
        return keras.ops.stop_gradient(value.value)
    if isinstance(value, (bool, int, float, list, tuple)):
        try:
            return keras.ops.convert_to_tensor(value)
        except Exception as exc:
            raise TypeError(f"{FRONTEND}.{what}: cannot convert {type(value).__name__} "
                            f"{value!r:.80} to a tensor: {exc}") from None
    if keras.ops.is_tensor(value):
        return value
    raise TypeError(f"{FRONTEND}.{what}: expected a {backend_name()} tensor, a numpy array, a "
                    f"keras.Variable or a Python number or list, got "
                    f"{type(value).__module__}.{type(value).__qualname__}")


def reduce_op(average, op, what: str):
    """Horovod's deprecated ``average`` flag or ``op`` (default Average); not both."""
    if average is not None:
        if op is not None:
            raise ValueError(f"{FRONTEND}.{what}: pass either op or the deprecated average, "
                             f"not both")
        deprecated_average(f"{FRONTEND}.{what}")
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    return ReduceOp.AVERAGE if op is None else op


# -- collectives ------------------------------------------------------------------------


def allreduce(value, name: Optional[str] = None, average=None, prescale_factor=1.0,
              postscale_factor=1.0, op=None, compression=Compression.none,
              process_set=global_process_set):
    """Reduce a backend tensor, numpy array, variable or Python number/list across ranks.

    ``average=True``/``False`` is Horovod's older spelling of ``op=Average`` /
    ``op=Sum``; with neither, the op is Average.
    """
    op = reduce_op(average, op, "allreduce")
    check_compression(compression, "allreduce")
    value = _tensor_compatible(value, "allreduce")
    compressed, ctx = compression.compress(value)
    with prefixed("allreduce"):
        out = frontend_for(compressed).allreduce(
            compressed, name=name, op=op, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor, process_set=process_set)
    return compression.decompress(out, ctx)


def grouped_allreduce(values: Sequence, name: Optional[str] = None, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set, compression=Compression.none) -> list:
    """Reduce a list of backend tensors as one fused unit (works inside the jitted step).

    Each value is taken as :func:`allreduce` takes it and comes back in the
    type it would alone. A list mixing numpy values with backend tensors (a
    Python number becomes a backend tensor) is reduced as two groups, the
    numpy values first, each by its own front end; every rank must then pass
    the same kinds in the same positions, as it must pass the same dtypes.
    """
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{FRONTEND}.grouped_allreduce expects a list of tensors, got "
                        f"{type(values).__name__}")
    check_compression(compression, "grouped_allreduce")
    pairs = [compression.compress(_tensor_compatible(v, "grouped_allreduce")) for v in values]
    op = ReduceOp.AVERAGE if op is None else op
    groups = _by_front_end([p[0] for p in pairs])
    out = [None] * len(pairs)
    for numpy_group, indices in groups:
        group_name = name
        if name and numpy_group and len(groups) > 1:
            group_name = f"{name}.numpy"  # the other group keeps the name itself
        front = frontend_for(pairs[indices[0]][0] if indices else None)
        with prefixed("grouped_allreduce"):
            reduced = front.grouped_allreduce([pairs[i][0] for i in indices], name=group_name,
                                              op=op, prescale_factor=prescale_factor,
                                              postscale_factor=postscale_factor,
                                              process_set=process_set)
        for i, value in zip(indices, reduced):
            out[i] = value
    return [compression.decompress(v, ctx) for v, (_, ctx) in zip(out, pairs)]


def _by_front_end(values) -> list:
    """``[(is_numpy, indices), ...]``: the positions each front end reduces, numpy first.

    One entry when every value goes to the same front end (an empty list
    goes to the backend's, which reports it as it reports any empty group).
    """
    numpy_ids = [i for i, v in enumerate(values) if isinstance(v, (np.ndarray, np.generic))]
    others = [i for i in range(len(values)) if i not in set(numpy_ids)]
    groups = [(True, numpy_ids)] if numpy_ids else []
    if others or not numpy_ids:
        groups.append((False, others))
    return groups


def allgather(value, name: Optional[str] = None, process_set=global_process_set):
    """Concatenate every rank's tensor along dimension 0."""
    value = _tensor_compatible(value, "allgather")
    with prefixed("allgather"):
        return frontend_for(value).allgather(value, name=name, process_set=process_set)


def broadcast(value, root_rank: int, name: Optional[str] = None,
              process_set=global_process_set):
    """Return ``root_rank``'s tensor on every rank."""
    value = _tensor_compatible(value, "broadcast")
    with prefixed("broadcast"):
        return frontend_for(value).broadcast(value, root_rank, name=name,
                                             process_set=process_set)


def reducescatter(value, name: Optional[str] = None, op=ReduceOp.AVERAGE,
                  process_set=global_process_set):
    """Reduce across ranks and keep this rank's share of dimension 0 (default Average)."""
    value = _tensor_compatible(value, "reducescatter")
    with prefixed("reducescatter"):
        return frontend_for(value).reducescatter(value, name=name, op=op,
                                                 process_set=process_set)


def _describe(variables) -> list:
    return [f"{tuple(v.shape)}:{keras.backend.standardize_dtype(v.dtype)}" for v in variables]


def _check_same_variables(variables, name: str, process_set) -> None:
    """Raise the same ValueError on every rank unless all ranks pass alike variables.

    A rank with fewer variables would return while the others wait for
    broadcasts it never joins; one with other shapes would fail halfway.
    Comparing one small description first turns both into an error on
    every rank before any value travels.
    """
    everyone = allgather_object(_describe(variables), name=name, process_set=process_set)
    if all(d == everyone[0] for d in everyone):
        return
    members = (list(range(len(everyone))) if process_set is None
               or process_set is global_process_set else list(process_set.ranks))
    lines = "; ".join(f"rank {r}: {len(d)} variables [{', '.join(d[:6])}"
                      f"{', ...' if len(d) > 6 else ''}]" for r, d in zip(members, everyone))
    raise ValueError(f"{FRONTEND}.broadcast_variables: the ranks pass different variables "
                     f"(count, shape or dtype), so nothing was broadcast: {lines}")


def broadcast_variables(variables: Sequence, root_rank: int = 0, name: Optional[str] = None,
                        process_set=global_process_set) -> None:
    """Overwrite each Keras variable with ``root_rank``'s value, on every rank.

    The ranks first compare their variables' count, shapes and dtypes (one
    small allgather) and all raise ``ValueError`` if they differ. Then all
    variables travel in one negotiation, as numpy arrays, so this works the
    same on every backend.

    Example:
        >>> hvd.broadcast_variables(model.variables + optimizer.variables, root_rank=0)
    """
    import hvdlike.numpy as hnp

    variables = list(variables)
    for v in variables:
        if not isinstance(v, keras.Variable):
            raise TypeError(f"{FRONTEND}.broadcast_variables expects keras.Variable objects, "
                            f"got {type(v).__module__}.{type(v).__qualname__}")
    base = name_for(name, "keras_broadcast", process_set, kind=False)
    _check_same_variables(variables, f"{base}.structure", process_set)
    with prefixed("broadcast_variables"):
        handles = [hnp.broadcast_async(np.asarray(keras.ops.convert_to_numpy(v.value)),
                                       root_rank, name=f"{base}.{i}", process_set=process_set)
                   for i, v in enumerate(variables)]
    for variable, handle in zip(variables, handles):
        variable.assign(hnp.synchronize(handle))
