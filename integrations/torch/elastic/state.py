"""TorchState: a model, an optimizer, samplers and plain objects, elastic."""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Tuple

import torch

from hvdlike.core import api
from hvdlike.core.elastic import ObjectState
from hvdlike.core.elastic.state import check_names, use_allreduce

from ..functions import broadcast_optimizer_state, broadcast_parameters
from ..objects import allgather_object, broadcast_object
from .sampler import ElasticSampler


class StateHandler:
    """Save / restore / sync of one framework object a :class:`TorchState` holds.

    Horovod's interface: subclass it, implement ``save``, ``restore`` and
    ``sync``, and register it for a type with :func:`set_handler_registry`.
    ``set_value`` takes a new object in place of the old one (and saves it);
    ``reset`` runs when the job re-forms (after ``restore``/``sync``).
    """

    def __init__(self, value):
        self.value = value

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def set_value(self, value) -> None:
        self.value = value
        self.save()

    def reset(self) -> None:
        pass


class _SavedWhenMade(StateHandler):
    """hvdlike's own handlers hold a saved state from the moment they are made."""

    def __init__(self, value):
        super().__init__(value)
        self.save()


class _StateDictHandler(_SavedWhenMade):
    """Saved and restored as a deep copy of the object's state dict."""

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))


class ModelStateHandler(_SavedWhenMade):
    """A module: its state dict (tensors cloned), rank 0's broadcast on sync."""

    def save(self) -> None:
        self._saved = {k: v.detach().clone() for k, v in self.value.state_dict().items()}

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_StateDictHandler):
    """An optimizer: its state dict, ``broadcast_optimizer_state`` on sync."""

    def restore(self) -> None:
        _forget_pending_reduction(self.value)
        super().restore()

    def sync(self) -> None:
        _forget_pending_reduction(self.value)
        broadcast_optimizer_state(self.value, root_rank=0)


class LRSchedulerStateHandler(_StateDictHandler):
    """A learning-rate scheduler: its state dict, rank 0's on sync.

    Kept as a plain attribute it would be deep-copied on restore together with
    its optimizer, and from then on step a copy of the optimizer: the training
    optimizer's learning rate would silently stop following the schedule.
    """

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0))


def _forget_pending_reduction(optimizer) -> None:
    """Drop a DistributedOptimizer's gradient reduction cut short by a lost peer.

    Its handles belong to the runtime that failed; the retried step starts a new
    round on the new runtime.
    """
    if getattr(optimizer, "_hvd_handles", None):
        optimizer._hvd_handles = {}
    if getattr(optimizer, "_hvd_deferred", None):
        optimizer._hvd_deferred = []  # noted by hooks, never started (see _overlaps_cpu)
    if hasattr(optimizer, "_hvd_reset_buckets"):
        optimizer._hvd_reset_buckets()
        optimizer._hvd_passes = {}
        optimizer._hvd_group_ready = {}
        optimizer._hvd_round_open = False


class SamplerStateHandler(_SavedWhenMade):
    """An :class:`ElasticSampler`: its progress; on sync rank 0's epoch and what
    every rank processed in it."""

    def save(self) -> None:
        self._saved = self.value.state_dict()

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        # Rank 0's epoch; the processed indices of every rank in that epoch.
        sampler = self.value
        mine = dict(sampler.state_dict(), length=len(sampler.dataset),
                    shuffle=sampler.shuffle, seed=sampler.seed)
        everyone = allgather_object(mine)
        # Ranks that deal from different permutations would process some samples
        # twice and others never (and run unequal numbers of batches): refuse.
        for what in ("length", "shuffle", "seed"):
            if what == "seed" and not sampler.shuffle:
                continue  # no permutation: the seed is not used
            seen = [state.get(what) for state in everyone]
            if len(set(seen)) > 1:
                label = "len(dataset)" if what == "length" else what
                raise ValueError(
                    f"ElasticSampler: the ranks' samplers disagree on {label}: "
                    + ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(seen))
                    + " (every rank must build it over the same dataset with the same "
                    "shuffle and seed)")
        epoch = everyone[0]["epoch"]
        processed = set()
        for state in everyone:
            if state["epoch"] == epoch:
                processed.update(state["processed_indices"])
        sampler.load_state_dict({"epoch": epoch, "processed_indices": sorted(processed)})

    def reset(self) -> None:
        self.value.reset()


