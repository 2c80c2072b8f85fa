"""State that survives a re-form: committed in memory, restored, broadcast.

``commit()`` = ``save()`` (a copy in host memory) + ``check_host_updates()``.
After a lost peer, ``restore()`` goes back to the last commit; after a re-form,
``sync()`` broadcasts the new rank 0's state (rank 0 is always a survivor when
there is one: the launcher keeps surviving ranks first, in their old order).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional

from hvdlike.core.errors import HostsUpdatedInterrupt
from hvdlike.core.log import logger

from . import worker as worker_mod

# Attributes every state object keeps for itself: a keyword argument of that name
# would overwrite them.
_INTERNAL = frozenset({"_bcast_object", "_get_rank", "_allgather_object", "_newest",
                       "_reset_callbacks", "_worker", "_saved", "_handlers"})


def check_names(state: "State", names) -> None:
    """Raise a ValueError naming every keyword of ``names`` that would hide one of
    ``state``'s methods or properties (``commit``, ``save``, ``sync`` ...) or its
    own bookkeeping."""
    clashes = sorted(name for name in names
                     if name in _INTERNAL or hasattr(type(state), name))
    if clashes:
        raise ValueError(
            f"{type(state).__name__}: cannot keep state under the name(s) "
            f"{', '.join(repr(n) for n in clashes)}: {type(state).__name__} uses them itself "
            f"(methods such as commit, save, restore, sync); choose other names")


def copy_value(state: "State", name: str, value: Any, memo: Optional[dict] = None) -> Any:
    """A deep copy of attribute ``name`` for a commit; a TypeError naming the
    attribute when its value cannot be copied (a lock, a file, a generator, a
    tensor that is part of an autograd graph ...). Copies sharing one ``memo``
    keep the objects the attributes share shared."""
    try:
        return copy.deepcopy(value, memo)
    except Exception as exc:
        raise TypeError(
            f"{type(state).__name__} attribute {name!r}: a {type(value).__name__} cannot be "
            f"copied for a commit ({exc}); elastic state must be copyable and picklable "
            f"(numbers, containers, tensors without autograd history, arrays) -- keep this "
            f"object outside the state") from exc


class State:
    """Base of every elastic state object.

    Args:
        bcast_object: ``fn(obj) -> obj``, rank 0's object on every rank (Horovod's
            ``broadcast_object``, whose ``root_rank`` defaults to 0).
        get_rank: ``fn() -> int``, this process's current rank.
        allgather_object: ``fn(obj) -> list``, every rank's object in rank order.

    The front ends' states agree on the newest generation with an allreduce
    instead (:func:`use_allreduce`).
    """

    def __init__(self, bcast_object: Callable, get_rank: Callable[[], int],
                 allgather_object: Optional[Callable] = None):
        # Set through object.__setattr__ so subclasses that track attribute
        # assignment (ObjectState) never mistake these for user state.
        object.__setattr__(self, "_bcast_object", bcast_object)
        object.__setattr__(self, "_get_rank", get_rank)
        object.__setattr__(self, "_allgather_object", allgather_object)
        object.__setattr__(self, "_newest", None)  # fn(int) -> int, see use_allreduce
        object.__setattr__(self, "_reset_callbacks", [])
        object.__setattr__(self, "_worker", None)

    # -- the elastic protocol -------------------------------------------------------

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` after every re-form (e.g. to rescale the learning rate).

        A single callable is accepted as well. Raises TypeError at once for anything
        that cannot be called, rather than at the first re-form.
        """
        if callable(callbacks):
            callbacks = [callbacks]
        try:
            callbacks = list(callbacks)
        except TypeError:
            raise TypeError(f"register_reset_callbacks takes a list of callables, got "
                            f"{type(callbacks).__name__} {callbacks!r:.100}") from None
        for callback in callbacks:
            if not callable(callback):
                raise TypeError(f"register_reset_callbacks: {callback!r:.100} "
                                f"({type(callback).__name__}) is not callable")
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by the retry loop after a re-form, before the state is synced."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state, then raise :class:`HostsUpdatedInterrupt` if hosts changed.

        Every rank must commit at the same points (commits are collective).
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank if the launcher published
        a new generation (seen by any rank: the ranks agree on the newest one)."""
        ctx = self._context()
        if not ctx.enabled:
            return
        latest = ctx.latest()
        if self._newest is not None:
            agreed = self._newest(latest)
        elif self._allgather_object is not None:
            agreed = max(self._allgather_object(latest))
        else:
            agreed = self._bcast_object(latest)  # Horovod's signature: rank 0's by default
        if agreed > ctx.generation:
            raise HostsUpdatedInterrupt(skip_sync=_removed_only(ctx, agreed))

    def _context(self) -> worker_mod.WorkerContext:
        return self._worker or worker_mod.context()

    # -- what subclasses provide -----------------------------------------------------

    def save(self) -> None:
        """Copy the state to host memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the last saved state."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's state rank 0's."""
        raise NotImplementedError

    def reset(self) -> None:
        """Adapt to the new job (size, rank) after a re-form, before :meth:`sync`."""


