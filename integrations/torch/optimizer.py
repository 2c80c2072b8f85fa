"""``DistributedOptimizer``: average gradients across ranks while backward runs.

The wrapper hooks every trainable parameter's gradient accumulator (the
autograd node that adds a backward pass's gradient into ``p.grad``; see
:func:`_take_over`), so its hook runs after every hook the user registered
on the parameter with ``register_post_accumulate_grad_hook``, before or
after wrapping. When a parameter's gradient is complete for this step
(after ``backward_passes_per_step`` backward passes), its hook starts an
asynchronous allreduce, so communication overlaps the rest of the backward
pass. ``step()`` waits for the reductions, then runs the wrapped optimizer.

Small dense gradients (op Average or Sum, no ``groups``) travel in *buckets*:
each hook only counts its gradient in, and once a bucket's gradients are all
there they are copied into its flat buffer in one call and the buffer leaves
as one allreduce, which saves the per-gradient cost of a request on models
with many small tensors. Buckets are assigned at construction, identically on
every rank; ``synchronize()`` completes a bucket with zeros for the gradients
this rank did not produce. After the reduction a bucket member's ``.grad`` is
its view into the bucket (``gradient_as_bucket_view``, see buckets.py).

A *round* of gradient reduction opens with the first hook after the last
synchronization and closes at ``synchronize()``. When the round closes,
parameters whose hook did not fire on this rank (an unused branch, a
parameter only some ranks touched) are reduced with whatever gradient they
hold -- zeros when they have none -- under the same name, so every rank
submits every name and ends with identical gradients. Synchronizing when no
round is open does nothing: the gradients are already reduced.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import sys
import warnings
import weakref
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from hvdlike.core import api as _core_api
from hvdlike.core import current as _current
from hvdlike.core import shm_segment as _shm_segment
from hvdlike.core.errors import NotInitializedError
from hvdlike.core.process_sets import global_process_set
from hvdlike.frontend.caller import user_stacklevel as _user_stacklevel
from hvdlike.frontend.compile_guard import eager

from . import buckets as _buckets
from . import ops
from .compression import Compression
from .sparse import sparse_allreduce_async

_HOOK_OVERFLOW = (
    "the gradient of {name!r} was computed more than backward_passes_per_step={k} time(s) "
    "since the last step()/synchronize(); call step() after every {k} backward pass(es) or "
    "raise backward_passes_per_step")


class _Distributed:
    """Methods mixed in front of the wrapped optimizer's class (see the factory)."""

    # -- setup -----------------------------------------------------------------

    def _hvd_setup(self, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, num_groups, groups, sparse_as_dense,
                   process_set, gradient_as_bucket_view) -> None:
        self._hvd_compression = compression
        self._hvd_k = backward_passes_per_step
        self._hvd_op = op
        self._hvd_process_set = process_set
        self._hvd_sparse_as_dense = sparse_as_dense
        if op == ops.Average:
            # The core divides Average by the set size after the sum; moving
            # part of the division before the sum keeps fp16 sums in range.
            self._hvd_prescale = 1.0 / gradient_predivide_factor
            self._hvd_postscale = gradient_predivide_factor
        else:
            self._hvd_prescale = self._hvd_postscale = 1.0
        self._hvd_names: Dict[torch.Tensor, str] = {}
        self._hvd_named: set = set()  # ids of the parameters in _hvd_names
        self._hvd_user_names = _check_named_parameters(named_parameters, self.param_groups)
        # Two optimizers (a GAN's) may both own "0.weight": the second and later
        # ones prefix their names. Build them in the same order on every rank.
        index = _current.instance_number("DistributedOptimizer")
        self._hvd_prefix = "" if index == 0 else f"opt{index}."
        # Per-parameter tables are keyed by id(p): a tensor's own __hash__ is a
        # Python call, and the hooks look parameters up hundreds of times a step.
        self._hvd_hooks: Dict[int, _Hook] = {}
        # id(p) -> name of the parameters a newer DistributedOptimizer took over
        self._hvd_lost: Dict[int, str] = {}
        self._hvd_passes: Dict[int, int] = {}
        # id(p), ("group", index) or ("bucket", index) -> pending work
        self._hvd_handles: Dict[object, tuple] = {}
        self._hvd_round_open = False
        self._hvd_should_sync = True
        # set by an explicit synchronize(): a step() outside skip_synchronize()
        # then warns, as Horovod's does, and synchronizes (a no-op) again
        self._hvd_synchronized = False
        # sparse gradients reduced as dense (sparse_as_dense): made sparse again
        # after the reduction, since optimizers such as SparseAdam demand it
        self._hvd_resparse: Dict[int, torch.Tensor] = {}
        # A rank outside the process set neither reduces nor waits: its
        # optimizer steps on its local gradients, as in Horovod.
        self._hvd_included = process_set.included() is not False
        self._hvd_group_of: Dict[int, int] = {}
        self._hvd_groups: List[List[torch.Tensor]] = []
        self._hvd_group_ready: Dict[int, set] = {}
        self._hvd_buckets: List[_buckets.Bucket] = []
        self._hvd_bucket_of: Dict[int, Tuple[_buckets.Bucket, int]] = {}
        # What _hvd_register_all saw last: the param lists (identity, length),
        # the parameters it could not hook (frozen) and those outside buckets
        # and groups, which synchronize() completes one by one.
        self._hvd_signature: object = None
        self._hvd_unhooked: List[torch.Tensor] = []
        self._hvd_loose: List[torch.Tensor] = []
        # Reductions of CPU gradients held back until synchronize() (see
        # _overlaps_cpu): (start function, its argument), in hook order.
        self._hvd_deferred: List[tuple] = []
        self._hvd_defer = not _overlaps_cpu()
        self._hvd_syncing = False  # inside synchronize(): see _hvd_start_bucket
        self._hvd_register_all()
        self._hvd_build_groups(num_groups, groups)
        if op != ops.Adasum and not self._hvd_groups:
            self._hvd_build_buckets(gradient_as_bucket_view)

    @property
    def _parameter_names(self) -> Dict[torch.Tensor, str]:
        """Parameter -> the name its gradient is reduced under (Horovod's attribute).

        Without ``named_parameters`` the names are
        ``DistributedOptimizer.noname.<group>.<index>``, the same on every rank.
        """
        self._hvd_register_all()
        cut = len(self._hvd_prefix)
        return {p: name[cut:] for p, name in self._hvd_names.items()}

    @property
    def backward_passes_per_step(self) -> int:
        """Backward passes accumulated per reduction (Horovod's attribute; change it
        with :meth:`set_backward_passes_per_step`)."""
        return self._hvd_k

    def _hvd_params(self) -> Iterable[Tuple[int, int, torch.Tensor]]:
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                yield gi, pi, p

    def _hvd_register_all(self) -> None:
        """Name every parameter and hook every trainable one.

        Runs at every synchronization so that a parameter added (to
        ``param_groups``) or unfrozen since is reduced too; when neither
        happened it only compares the parameter lists and the frozen ones.
        """
        signature = [(id(g["params"]), len(g["params"])) for g in self.param_groups]
        if signature == self._hvd_signature and not any(
                p.requires_grad for p in self._hvd_unhooked):
            return
        self._hvd_signature = signature
        named, hooks, included = self._hvd_named, self._hvd_hooks, self._hvd_included
        unhooked, loose = [], []
        for gi, pi, p in self._hvd_params():
            key = id(p)  # parameters stay alive in param_groups, so ids stay theirs
            if key not in named:
                named.add(key)
                self._hvd_names[p] = self._hvd_prefix + self._hvd_user_names.get(
                    p, f"DistributedOptimizer.noname.{gi}.{pi}")
            if key not in hooks and included:
                if p.requires_grad:
                    hooks[key] = _take_over(p, self, self._hvd_bucket_of.get(key))
                else:
                    unhooked.append(p)
            if key not in self._hvd_bucket_of and key not in self._hvd_group_of:
                loose.append(p)
        self._hvd_unhooked, self._hvd_loose = unhooked, loose

    def _hvd_ordered_params(self) -> List[torch.Tensor]:
        """The optimizer's parameters in an order every rank agrees on.

        With ``named_parameters``, the order of those names (the model's
        registration order), so that ranks whose ``param_groups`` list the same
        parameters differently (built from a set, groups in another order) still
        plan the same buckets and groups; without, the ``param_groups`` order,
        which must then be the same everywhere anyway.
        """
        params = [p for _, _, p in self._hvd_params()]
        if not self._hvd_user_names:
            return params
        mine = {id(p) for p in params}
        return [p for p in self._hvd_user_names if id(p) in mine]

    def _hvd_build_groups(self, num_groups, groups) -> None:
        dense = [p for p in self._hvd_ordered_params() if p.requires_grad]
        if groups is not None:
            if not isinstance(groups, (list, tuple)):
                raise TypeError("DistributedOptimizer: groups must be a list of lists of "
                                f"parameters, got {type(groups).__name__}")
            known = set(dense)
            member_lists = []
            for i, members in enumerate(groups):
                members = list(members)
                for p in members:
                    if p not in known:
                        raise ValueError(f"DistributedOptimizer: groups[{i}] holds a tensor "
                                         "that is not a trainable parameter of the optimizer")
                    if id(p) in self._hvd_group_of:
                        raise ValueError(f"DistributedOptimizer: a parameter appears in more "
                                         f"than one group (again in groups[{i}])")
                    self._hvd_group_of[id(p)] = len(member_lists)
                member_lists.append(members)
        elif num_groups:
            if not isinstance(num_groups, int) or num_groups < 0:
                raise ValueError(f"DistributedOptimizer: num_groups must be a non-negative int, "
                                 f"got {num_groups!r}")
            # Nearly equal sizes, the first ``len % n`` groups one longer (as Horovod
            # splits); more groups than parameters leaves the extra ones out.
            each, longer = divmod(len(dense), num_groups)
            member_lists = [dense[i * each + min(i, longer):(i + 1) * each + min(i + 1, longer)]
                            for i in range(num_groups)]
            member_lists = [members for members in member_lists if members]
            for gi, members in enumerate(member_lists):
                for p in members:
                    self._hvd_group_of[id(p)] = gi
        else:
            member_lists = []
        self._hvd_groups = member_lists

    def _hvd_build_buckets(self, as_views: bool) -> None:
        """Pack dense trainable parameters into flat buckets (see buckets.py)."""
        threshold = _core_api.runtime().config.fusion_threshold
        self._hvd_buckets = _buckets.plan(self._hvd_ordered_params(), self._hvd_names,
                                          threshold, as_views)
        for bucket in self._hvd_buckets:
            bucket.direct = self._hvd_k == 1
            for slot, p in enumerate(bucket.members):
                where = self._hvd_bucket_of[id(p)] = (bucket, slot)
                if id(p) in self._hvd_hooks:  # hooked before its bucket existed
                    self._hvd_hooks[id(p)] = _take_over(p, self, where)
        self._hvd_signature = None  # bucket members are no longer loose
        self._hvd_register_all()

    def _hvd_open(self) -> bool:
        """Whether a backward pass produced gradients since the last synchronization."""
        return self._hvd_round_open or any(b.pending != b.size for b in self._hvd_buckets)

    def _hvd_sparse_in_bucket(self, p: torch.Tensor):
        """The dense gradient a bucket packs for ``p``'s sparse one (None: sent alone)."""
        if self._hvd_sparse_as_dense:
            self._hvd_resparse[id(p)] = p
            p.grad = p.grad.to_dense()
            return p.grad
        self._hvd_start(p)  # its own gather; the bucket slot travels as zeros
        return None

    def _hvd_due(self, start, what, cpu: bool, witness: torch.Tensor) -> None:
        """``start(what)`` now, or at synchronize() for a CPU reduction held back
        (see :func:`_overlaps_cpu`).

        A held-back reduction notes one of its parameters' gradients and that
        gradient's version: changed when the reduction starts, user code
        changed the gradients between backward and synchronization (see
        :meth:`_hvd_warn_changed`).
        """
        if self._hvd_defer and cpu:
            grad = witness.grad
            self._hvd_deferred.append(
                (start, what, witness, grad, None if grad is None else grad._version))
        else:
            start(what)

    def _hvd_launch_bucket(self, bucket: _buckets.Bucket) -> None:
        self._hvd_due(self._hvd_start_bucket, bucket, bucket.flat.is_cpu, bucket.members[0])

    def _hvd_start_bucket(self, bucket: _buckets.Bucket) -> None:
        bucket.pack(self._hvd_sparse_in_bucket)
        # Packed during backward (not by synchronize itself): user code may still
        # change the gradients before step(); checked when the results come back.
        bucket.early = not self._hvd_syncing
        compressed, ctx = self._hvd_compression.compress(bucket.flat)
        handle = ops.fused_allreduce_async_(compressed, bucket.name, self._hvd_op,
                                            self._hvd_prescale, self._hvd_postscale,
                                            self._hvd_process_set, bucket.layout)
        self._hvd_handles[("bucket", bucket.index)] = ("bucket", handle, compressed,
                                                       (bucket, ctx))

    def _hvd_hook(self, p: torch.Tensor) -> None:
        key = id(p)
        where = self._hvd_bucket_of.get(key)
        if where is not None and self._hvd_k == 1:
            # The common case, kept short: a bucket member's slot says whether
            # its hook already fired this round.
            bucket, slot = where
            if bucket.marked[slot]:
                raise RuntimeError(_HOOK_OVERFLOW.format(name=self._hvd_names[p], k=1))
            self._hvd_round_open = True
            if bucket.mark(slot):
                self._hvd_launch_bucket(bucket)
            return
        count = self._hvd_passes.get(key, 0) + 1
        if count > self._hvd_k:
            raise RuntimeError(_HOOK_OVERFLOW.format(name=self._hvd_names[p], k=self._hvd_k))
        self._hvd_passes[key] = count
        self._hvd_round_open = True
        if count < self._hvd_k:
            return
        if where is not None:
            bucket, slot = where
            if bucket.mark(slot):
                self._hvd_launch_bucket(bucket)
            return
        gi = self._hvd_group_of.get(key)
        if gi is None:
            self._hvd_launch(p)
            return
        ready = self._hvd_group_ready.setdefault(gi, set())
        ready.add(key)
        if len(ready) == len(self._hvd_groups[gi]):
            self._hvd_launch_group(gi)

    # -- communication ---------------------------------------------------------

    def _hvd_dense_grad(self, p: torch.Tensor, force: bool = False) -> torch.Tensor:
        if p.grad is None:
            p.grad = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif p.grad.is_sparse and (self._hvd_sparse_as_dense or force):
            self._hvd_resparse[id(p)] = p
            p.grad = p.grad.to_dense()
        return p.grad

    def _hvd_launch(self, p: torch.Tensor) -> None:
        self._hvd_due(self._hvd_start, p, p.is_cpu, p)

    def _hvd_start(self, p: torch.Tensor) -> None:
        name = self._hvd_names[p]
        if p.grad is not None and p.grad.is_sparse and not self._hvd_sparse_as_dense:
            handle = sparse_allreduce_async(p.grad, name=name, op=self._hvd_op,
                                            process_set=self._hvd_process_set)
            self._hvd_handles[id(p)] = ("sparse", handle, p, None)
            return
        grad = self._hvd_dense_grad(p)
        compressed, ctx = self._hvd_compression.compress(grad)
        handle = ops.allreduce_async_(compressed, name=name, op=self._hvd_op,
                                      prescale_factor=self._hvd_prescale,
                                      postscale_factor=self._hvd_postscale,
                                      process_set=self._hvd_process_set)
        self._hvd_handles[id(p)] = ("dense", handle, compressed, (p, ctx))

    def _hvd_launch_group(self, gi: int) -> None:
        members = self._hvd_groups[gi]
        self._hvd_due(self._hvd_start_group, gi, members[0].is_cpu, members[0])

    def _hvd_start_group(self, gi: int) -> None:
        members = self._hvd_groups[gi]
        # Grouped gradients travel dense: a group is one fused allreduce.
        pairs = [self._hvd_compression.compress(self._hvd_dense_grad(p, force=True))
                 for p in members]
        handle = ops.grouped_allreduce_async_(
            [c for c, _ in pairs], name=f"DistributedOptimizer.group.{gi}."
            f"{self._hvd_names[members[0]]}", op=self._hvd_op,
            prescale_factor=self._hvd_prescale, postscale_factor=self._hvd_postscale,
            process_set=self._hvd_process_set)
        self._hvd_handles[("group", gi)] = ("group", handle, pairs, members)

    def synchronize(self) -> None:
        """Finish this round's gradient reduction; gradients are averaged afterwards.

        Call it before modifying gradients (clipping, unscaling), then call
        ``step()`` inside :meth:`skip_synchronize`.

        Without a backward pass on this rank since the last ``step()``, every
        gradient is still submitted -- the one it holds, zeros where it has
        none -- as under Horovod: another rank may have run one (a rank that
        skipped a batch still steps with the others), and the reductions must
        pair up. Called again before ``step()`` it does nothing.
        """
        if self._hvd_lost:
            self._hvd_refuse_lost()
        self._hvd_register_all()  # parameters unfrozen or added since
        if self._hvd_included and (self._hvd_open() or not self._hvd_synchronized):
            deferred, self._hvd_deferred = self._hvd_deferred, []
            self._hvd_defer = not _overlaps_cpu()  # for the next round
            # No core is idle: this thread, which waits for them anyway, runs the
            # reductions held back to now (Runtime.cycles_here).
            self._hvd_syncing = True
            try:
                with _core_api.runtime().cycles_here() if deferred else contextlib.nullcontext():
                    self._hvd_finish(deferred)
            except BaseException:
                # A failed round (a lost peer, a runtime shut down) must not leave
                # marks that make the next zero_grad() or backward() refuse to run.
                self._hvd_abandon_round()
                raise
            finally:
                self._hvd_syncing = False
        # Only once it succeeded: after a failure (an elastic reset) the next
        # step() must synchronize without warning.
        self._hvd_synchronized = True

    def _hvd_warn_changed(self, name: str) -> None:
        """Warn that gradients changed between backward and a held-back reduction.

        Reductions held back to synchronize() (no idle core) reduce what the
        gradients hold then: clipping or unscaling done before synchronize()
        is averaged across ranks -- right for a scaling, not for clipping --
        where on a host with an idle core, or a GPU, the same script is
        refused (see :func:`_refuse_late_change`). Warned, not refused: the
        plain forms of linear changes have always worked here.
        """
        warnings.warn(
            f"DistributedOptimizer: the gradient of {name!r} was changed after backward() and "
            f"before optimizer.synchronize() (in place, or replaced): the ranks average the "
            f"changed gradients, which differs from changing the average for anything but a "
            f"scaling (clip_grad_norm_ clips each rank's gradient, not the average), and "
            f"where reductions start during backward (a GPU, HVDLIKE_CPU_OVERLAP=1) this is "
            f"an error. Change gradients after the reduction: optimizer.synchronize(); change "
            f"them; then with optimizer.skip_synchronize(): optimizer.step()",
            stacklevel=_user_stacklevel())

    def _hvd_refuse_lost(self) -> None:
        """Raise when a newer DistributedOptimizer reduces some of our parameters."""
        mine = {id(p) for _, _, p in self._hvd_params()}
        lost = [name for key, name in self._hvd_lost.items() if key in mine]
        if lost:
            more = f" and {len(lost) - 1} more" if len(lost) > 1 else ""
            raise RuntimeError(
                f"DistributedOptimizer: the gradients of {lost[0]!r}{more} are reduced by a "
                f"newer DistributedOptimizer wrapped around the same parameters; this older "
                f"one would step on local, unreduced gradients and the ranks would drift "
                f"apart. Step the newer optimizer: each parameter belongs to the "
                f"DistributedOptimizer wrapped around it last")
        self._hvd_lost = {}  # removed from this optimizer's groups since

    def _hvd_finish(self, deferred: List[tuple]) -> None:
        """synchronize()'s work: start what is held back or not started, wait for all."""
        for start, what, p, grad, version in deferred:  # in the order backward produced them
            if p.grad is not grad or (grad is not None and grad._version != version):
                self._hvd_warn_changed(self._hvd_names.get(p, "a parameter"))
                break
        for start, what, *_ in deferred:
            start(what)
        launched_groups = {k[1] for k in self._hvd_handles if isinstance(k, tuple)
                           and k[0] == "group"}
        idle: List[torch.Tensor] = []  # parameters whose hook did not complete them
        for gi in range(len(self._hvd_groups)):
            if gi not in launched_groups and any(p.requires_grad for p in self._hvd_groups[gi]):
                idle.extend(self._hvd_groups[gi])
                self._hvd_start_group(gi)
        for bucket in self._hvd_buckets:
            # Every rank submits every bucket, missing gradients as zeros.
            if bucket.pending:
                idle.extend(p for p, marked in zip(bucket.members, bucket.marked) if not marked)
                bucket.pending = 0
                self._hvd_start_bucket(bucket)
        for p in self._hvd_loose:
            if p.requires_grad and id(p) not in self._hvd_handles:
                idle.append(p)
                self._hvd_start(p)
        handles, self._hvd_handles = self._hvd_handles, {}
        self._hvd_reset_buckets()
        self._hvd_passes = {}
        self._hvd_group_ready = {}
        self._hvd_round_open = False
        if idle:
            self._hvd_rehook(idle)
        self._hvd_complete(handles)

    def _hvd_rehook(self, params: Iterable[torch.Tensor]) -> None:
        """Hook again those of ``params`` whose gradient accumulator autograd replaced.

        A hook lives on the accumulator node (see :func:`_take_over`), which
        autograd replaces when the parameter gets another dtype or device
        (``p.data = ...``, ``module.double()``, ``.to(device)``) or other
        memory (``p.set_(...)``); the new node has no hook. Called at
        synchronization with the parameters whose hook did not complete them
        this round -- only those can have lost it -- so the next rounds hook
        them again (this one reduced them at synchronization). A parameter
        with the dtype, device and memory it had when it was hooked is taken
        as unchanged without looking at its node.
        """
        hooks = self._hvd_hooks
        for p in params:
            hooked = hooks.get(id(p))
            if hooked is None or not p.requires_grad:
                continue
            placement = _placement(p)
            if placement == hooked.placement:
                continue
            if _grad_accumulator(p) is hooked.node:
                hooked.placement = placement  # the same node: new memory of the same kind
            else:
                hooks[id(p)] = _take_over(p, self, self._hvd_bucket_of.get(id(p)))

    def _hvd_complete(self, handles: dict) -> None:
        """Wait for this round's reductions and hand the results to the gradients."""
        for kind, handle, payload, extra in handles.values():
            if kind == "sparse":
                payload.grad = ops.synchronize(handle)  # payload: the parameter
            elif kind == "dense":
                out = ops.synchronize(handle)
                p, ctx = extra
                if payload is not p.grad:
                    p.grad.copy_(self._hvd_compression.decompress(out, ctx))
            elif kind == "bucket":
                bucket, ctx = extra
                out = ops.synchronize(handle)
                if bucket.early:
                    _refuse_late_change(bucket)
                if payload is not bucket.flat:
                    bucket.flat.copy_(self._hvd_compression.decompress(out, ctx))
                bucket.unpack()
            else:
                outs = ops.synchronize(handle)
                for p, out, (compressed, ctx) in zip(extra, outs, payload):
                    if compressed is not p.grad:
                        p.grad.copy_(self._hvd_compression.decompress(out, ctx))
        resparse, self._hvd_resparse = self._hvd_resparse, {}
        for p in resparse.values():
            if p.grad is not None and not p.grad.is_sparse:
                p.grad = p.grad.to_sparse()
        if any(bucket.stale for bucket in self._hvd_buckets):
            self._hvd_rebuild_buckets()

    def _hvd_rebuild_buckets(self) -> None:
        """Plan the buckets again after the model changed under them.

        ``module.double()``, ``.half()`` or ``.to(memory_format=...)`` after
        wrapping give the parameters another dtype or layout and move the
        gradients out of their bucket views (see ``Bucket.stale``); that round
        was reduced through copies, the next ones use buckets of the new kind.
        Every rank converting alike re-plans alike.
        """
        old, self._hvd_buckets = self._hvd_buckets, []
        as_views = old[0].as_views if old else True
        self._hvd_bucket_of = {}
        for bucket in old:
            for p in bucket.members:
                if id(p) in self._hvd_hooks:
                    self._hvd_hooks[id(p)] = _take_over(p, self, None)
        self._hvd_build_buckets(as_views)

    def _hvd_reset_buckets(self) -> None:
        for bucket in self._hvd_buckets:
            bucket.reset()

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change ``backward_passes_per_step`` (between steps, on every rank alike)."""
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be an int >= 1, got {passes!r}")
        if self._hvd_open():
            raise RuntimeError("set_backward_passes_per_step() during an accumulation: call "
                               "step() or synchronize() first")
        self._hvd_k = passes
        for bucket in self._hvd_buckets:
            bucket.direct = passes == 1

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this block ``step()`` does not synchronize (you already did)."""
        previous = self._hvd_should_sync
        self._hvd_should_sync = False
        try:
            yield
        finally:
            self._hvd_should_sync = previous
            # The round ends here even when step() did not run (GradScaler skips
            # it after an overflow, on every rank alike): the next synchronize()
            # submits every gradient again, backward or not.
            self._hvd_synchronized = False

    # -- optimizer interface ---------------------------------------------------

    def _hvd_tell_scheduler(self) -> None:
        """Mark a step on the wrapped optimizer for a scheduler built on it.

        A learning-rate scheduler made before wrapping watches the optimizer it
        was given (its order check reads that object's ``_opt_called``); the
        steps now go through this wrapper instead.
        """
        origin = self.__dict__.get("_hvd_origin")
        if origin is not None:
            origin._opt_called = True

    def step(self, closure=None):
        """Synchronize gradients (unless inside ``skip_synchronize``), then step."""
        self._hvd_tell_scheduler()
        if self._hvd_should_sync:
            if self._hvd_synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(): the second "
                              "synchronization is a no-op; wrap step() in "
                              "skip_synchronize() to say so", stacklevel=_user_stacklevel())
            elif self._hvd_open() and _unscaled_by_grad_scaler(self):
                self._hvd_unscaled_first()
            if closure is None or self._hvd_open():
                # (With a closure and nothing accumulated, each evaluation of
                # the closure synchronizes what its backward produced.)
                self.synchronize()
        elif self._hvd_open():
            warnings.warn("DistributedOptimizer.step() inside skip_synchronize() after a "
                          "backward pass that was not synchronized: call synchronize() first "
                          "or the ranks' gradients differ", stacklevel=_user_stacklevel())
        if closure is not None:
            user_closure = closure

            def closure():
                # Each evaluation must see reduced gradients (LBFGS calls it
                # repeatedly), and is a round of its own, backward or not.
                self._hvd_synchronized = False
                with torch.enable_grad():
                    loss = user_closure()
                self.synchronize()
                return loss

        try:
            return super().step(closure)
        finally:
            self._hvd_synchronized = False

    def _hvd_unscaled_first(self) -> None:
        """Refuse ``scaler.step(optimizer)`` that unscaled this round's gradients
        before their reduction.

        Reductions already under way (started during backward: a GPU, a host
        with an idle core) reduce the scaled gradients and their results replace
        the unscaled ones: the step would be ``scale`` times too large.
        ``unscale_`` writes without bumping the gradients' versions, so
        :func:`_refuse_late_change` cannot see it; the scaler's own record of the
        optimizer's stage does. Held back to synchronize(), the reductions would
        average unscaled gradients, but a rank whose own gradients overflowed
        skips ``step()`` while the others wait in it. Refused in both cases, so
        that every rank of a job decides alike (whether a reduction already
        started differs between ranks by timing) and a script does not pass on
        one host to fail on another.
        """
        raise RuntimeError(
            "DistributedOptimizer stepped by GradScaler.step(optimizer) without "
            "optimizer.synchronize() first: the scaler unscaled (or, for an optimizer that "
            "unscales in its fused step, checked for inf) each rank's own gradients "
            "before their reduction (reductions already under way would replace them with "
            "the scaled average, a step scale times too large; a rank whose gradients "
            "overflowed would skip step() while the others wait). Use: "
            "scaler.scale(loss).backward(); optimizer.synchronize(); "
            "scaler.unscale_(optimizer); (clip); with optimizer.skip_synchronize(): "
            "scaler.step(optimizer); scaler.update()")

    step.hooked = True  # torch's profiling wrapper already wraps the base class's step
    # Graph breaks under torch.compile (see hvdlike.frontend.compile_guard).
    step = eager(step)
    synchronize = eager(synchronize)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._hvd_k > 1 and self._hvd_passes and not (self._hvd_handles
                                                         or self._hvd_deferred):
            done = max(self._hvd_passes.values())
            raise RuntimeError(
                f"DistributedOptimizer.zero_grad() was called after {done} of "
                f"backward_passes_per_step={self._hvd_k} backward passes, before step() or "
                f"synchronize(): it would drop the gradients accumulated so far on this rank "
                f"while the next passes count on. Call step() (it reduces what has "
                f"accumulated, on every rank) or synchronize() first")
        if (self._hvd_handles or self._hvd_deferred or self._hvd_passes
                or any(b.pending < b.size for b in self._hvd_buckets)):
            raise RuntimeError(
                "DistributedOptimizer.zero_grad() was called after backward() but before "
                "step() or synchronize(): gradients are still being reduced; call step() "
                "(or synchronize()) first. If step() was skipped on purpose (GradScaler skips "
                "it after inf/NaN gradients), the other ranks still wait for this round: use "
                "optimizer.synchronize(); scaler.unscale_(optimizer); with "
                "optimizer.skip_synchronize(): scaler.step(optimizer)")
        self._hvd_passes = {}
        self._hvd_group_ready = {}
        self._hvd_round_open = False
        self._hvd_synchronized = False  # a new round: its synchronize() submits everything
        for bucket in self._hvd_buckets:
            bucket.release()  # where a plain loop drops its gradients (see buckets.py)
        return super().zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict) -> None:
        """Load the wrapped optimizer's state, abandoning the round in progress
        (as Horovod's does): gradients counted or reductions started since the
        last step are forgotten, so the next backward passes start a new round
        -- what a restore from a checkpoint or an elastic commit needs."""
        self._hvd_abandon_round()
        return super().load_state_dict(state_dict)

    def _hvd_abandon_round(self) -> None:
        self._hvd_handles = {}
        self._hvd_deferred = []
        self._hvd_passes = {}
        self._hvd_group_ready = {}
        self._hvd_resparse = {}
        self._hvd_round_open = False
        self._hvd_synchronized = False
        self._hvd_should_sync = True
        self._hvd_reset_buckets()

    def add_param_group(self, param_group) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_hvd_hooks"):
            self._hvd_register_all()