def _schedulers() -> list:
    """The scheduler base classes of this torch (ReduceLROnPlateau stood apart before 2.2)."""
    from torch.optim import lr_scheduler

    found = [getattr(lr_scheduler, "LRScheduler", None) or lr_scheduler._LRScheduler]
    plateau = getattr(lr_scheduler, "ReduceLROnPlateau", None)
    if plateau is not None and not issubclass(plateau, found[0]):
        found.append(plateau)
    return found


_handler_registry: List[Tuple[type, type]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
] + [(kind, LRSchedulerStateHandler) for kind in _schedulers()]


def get_handler_registry() -> List[Tuple[type, type]]:
    """The ``(type, handler class)`` pairs :class:`TorchState` consults, in order."""
    return list(_handler_registry)


def set_handler_registry(registry) -> None:
    """Replace the pairs :class:`TorchState` consults (the first whose type matches wins).

    Raises:
        TypeError: an entry is not a ``(type, StateHandler subclass)`` pair.
    """
    pairs = list(registry)
    for index, pair in enumerate(pairs):
        ok = (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], type)
              and isinstance(pair[1], type) and issubclass(pair[1], StateHandler))
        if not ok:
            raise TypeError(f"set_handler_registry: entry {index} must be a (type, StateHandler "
                            f"subclass) pair, got {pair!r}")
    _handler_registry[:] = [tuple(p) for p in pairs]


def _handler_for(value):
    for kind, handler_cls in _handler_registry:
        if isinstance(value, kind):
            return handler_cls(value)
    return None


class TorchState(ObjectState):
    """Elastic state of a torch training loop.

    ``model`` and ``optimizer`` (and any keyword argument that is a module,
    optimizer or :class:`ElasticSampler`) are saved as state dicts and
    broadcast with ``broadcast_parameters`` / ``broadcast_optimizer_state``;
    every other keyword argument is a plain attribute as in :class:`ObjectState`.

    Example:
        >>> state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0, batch=0)
    """

    def __init__(self, model=None, optimizer=None, **kwargs: Any):
        check_names(self, kwargs)
        kwargs.update(model=model, optimizer=optimizer)
        handlers: Dict[str, StateHandler] = {}
        plain: Dict[str, Any] = {}
        for name, value in kwargs.items():
            handler = _handler_for(value)
            if handler is not None:
                handlers[name] = handler
            elif name not in ("model", "optimizer") or value is not None:
                plain[name] = value
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        if model is None:
            object.__setattr__(self, "model", None)
        if optimizer is None:
            object.__setattr__(self, "optimizer", None)
        super().__init__(broadcast_object, api.rank, allgather_object, **plain)
        use_allreduce(self)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers")
        if handlers is None or name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        handler = _handler_for(value)
        if handler is not None:
            # A module, optimizer or sampler -- given now or in place of another --
            # is kept by its state dict in place, never deep-copied and swapped for
            # a copy (the optimizer and the data loader hold this very object).
            handlers[name] = handler
            self._saved.pop(name, None)
            self.__dict__.get("_added", {}).pop(name, None)
            object.__setattr__(self, name, value)
            return
        if name in handlers:  # no longer a framework object: a plain attribute from now on
            del handlers[name]
        super().__setattr__(name, value)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()
        # What every rank now holds is the committed state of the new job.
        for handler in self._handlers.values():
            handler.save()

    def reset(self) -> None:
        for handler in self._handlers.values():
            handler.reset()
