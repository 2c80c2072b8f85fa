"""The elastic API shared by the framework-neutral front ends (numpy, jax).

The same retry loop and re-rendezvous as ``hvdlike.torch.elastic`` (one core,
:mod:`hvdlike.core.elastic`); state is an :class:`ObjectState` of picklable
values (arrays and pytrees included), broadcast with ``broadcast_object``.

    import hvdlike.numpy as hvd          # or hvdlike.jax

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            ...
            state.step += 1
            state.commit()

    train(hvd.elastic.ObjectState(params=params, step=0))
"""

from hvdlike.core import api
from hvdlike.core.elastic import HorovodInternalError, HostsUpdatedInterrupt, State, run
from hvdlike.core.elastic import ObjectState as _ObjectState
from hvdlike.core.elastic.state import use_allreduce

from .objects import allgather_object, broadcast_object


class ObjectState(_ObjectState):
    """Elastic state of picklable values (keyword arguments become attributes)."""

    def __init__(self, bcast_object=None, get_rank=api.rank, **kwargs):
        super().__init__(bcast_object or broadcast_object, get_rank, allgather_object, **kwargs)
        use_allreduce(self)


__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "run"]