_CLASSES: Dict[type, type] = {}


class _NamedParametersError(TypeError, ValueError):
    """Malformed ``named_parameters``: a type error, and Horovod's ValueError too."""


def _overlaps_cpu() -> bool:
    """Whether CPU gradients start their reduction during backward (else at synchronize()).

    ``HVDLIKE_CPU_OVERLAP``: 1 always, 0 never; auto (the default) while this
    rank has a core its compute threads leave idle. The reduction runs on
    hvdlike's background thread; with no idle core it can only take turns
    with backward on the same cores, and each hand-over between the two and
    between the ranks costs more than it overlaps (2 ranks of 1 thread on 2
    cores: 8 x Linear(1024) steps 1.20-1.27x compute alone started at step(),
    1.28-1.44x started during backward, same processes alternated).
    """
    try:
        rt = _core_api.runtime()
    except NotInitializedError:  # built before init(): decided again at each synchronize()
        return True
    wanted = rt.config.cpu_overlap
    if wanted is not None:
        return wanted
    mask = _usable_cpus()
    # A rank pinned to fewer CPUs than the host has is assumed to own them;
    # otherwise the host's ranks share every CPU this one may use.
    sharing = 1 if mask < (os.cpu_count() or mask) else rt.topology.local_size
    cpus = mask
    quota = _cpu_quota()
    if quota is not None:  # a container's limit: this many run at once, whatever the mask
        cpus = min(cpus, max(1, int(quota)))
    return sharing * torch.get_num_threads() < cpus


