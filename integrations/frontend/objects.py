"""Broadcast and gather arbitrary picklable Python objects (via cloudpickle).

Framework-neutral: every front end (torch, numpy, jax, keras) exports these
two functions, and none of them needs another front end to do so; a front end
may export a ``broadcast_object`` made by :func:`broadcast_object_for`, whose
argument errors name it.
Names are derived from the call sequence only -- never from the object's value
or type -- so every rank waits on the same names whatever it passes in.
"""

from __future__ import annotations

import cloudpickle
import torch

from hvdlike.core import api, collectives as core
from hvdlike.core.process_sets import global_process_set, resolve

from .compile_guard import eager
from .submit import submit, synchronize

_FRONTEND = "hvdlike"


class _Unpicklable:
    """Sent in place of an object its rank could not pickle.

    The call then fails on every rank -- the others with a ``RuntimeError``
    naming that rank and the cause -- rather than leaving them waiting for
    data that will never come.
    """

    def __init__(self, rank: int, error: BaseException):
        self.rank = rank
        self.why = f"{type(error).__name__}: {error}"

    def raise_here(self, what: str):
        raise RuntimeError(f"{what}: rank {self.rank} could not pickle its object ({self.why})")


def _pickled(obj):
    """(bytes to send, the pickling error or None)."""
    try:
        return cloudpickle.dumps(obj), None
    except Exception as exc:  # anything pickling raises (TypeError, PicklingError, ...)
        return cloudpickle.dumps(_Unpicklable(api.rank(), exc)), exc


def _to_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _broadcast(tensor: torch.Tensor, root_rank: int, name: str, process_set,
               once: bool) -> torch.Tensor:
    # root_rank is a global rank, as in Horovod; the runtime maps it into the set.
    entry = core.broadcast_entry(tensor, root_rank, api.size(), f"broadcast.{name}", once=once)
    return synchronize(submit([entry], process_set, _FRONTEND)[0])


def _allgather(tensor: torch.Tensor, name: str, process_set, once: bool) -> torch.Tensor:
    entry = core.allgather_entry(tensor, f"allgather.{name}", once=once)
    return synchronize(submit([entry], process_set, _FRONTEND)[0])


def broadcast_object_for(frontend: str):
    """:func:`broadcast_object` as ``frontend`` exports it: its argument errors name
    ``<frontend>.broadcast_object``, the function the caller used."""
    what = f"{frontend}.broadcast_object"

    def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
        """Return ``root_rank``'s ``obj`` on every rank (others may pass None).

        Example:
            >>> epoch = hvd.broadcast_object(epoch if hvd.rank() == 0 else None, root_rank=0)
        """
        root_rank = core.check_root(root_rank, api.size(), what)
        return _broadcast_object(obj, root_rank, name, process_set)

    broadcast_object.__qualname__ = "broadcast_object"
    return eager(broadcast_object)


def _broadcast_object(obj, root_rank, name, process_set):
    # An automatic name is this call's alone: its two broadcasts stay out of the
    # response cache (Request.once). A name the caller gives is cached, as any is.
    once = not name
    name = name or api.runtime().auto_name("broadcast_object", resolve(process_set))
    me = api.rank()  # root_rank is a global rank, as in Horovod
    payload, failure = None, None
    if me == root_rank:
        data, failure = _pickled(obj)
        payload = _to_tensor(data)
    length = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
    length = _broadcast(length, root_rank, f"{name}.size", process_set, once)
    data = payload if payload is not None else torch.empty(int(length.item()), dtype=torch.uint8)
    data = _broadcast(data, root_rank, f"{name}.data", process_set, once)
    if failure is not None:
        raise failure
    # The root rebuilds it too: an object that pickles but cannot be rebuilt then
    # fails on every rank alike, not on all but the root.
    value = _unpickled(data.numpy().tobytes(), "broadcast_object", f"rank {root_rank}'s")
    if isinstance(value, _Unpicklable):
        value.raise_here("broadcast_object")
    return obj if me == root_rank else value  # the root's own object, as in Horovod


def _unpickled(data: bytes, what: str, whose: str):
    """The object in ``data``; an error saying whose object could not be rebuilt here
    (a class this process cannot import, a ``__setstate__`` that raises) otherwise."""
    try:
        return cloudpickle.loads(data)
    except Exception as exc:
        raise RuntimeError(f"{what}: {whose} object could not be unpickled on this rank: "
                           f"{type(exc).__name__}: {exc}") from exc


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Return the list of every rank's ``obj``, in rank order."""
    once = not name  # an automatic name is this call's alone (see _broadcast_object)
    name = name or api.runtime().auto_name("allgather_object", resolve(process_set))
    pickled, failure = _pickled(obj)
    payload = _to_tensor(pickled)
    sizes = _allgather(torch.tensor([payload.numel()], dtype=torch.int64), f"{name}.size",
                       process_set, once)
    data = _allgather(payload, f"{name}.data", process_set, once)
    if failure is not None:
        raise failure
    out, start = [], 0
    members = getattr(process_set, "ranks", None)
    for i, n in enumerate(sizes.tolist()):
        rank = members[i] if members else i
        out.append(_unpickled(data[start:start + n].numpy().tobytes(), "allgather_object",
                              f"rank {rank}'s"))
        start += n
    for value in out:
        if isinstance(value, _Unpicklable):
            value.raise_here("allgather_object")
    return out


# Called while torch.compile traces, these run as graph breaks (see
# hvdlike.frontend.compile_guard).
broadcast_object = broadcast_object_for(_FRONTEND)
allgather_object = eager(allgather_object)
