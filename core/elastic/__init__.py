"""Elastic training, framework-neutral: state objects, the retry loop, re-rendezvous.

A job launched with ``hvdlike-run --min-np/--max-np/--host-discovery-script``
runs in *generations*. The launcher publishes each generation's ranks in the
job's store (:mod:`.protocol`); the ranks of one generation meet under their own
store prefix with fresh Gloo groups. When a peer is lost, every survivor's next
collective raises ``HorovodInternalError``; :func:`run_fn`'s loop restores the
last commit, shuts the runtime down, waits for the launcher's next generation,
re-initializes with the topology it was given there, broadcasts the state from
the new rank 0 and calls the training function again. When hosts are added or
removed, ``state.commit()`` raises :class:`HostsUpdatedInterrupt` on every rank
at the same commit and the loop re-forms without restoring.

Front ends (``hvdlike.torch.elastic`` ...) supply the object collectives and
framework-specific state; everything else lives here.
"""

from hvdlike.core.errors import HorovodInternalError, HostsUpdatedInterrupt

from .loop import run, run_fn
from .state import ObjectState, State

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "run",
           "run_fn"]
