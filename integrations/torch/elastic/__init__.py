"""hvdlike.torch.elastic: Horovod's elastic API on torch.

    import hvdlike.torch as hvd

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch, (x, y) in enumerate(loader, start=state.batch):
                ...
                state.commit()
            state.batch = 0

    state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0, batch=0)
    train(state)

Run it with ``hvdlike-run --min-np/--max-np [--host-discovery-script]`` (see
docs/elastic.md). Under a non-elastic launch the decorator only syncs the state
once and lets errors through.
"""

from hvdlike.core import api
from hvdlike.core.elastic import HorovodInternalError, HostsUpdatedInterrupt, State, run
from hvdlike.core.elastic import ObjectState as _ObjectState
from hvdlike.core.elastic.state import use_allreduce

from ..objects import allgather_object, broadcast_object
from .sampler import ElasticSampler
from .state import TorchState


class ObjectState(_ObjectState):
    """Elastic state of plain Python objects (keyword arguments become attributes)."""

    def __init__(self, bcast_object=broadcast_object, get_rank=api.rank, **kwargs):
        super().__init__(bcast_object, get_rank, allgather_object, **kwargs)
        use_allreduce(self)


__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState",
           "State", "TorchState", "run"]