@functools.lru_cache(maxsize=1)
def _cpu_quota() -> Optional[float]:
    """The cgroup's CPU quota (read once: a job does not change its container)."""
    return _shm_segment.cpu_quota()


def _usable_cpus() -> int:
    return len(_shm_segment.affinity())


def _unscaled_by_grad_scaler(optimizer) -> bool:
    """Whether ``optimizer.step()`` is being called by a ``GradScaler.step`` that
    looked at this rank's own gradients first: unscaled them (the scaler's
    per-optimizer stage says so), or -- for an optimizer that unscales in its
    own fused kernel (``_step_supports_amp_scaling``, ``Adam(fused=True)``),
    which ``GradScaler.step`` calls directly -- checked them for inf, deciding
    alone whether this rank skips the update."""
    frame = sys._getframe(2)
    for _ in range(6):  # the scaler's _maybe_opt_step or step, our compile guard, step()
        if frame is None:
            return False
        if frame.f_code.co_name == "_maybe_opt_step":
            state = frame.f_locals.get("optimizer_state")
            stage = state.get("stage") if isinstance(state, dict) else None
            return getattr(stage, "name", None) == "UNSCALED"
        if frame.f_code.co_name == "step" and "optimizer_state" in frame.f_code.co_varnames \
                and _is_grad_scaler(frame.f_locals.get("self")):
            return True
        frame = frame.f_back
    return False


