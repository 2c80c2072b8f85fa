"""hvdlike.numpy.elastic: the elastic API on the numpy front end (see :mod:`hvdlike.frontend.elastic`)."""

from hvdlike.frontend.elastic import (  # noqa: F401 - the shared implementation
    HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State, run, __all__,
)
