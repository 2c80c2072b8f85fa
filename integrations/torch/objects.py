"""Broadcast and gather arbitrary picklable Python objects (via cloudpickle).

Names are derived from the call sequence only -- never from the object's value
or type -- so every rank waits on the same names whatever it passes in.
"""

from __future__ import annotations

import cloudpickle
import torch

from hvdlike.core import api
from hvdlike.core.process_sets import global_process_set, resolve

from . import ops


def _to_tensor(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Return ``root_rank``'s ``obj`` on every rank (others may pass None).

    Example:
        >>> epoch = hvd.broadcast_object(epoch if hvd.rank() == 0 else None, root_rank=0)
    """
    name = name or api.runtime().auto_name("broadcast_object", resolve(process_set))
    me = api.rank()  # root_rank is a global rank, as in Horovod
    payload = _to_tensor(obj) if me == root_rank else None
    length = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
    length = ops.broadcast(length, root_rank, name=f"{name}.size", process_set=process_set)
    data = payload if payload is not None else torch.empty(int(length.item()), dtype=torch.uint8)
    data = ops.broadcast(data, root_rank, name=f"{name}.data", process_set=process_set)
    return cloudpickle.loads(data.numpy().tobytes())


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Return the list of every rank's ``obj``, in rank order."""
    name = name or api.runtime().auto_name("allgather_object", resolve(process_set))
    payload = _to_tensor(obj)
    sizes = ops.allgather(torch.tensor([payload.numel()], dtype=torch.int64),
                          name=f"{name}.size", process_set=process_set)
    data = ops.allgather(payload, name=f"{name}.data", process_set=process_set)
    out, start = [], 0
    for n in sizes.tolist():
        out.append(cloudpickle.loads(data[start:start + n].numpy().tobytes()))
        start += n
    return out