def _is_grad_scaler(obj) -> bool:
    """A torch ``GradScaler`` (``torch.amp``'s, or the device-specific ones of older torch)."""
    return any(cls.__name__ == "GradScaler" for cls in type(obj).__mro__)


def _refuse_late_change(bucket: _buckets.Bucket) -> None:
    """Raise when a gradient the bucket packed during backward changed before step()."""
    name = bucket.changed_since_pack()
    if name is not None:
        raise RuntimeError(
            f"DistributedOptimizer: the gradient of {name!r} was changed after backward() "
            f"(in place, or replaced) while its reduction was already under way -- the change "
            f"would be lost. Gradients reduced during backward (HVDLIKE_CPU_OVERLAP, or a "
            f"GPU) must be changed after the reduction: optimizer.synchronize(); change them "
            f"(scaler.unscale_(optimizer), clip_grad_norm_ ...); then "
            f"with optimizer.skip_synchronize(): optimizer.step()")


# parameter -> (its hook's handle, the owning optimizer, weakly). Keyed by identity
# and weakly (tensors compare elementwise); not an attribute of the parameter,
# which torch.save(model) would try to pickle along with it.
_HOOKS = WeakIdKeyDictionary()


class _Hook:
    """An optimizer's hook on one parameter: its handle, the gradient
    accumulator node it is registered on, and the parameter's placement
    (:func:`_placement`) when it was.

    The optimizer holding this holds the node: between graphs autograd keeps
    a parameter's accumulator only weakly, and a node nobody holds is made
    anew, without the hook, by the next forward pass. A deep copy of the
    optimizer gets no node (nodes cannot be copied; the copy's parameters are
    new tensors anyway).
    """

    __slots__ = ("handle", "node", "placement")

    def __init__(self, handle, node, placement) -> None:
        self.handle = handle
        self.node = node
        self.placement = placement

    def __deepcopy__(self, memo) -> "_Hook":
        return _Hook(copy.deepcopy(self.handle, memo), None, None)