def _removed_only(ctx: worker_mod.WorkerContext, agreed: int) -> bool:
    """Whether every generation published since this rank's own, up to ``agreed``,
    only removed ranks: only then do the survivors' committed states still agree
    with every member's, and the sync after the re-form may be skipped.

    A generation that added ranks and was replaced before the survivors reached
    a commit (an add, then a removal, within one commit interval) still put new
    ranks in ``agreed``'s table that never synced, though ``agreed`` itself only
    removed one: its flag alone would let the survivors skip the sync the new
    ranks wait in. Every survivor is in the same generation and reads the same
    published tables, so all decide alike; a table that cannot be read counts as
    an addition (syncing is always correct).
    """
    try:
        return all(ctx.read(number).removed_only
                   for number in range(ctx.generation + 1, agreed + 1))
    except Exception:  # noqa: BLE001 - see above: sync when in doubt
        return False


class ObjectState(State):
    """State made of picklable Python objects, given as keyword arguments.

    Each becomes an attribute; assign to it as usual. ``save()`` deep-copies the
    attributes, ``restore()`` puts the copies back, ``sync()`` broadcasts rank 0's.

    Example:
        >>> state = ObjectState(bcast_object, rank, epoch=0, batch=0)
        >>> state.epoch += 1
        >>> state.commit()
    """

    def __init__(self, bcast_object: Callable, get_rank: Callable[[], int],
                 allgather_object: Optional[Callable] = None, /, **kwargs: Any):
        # Positional-only: a state attribute may be called ``get_rank`` too.
        check_names(self, kwargs)
        super().__init__(bcast_object, get_rank, allgather_object)
        memo: dict = {}
        object.__setattr__(self, "_saved", {name: copy_value(self, name, value, memo)
                                            for name, value in kwargs.items()})
        for name, value in kwargs.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_") and name not in self._saved:
            # An attribute added later joins the state at the next commit (until
            # then restore() leaves it alone, as Horovod, which tracks only the
            # constructor's keywords, always does).
            self.__dict__.setdefault("_added", {})[name] = None
        object.__setattr__(self, name, value)

    def _values(self) -> Dict[str, Any]:
        return {name: getattr(self, name) for name in self._saved}

    def save(self) -> None:
        memo: dict = {}
        saved = {name: copy_value(self, name, value, memo)
                 for name, value in self._values().items()}
        for name in self.__dict__.pop("_added", {}):
            try:
                saved[name] = copy_value(self, name, getattr(self, name), memo)
            except TypeError as exc:  # a lock, a file, a tensor with history ...
                logger.warning("elastic: %s; it stays outside the committed state", exc)
        object.__setattr__(self, "_saved", saved)

    def restore(self) -> None:
        self._load_saved()

    def _load_saved(self) -> None:
        for name, value in copy.deepcopy(self._saved).items():
            object.__setattr__(self, name, value)

    def sync(self) -> None:
        # Every rank, even with nothing saved: a rank that joins a running job
        # may not hold the attributes the survivors committed since they
        # started, and a broadcast only some ranks enter never completes.
        synced = self._bcast_object(self._saved)
        object.__setattr__(self, "_saved", synced)
        self.__dict__.pop("_added", None)
        # Only the plain attributes: a subclass's restore() would also roll
        # back what it has just synced itself.
        self._load_saved()


NEWEST_NAME = "hvdlike.elastic.newest_generation"


def use_allreduce(state: State) -> State:
    """Make ``state``'s commits agree on the newest generation by an allreduce
    (:func:`newest_generation`), which a rank that called ``join()`` takes part
    in -- an allgather cannot run then; returns ``state``. Set after
    construction: the front ends' states take every keyword as a user attribute."""
    object.__setattr__(state, "_newest", newest_generation)
    return state


def newest_generation(latest: int) -> int:
    """The largest of every rank's ``latest`` generation number, by an allreduce
    (Max) of the global set: a rank that called ``join()`` takes part with 0."""
    import torch

    from hvdlike.core import api, collectives
    from hvdlike.core.messages import ReduceOp

    value = torch.tensor([latest], dtype=torch.int64)
    entry = collectives.allreduce_entry(value, NEWEST_NAME, op=ReduceOp.MAX, inplace=True)
    return int(api.runtime().run(entry, 0, "hvdlike.elastic"))
