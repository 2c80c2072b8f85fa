"""Pieces every front end shares: handles, submission, and the collective grid.

A front end (``hvdlike.torch``, ``hvdlike.numpy``, ``hvdlike.jax``...) turns
its framework's arrays into torch tensors for the core and the core's results
back into its framework's arrays. Everything in between -- naming, submitting,
waiting, grouping, the ``*_async``/``*_``/``grouped_*`` variants -- is
framework-neutral and lives here once.

* :mod:`.submit`: :class:`GroupHandle`, :func:`poll`, :func:`synchronize`,
  :func:`submit`, :func:`barrier`, :func:`join`.
* :mod:`.arrays`: :class:`ArrayOps`, the whole collective grid generated from
  an :class:`Adapter` (two conversion functions).
* :mod:`.objects`: :func:`broadcast_object`, :func:`allgather_object`.
"""

from .arrays import Adapter, ArrayOps
from .objects import allgather_object, broadcast_object
from .submit import GroupHandle, barrier, join, poll, submit, synchronize

__all__ = ["Adapter", "ArrayOps", "GroupHandle", "allgather_object", "barrier",
           "broadcast_object", "join", "poll", "submit", "synchronize"]