def _grad_accumulator(p: torch.Tensor):
    """``p``'s gradient accumulator: the autograd node that adds each backward
    pass's gradient into ``p.grad`` (made now if no graph holds it)."""
    if not p.is_leaf:
        raise RuntimeError("DistributedOptimizer: a parameter is not a leaf tensor (it has a "
                           "grad_fn); gradients are only accumulated into leaves")
    with torch.enable_grad(), torch.inference_mode(False):
        try:
            out = p.view_as(p)
        except (RuntimeError, NotImplementedError):  # a layout without views (sparse)
            out = p.clone()
        return out.grad_fn.next_functions[0][0]


def _placement(p: torch.Tensor) -> tuple:
    """What a replaced gradient accumulator comes with: another dtype or device,
    or other memory (see ``_Distributed._hvd_rehook``)."""
    try:
        ptr = p.data_ptr()
    except RuntimeError:  # no single data pointer (sparse)
        ptr = None
    return p.dtype, p.device, ptr


def _take_over(p: torch.Tensor, optimizer: _Distributed,
               where: Optional[Tuple[_buckets.Bucket, int]] = None) -> _Hook:
    """Register ``optimizer``'s hook on ``p``, removing an earlier optimizer's.

    The hook is a post hook of ``p``'s gradient accumulator node, not a
    tensor hook (``p.register_post_accumulate_grad_hook``): the node runs
    all of the tensor's post-accumulate-grad hooks before its own post hooks,
    so a user's hook on ``p`` (clipping, scaling) changes the gradient before
    it is counted in and reduced, whether it was registered before or after
    wrapping. The returned :class:`_Hook` holds the node and must be kept
    (the optimizer's ``_hvd_hooks``) for the hook to stay.

    Re-wrapping the same parameters (a new optimizer after a checkpoint load)
    must not leave the old hook reducing ``p.grad`` in place a second time.
    The hook holds the optimizer weakly, so a dropped optimizer goes quiet.
    ``where`` is ``p``'s bucket and slot, if it has one.
    """
    node = _grad_accumulator(p)  # first: it refuses a non-leaf before anything changed
    old = _HOOKS.get(p)
    if old is not None:
        old_handle, old_ref = old
        old_handle.remove()
        previous = old_ref()
        if previous is not None and previous is not optimizer:
            previous._hvd_hooks.pop(id(p), None)
            # Stepping the old one now would step on local, unreduced gradients.
            previous._hvd_lost.setdefault(id(p), previous._hvd_names.get(p, "a parameter"))
    ref = weakref.ref(optimizer)

    # A node's post hook is called with the node's outputs (none) and inputs
    # (the incoming gradient); ``p`` itself comes from the closure.
    if where is None:
        def hook(_outputs, _inputs) -> None:
            owner = ref()
            if owner is not None:
                owner._hvd_hook(p)
    else:
        bucket, slot = where

        def hook(_outputs, _inputs) -> None:
            # Hundreds of these run per step: the common case (one pass per
            # step, first time this round) only counts the member in, and
            # the last member sends the bucket. Anything else takes the full path.
            marked = bucket.marked
            if bucket.direct and not marked[slot]:
                marked[slot] = True
                bucket.pending -= 1
                if bucket.pending:
                    return
                owner = ref()
                if owner is not None:
                    owner._hvd_launch_bucket(bucket)
                return
            owner = ref()
            if owner is not None:
                owner._hvd_hook(p)

    handle = node.register_hook(hook)
    _HOOKS[p] = (handle, ref)
    return _Hook(handle, node, _placement(p))


