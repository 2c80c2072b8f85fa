"""``DistributedOptimizer(op=Adasum)``: Adasum of every rank's local step.

Horovod's Adasum optimizer does not combine gradients. Each rank updates its
parameters with its own gradient and its own optimizer state (momentum
buffers, Adam moments), and what the ranks combine is the *change* that step
made to each parameter. This module reproduces that. For one parameter ``p``
and one round (``backward_passes_per_step`` backward passes):

1. When backward has produced ``p``'s gradient for the last pass of the
   round, ``p``'s hook copies ``p`` (the start), runs the wrapped
   optimizer's step on ``p`` alone (its parameter group is narrowed to
   ``[p]`` for the call), takes ``delta = p - start``, puts the start back
   into ``p`` and starts an in-place Adasum allreduce of the (compressed)
   delta under ``p``'s name. The exchange overlaps the rest of backward.
2. ``step()`` does the same for every trainable parameter whose hook did
   not complete a round (unused on this rank, fewer passes than configured,
   or a ``step()`` without a backward): its local step runs on whatever
   gradient it holds -- none means the wrapped optimizer leaves it alone and
   its delta is zero, which Adasum leaves out (``combine(a, 0) == a``).
   Every rank thus submits every name.
3. ``step()`` then waits for each reduction and adds the combined delta to
   the start: every rank ends with the same parameters.

Gradients are never exchanged, so they stay local after ``step()``; a
gradient modified after backward (clipping, unscaling) comes too late, since
the local step already used it. Hence ``synchronize()`` has nothing to do and
``skip_synchronize()`` is refused, as in Horovod.

With one rank in the job Adasum changes nothing, and the factory keeps the
gradient optimizer of optimizer.py (also as Horovod does), where
``synchronize()`` and ``skip_synchronize()`` work as usual.

Where this differs from Horovod's ``_DistributedAdasumOptimizer``:

- between backward and ``step()`` a parameter keeps its value (Horovod's
  holds its delta), so a failed or abandoned round leaves the model as it was;
- ``process_set`` is honoured: the members combine their deltas, a rank
  outside the set takes its local step alone (Horovod raises
  ``NotImplementedError`` for any set but the global one);
- optimizer step hooks run once per ``step()`` (Horovod runs them around
  every parameter's local step too);
- parameters added with ``add_param_group`` or unfrozen later take part
  (Horovod only steps the trainable parameters it saw when it was built);
- optimizers whose step needs a closure (``LBFGS``) are refused when the
  optimizer is built, since the local steps run inside backward;
- parameters are not given zero gradients when the optimizer is built.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Dict, Optional

import torch

from hvdlike.core import api as _core_api
from hvdlike.frontend.compile_guard import eager

from . import ops
from .optimizer import _HOOK_OVERFLOW, _Distributed

_ADASUM_CLASSES: Dict[type, type] = {}


class _DistributedAdasum(_Distributed):
    """Methods put in front of the wrapped optimizer's class for ``op=Adasum``.

    It reuses the gradient optimizer's naming, hooking and bookkeeping
    (``_hvd_names``, ``_hvd_handles``, ``_hvd_passes``, ``_hvd_round_open``:
    the names elastic recovery resets) and replaces what happens in a hook
    and in ``step()``. ``_hvd_handles`` maps ``id(p)`` to
    ``("delta", handle, compressed delta, (p, compression context))``.
    """

    # Set per class by distributed_adasum_class(): the wrapped class's step
    # without torch's step-hook wrapper (hooks run once, around our step()).
    _hvd_base_step = None

    def _hvd_setup(self, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, num_groups, groups, sparse_as_dense,
                   process_set, gradient_as_bucket_view) -> None:
        # id(p) -> index of the parameter group holding p, for the local step
        self._hvd_home: Dict[int, int] = {}
        self._hvd_home_for: object = None
        super()._hvd_setup(named_parameters, compression, backward_passes_per_step, op,
                           gradient_predivide_factor, num_groups, groups, sparse_as_dense,
                           process_set, gradient_as_bucket_view)
        # groups/num_groups were checked like for any op; a delta is always
        # combined on its own (per tensor), so they change nothing here. The
        # deltas are dense whatever the gradients are: sparse_as_dense and
        # gradient_as_bucket_view have nothing to act on either.
        self._hvd_groups, self._hvd_group_of = [], {}
        self._hvd_signature = None
        self._hvd_register_all()

    def _hvd_register_all(self) -> None:
        super()._hvd_register_all()
        if self._hvd_home_for is not self._hvd_signature:
            self._hvd_home = {id(p): gi for gi, _, p in self._hvd_params()}
            self._hvd_home_for = self._hvd_signature

    # -- the local step and its delta --------------------------------------------

    def _hvd_hook(self, p: torch.Tensor) -> None:
        key = id(p)
        count = self._hvd_passes.get(key, 0) + 1
        if count > self._hvd_k:
            raise RuntimeError(_HOOK_OVERFLOW.format(name=self._hvd_names[p], k=self._hvd_k))
        self._hvd_passes[key] = count
        self._hvd_round_open = True
        if count == self._hvd_k:
            self._hvd_start_delta(p)

    def _hvd_local_step(self, p: torch.Tensor) -> None:
        """The wrapped optimizer's step on ``p`` alone (its group narrowed to ``[p]``)."""
        home = self._hvd_home.get(id(p))
        if home is None:  # param_groups edited in place since the last look
            self._hvd_signature = None
            self._hvd_register_all()
            home = self._hvd_home.get(id(p))
            if home is None:  # no longer the optimizer's: nothing to step
                return
        groups = self.param_groups
        kept = [group["params"] for group in groups]
        try:
            for gi, group in enumerate(groups):
                group["params"] = [p] if gi == home else []
            self._hvd_base_step(self)
        finally:
            for group, params in zip(groups, kept):
                group["params"] = params

    def _hvd_start_delta(self, p: torch.Tensor) -> None:
        """Local step on ``p``, ``p`` back to its start, Adasum of the change started."""
        with torch.no_grad():
            start = p.detach().clone()
            try:
                self._hvd_local_step(p)
            finally:
                delta = p.detach() - start
                p.copy_(start)
        del start
        compressed, ctx = self._hvd_compression.compress(delta)
        handle = ops.allreduce_async_(compressed, name=self._hvd_names[p], op=ops.Adasum,
                                      process_set=self._hvd_process_set)
        self._hvd_handles[id(p)] = ("delta", handle, compressed, (p, ctx))

    # -- optimizer interface -----------------------------------------------------

    def synchronize(self) -> None:
        """Does nothing with ``op=Adasum`` (as in Horovod).

        Gradients are not exchanged: each parameter's local step already ran
        during backward, and ``step()`` combines and applies the changes.
        """

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Refused with ``op=Adasum`` (as in Horovod): there is no synchronization to skip."""
        raise RuntimeError(
            "DistributedOptimizer(op=Adasum).skip_synchronize() is not supported: each "
            "parameter's local step runs during backward() and step() combines the parameter "
            "changes, so gradients modified after backward() (clipping, unscaling) are not "
            "used; call step() without synchronize()/skip_synchronize()")
        yield  # pragma: no cover - makes this a generator

    def step(self, closure=None):
        """Finish this round: local steps still due, Adasum of every change, apply it."""
        self._hvd_tell_scheduler()
        if not self._hvd_included:  # outside the process set: the local step alone
            return self._hvd_base_step(self, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._hvd_register_all()  # parameters added or unfrozen since
        idle = []  # parameters whose hook did not complete them
        for _, _, p in self._hvd_params():
            if p.requires_grad and id(p) not in self._hvd_handles:
                idle.append(p)
                self._hvd_start_delta(p)
        handles, self._hvd_handles = self._hvd_handles, {}
        self._hvd_passes = {}
        self._hvd_round_open = False
        if idle:
            self._hvd_rehook(idle)  # a replaced gradient accumulator is hooked again
        with torch.no_grad():
            for _, handle, _, (p, ctx) in handles.values():
                combined = self._hvd_compression.decompress(ops.synchronize(handle), ctx)
                p.add_(combined)  # p holds its start: start + combined delta
        return loss

    # Step hooks and the profiler's record run once, around the whole step.
    step = torch.optim.Optimizer.profile_hook_step(step)
    step.hooked = True
    # Graph breaks under torch.compile (see hvdlike.frontend.compile_guard).
    step = eager(step)
    synchronize = eager(synchronize)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._hvd_handles or self._hvd_round_open:
            raise RuntimeError(
                "DistributedOptimizer(op=Adasum).zero_grad() was called after backward() but "
                "before step(): the local steps of this round already used the gradients and "
                "their changes are being combined; call step() first")
        self._hvd_passes = {}
        return super(_Distributed, self).zero_grad(set_to_none=set_to_none)


def _one_rank() -> bool:
    """Whether the job is known to have a single rank (then Adasum changes nothing)."""
    return _core_api.is_initialized() and _core_api.size() == 1


def _plain_step(cls: type):
    """``cls.step`` without torch's step-hook wrapper (the function it wraps)."""
    step = cls.step
    if getattr(step, "hooked", False) and callable(getattr(step, "__wrapped__", None)):
        return step.__wrapped__
    return step


def distributed_adasum_class(cls: type) -> Optional[type]:
    """The subclass of ``cls`` for ``op=Adasum`` (cached); None with one rank, where the
    gradient optimizer is used instead, as in Horovod."""
    if issubclass(cls, _Distributed):
        raise TypeError("DistributedOptimizer: the optimizer is already distributed")
    base_step = _plain_step(cls)
    try:
        closure = inspect.signature(base_step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read
        closure = None
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"DistributedOptimizer: op=Adasum cannot wrap {cls.__name__}, whose step() needs a "
            "closure: with Adasum each parameter's local step runs during backward(), without "
            "one; use op=Average or Sum")
    if _one_rank():
        return None
    new = _ADASUM_CLASSES.get(cls)
    if new is None:
        new = type(cls.__name__, (_DistributedAdasum, cls),
                   {"__module__": cls.__module__, "_hvd_base_step": staticmethod(base_step)})
        _ADASUM_CLASSES[cls] = new
    return new
