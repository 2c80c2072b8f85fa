"""Which front end carries Keras values: the one of Keras's backend.

Keras 3 tensors are torch tensors on the torch backend and JAX arrays on the
JAX backend, so gradients go through ``hvdlike.torch`` or ``hvdlike.jax``
without conversion (and, on JAX, from inside the jitted train step). Numpy
values (logs, variables read out for a broadcast) go through
``hvdlike.numpy``. Other backends are refused with a clear message.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional, Sequence

import numpy as np

from hvdlike.core.process_sets import global_process_set
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


def _tensor_compatible(value, what: str):
    """Python numbers and (nested) lists of them as backend tensors, as Horovod's Keras API takes.

    Backend tensors and numpy values pass through unchanged; anything else is
    left for the backend's front end to refuse, naming its type.
    """
    if isinstance(value, (bool, int, float, list, tuple)):
        try:
            return keras.ops.convert_to_tensor(value)
        except Exception as exc:
            raise TypeError(f"{FRONTEND}.{what}: cannot convert {type(value).__name__} "
                            f"{value!r:.80} to a tensor: {exc}") from None
    return value


def allreduce(value, name: Optional[str] = None, op=None, process_set=global_process_set):
    """Reduce a backend tensor, numpy array or Python number/list across ranks (default Average)."""
    value = _tensor_compatible(value, "allreduce")
    front = frontend_for(value)
    return front.allreduce(value, name=name, op=front.Average if op is None else op,
                           process_set=process_set)


def grouped_allreduce(values: Sequence, name: Optional[str] = None, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set) -> list:
    """Reduce a list of backend tensors as one fused unit (works inside the jitted step)."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{FRONTEND}.grouped_allreduce expects a list of tensors, got "
                        f"{type(values).__name__}")
    values = [_tensor_compatible(v, "grouped_allreduce") for v in values]
    front = frontend_for(values[0] if values else None)
    return list(front.grouped_allreduce(list(values), name=name,
                                        op=front.Average if op is None else op,
                                        prescale_factor=prescale_factor,
                                        postscale_factor=postscale_factor,
                                        process_set=process_set))


def allgather(value, name: Optional[str] = None, process_set=global_process_set):
    """Concatenate every rank's tensor along dimension 0."""
    value = _tensor_compatible(value, "allgather")
    return frontend_for(value).allgather(value, name=name, process_set=process_set)


def broadcast(value, root_rank: int, name: Optional[str] = None,
              process_set=global_process_set):
    """Return ``root_rank``'s tensor on every rank."""
    value = _tensor_compatible(value, "broadcast")
    return frontend_for(value).broadcast(value, root_rank, name=name, process_set=process_set)


def broadcast_variables(variables: Sequence, root_rank: int = 0, name: Optional[str] = None,
                        process_set=global_process_set) -> None:
    """Overwrite each Keras variable with ``root_rank``'s value, on every rank.

    All variables travel in one negotiation; values cross as numpy arrays, so
    this works the same on every backend.

    Example:
        >>> hvd.broadcast_variables(model.variables + optimizer.variables, root_rank=0)
    """
    import hvdlike.numpy as hnp

    variables = list(variables)
    base = name_for(name, "keras_broadcast", process_set, kind=False)
    handles = [hnp.broadcast_async(np.asarray(keras.ops.convert_to_numpy(v.value)), root_rank,
                                   name=f"{base}.{i}", process_set=process_set)
               for i, v in enumerate(variables)]
    for variable, handle in zip(variables, handles):
        variable.assign(hnp.synchronize(handle))