def _distributed_class(cls: type) -> type:
    """The subclass of ``cls`` with the distributed methods in front (cached per class)."""
    if issubclass(cls, _Distributed):
        raise TypeError("DistributedOptimizer: the optimizer is already distributed")
    new = _CLASSES.get(cls)
    if new is None:
        new = type(cls.__name__, (_Distributed, cls), {"__module__": cls.__module__})
        _CLASSES[cls] = new
    return new


def _check_named_parameters(named_parameters, param_groups) -> Dict[torch.Tensor, str]:
    """Validate ``named_parameters`` against the optimizer; return param -> name."""
    if named_parameters is None:
        return {}
    items = list(named_parameters)
    names: Dict[torch.Tensor, str] = {}
    seen: Dict[str, int] = {}
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise _NamedParametersError(
                "DistributedOptimizer: named_parameters must be (name, parameter) pairs such as "
                f"model.named_parameters(); item {i} is {item!r:.80}")
        name, p = item
        seen[name] = seen.get(name, 0) + 1
        names.setdefault(p, name)
    dups = sorted(n for n, c in seen.items() if c > 1)
    if dups:
        raise ValueError(f"DistributedOptimizer: named_parameters has duplicate names: "
                         f"{', '.join(dups)}; every parameter needs a unique name")
    missing = [(gi, pi) for gi, g in enumerate(param_groups) for pi, p in enumerate(g["params"])
               if p not in names]
    if missing:
        where = ", ".join(f"param_groups[{gi}]['params'][{pi}]" for gi, pi in missing[:5])
        raise ValueError(f"DistributedOptimizer: {len(missing)} optimizer parameter(s) are not "
                         f"in named_parameters ({where}{', ...' if len(missing) > 5 else ''}); "
                         "pass model.named_parameters() of the model the optimizer trains")
    return names


def _group_arguments(num_groups, groups) -> tuple:
    """``(num_groups, groups)`` as the optimizer uses them: Horovod's ``groups=<int>``
    becomes a group count, and ``groups`` wins over the deprecated ``num_groups``."""
    if num_groups:
        warnings.warn("DistributedOptimizer: num_groups is deprecated; pass groups=<int> "
                      "instead", DeprecationWarning, stacklevel=3)
    if groups is None or isinstance(groups, (list, tuple)):
        return (0 if groups is not None else num_groups), groups
    if isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0:
        raise ValueError("DistributedOptimizer: groups must be a positive int or a list of "
                         f"lists of parameters, got {groups!r}")
    return groups, None


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step: int = 1, op=ops.Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups=None, sparse_as_dense: bool = False,
                         process_set=global_process_set, gradient_as_bucket_view: bool = True):
    """Wrap ``optimizer`` so that gradients are averaged across ranks before each step.

    Args:
        optimizer: a ``torch.optim.Optimizer`` (any subclass).
        named_parameters: ``model.named_parameters()``; names identify each
            gradient across ranks. Without it, names come from the position
            in ``param_groups``, which must then match on every rank.
        compression: :class:`Compression` member or a custom compressor,
            applied to dense gradients on the wire.
        backward_passes_per_step: backward passes accumulated locally before
            communicating once (gradients are summed; scale the loss by
            ``1/k`` for the mean over all passes).
        op: ``Average`` (default), ``Sum`` or ``Adasum``. With ``Adasum`` the
            ranks combine the parameter changes of local steps, not gradients
            (Horovod's Adasum optimizer, see adasum_optimizer.py).
        gradient_predivide_factor: with Average, divide by this before the sum
            and by ``size/factor`` after it.
        num_groups: deprecated spelling of ``groups=<int>`` (warns, as Horovod's).
        groups: an int ``n`` -- split the trainable parameters into ``n``
            groups of nearly equal size, each reduced as one grouped allreduce
            once all its gradients are ready -- or an explicit list of
            parameter lists. Given, it wins over ``num_groups``.
        sparse_as_dense: reduce sparse gradients as dense tensors instead of
            gathering their indices and values.
        process_set: reduce among the ranks of this process set only.
        gradient_as_bucket_view: after each reduction, the ``.grad`` of a
            parameter whose gradient travels in a bucket is a view into the
            bucket's buffer, so the reduced values are not copied back and a
            gradient zeroed in place (``zero_grad(set_to_none=False)``) is
            accumulated into the buffer directly. A gradient tensor kept from
            an earlier step is then overwritten by the next one's reduction.
            ``False`` copies reduced values into each parameter's own
            gradient tensor instead.

    Returns:
        An optimizer of the same class as ``optimizer`` (a dynamic subclass)
        that shares its state and parameter groups.

    Raises:
        TypeError: ``optimizer`` is not an optimizer, or bad argument types.
        ValueError: inconsistent ``named_parameters``, groups or factors.

    Example:
        >>> opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
        ...                                named_parameters=model.named_parameters())
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("DistributedOptimizer expects a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if (isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int)
            or backward_passes_per_step < 1):
        raise ValueError("DistributedOptimizer: backward_passes_per_step must be an int >= 1, "
                         f"got {backward_passes_per_step!r}")
    op = ops.ReduceOp(op) if not isinstance(op, ops.ReduceOp) else op
    if op not in (ops.Average, ops.Sum, ops.Adasum):
        raise ValueError(f"DistributedOptimizer: op must be Average, Sum or Adasum, got "
                         f"{op.name.title()}")
    if gradient_predivide_factor != 1.0:
        if op != ops.Average:
            raise ValueError("DistributedOptimizer: gradient_predivide_factor needs op=Average")
        if not gradient_predivide_factor > 0:
            raise ValueError("DistributedOptimizer: gradient_predivide_factor must be > 0, "
                             f"got {gradient_predivide_factor!r}")
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError("DistributedOptimizer: compression needs compress() and decompress() "
                        "(use Compression.none/.fp16/.bf16 or a Compressor subclass)")
    num_groups, groups = _group_arguments(num_groups, groups)
    cls = None
    if op == ops.Adasum:
        # Horovod's Adasum optimizer: Adasum of each rank's local step (adasum_optimizer.py);
        # None with one rank, where the gradient optimizer below does the same.
        from .adasum_optimizer import distributed_adasum_class
        cls = distributed_adasum_class(type(optimizer))
    if cls is None:
        cls = _distributed_class(type(optimizer))
    wrapped = cls.__new__(cls)
    # Share the wrapped optimizer's attributes (state, param_groups, defaults,
    # hooks) rather than re-running its __init__, whose arguments we do not know.
    # Not the instance attributes that stand in for a method: a learning-rate
    # scheduler built first replaces ``optimizer.step`` by a wrapper around the
    # original's bound step, which, copied, would step past the reduction.
    shadowing = {key for key in optimizer.__dict__
                 if callable(getattr(type(optimizer), key, None))}
    wrapped.__dict__.update({key: value for key, value in optimizer.__dict__.items()
                             if key not in shadowing})
    if "step" in shadowing:
        wrapped.__dict__["_hvd_origin"] = optimizer
    wrapped._hvd_setup(named_parameters, compression, backward_passes_per_step, op,
                       gradient_predivide_factor, num_groups, groups, sparse_as_dense,
                       process_set, gradient_as_bucket_view)
    return wrapped
