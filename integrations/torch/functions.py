"""Start every rank from the same model and optimizer state.

Names of the broadcasts come from parameter names and positions in the
optimizer's state, never from values, so every rank submits the same names
whatever it holds; a rank whose model has a different layout gets a clear
mismatch error instead of a hang.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any, Dict, List, Optional, Tuple

import cloudpickle
import torch

from hvdlike.core.process_sets import global_process_set
from hvdlike.frontend.compile_guard import eager
from hvdlike.frontend.objects import allgather_object, broadcast_object  # noqa: F401 (re-exported)

from . import ops


def _named_tensors(params, what: str) -> List[Tuple[str, torch.Tensor]]:
    if isinstance(params, dict):
        items = list(params.items())
    elif isinstance(params, (str, bytes)) or not hasattr(params, "__iter__"):
        raise TypeError(f"{what} expects a state_dict, (name, tensor) pairs such as "
                        f"model.named_parameters() or tensors such as model.parameters(), got "
                        f"{type(params).__name__}")
    else:
        items = list(params)
    out, seen = [], set()
    for i, item in enumerate(items):
        if isinstance(item, torch.Tensor):
            # model.parameters(), as Horovod accepts: named by position
            item = (f"[{i}]", item)
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"{what}: item {i} is neither a tensor nor a (name, tensor) pair: "
                            f"{item!r:.80}")
        name, tensor = item
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what}: {name!r} is a {type(tensor).__name__}, not a tensor")
        key = str(name)
        if key in seen:
            raise ValueError(f"{what}: the name {key!r} appears twice")
        seen.add(key)
        out.append((key, tensor))
    return out


def broadcast_parameters(params, root_rank: int = 0, process_set=global_process_set) -> None:
    """Overwrite ``params`` on every rank with ``root_rank``'s values, in place.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()`` (any
            iterable of ``(name, tensor)``) or ``model.parameters()`` (tensors,
            named by their position); names must match across ranks.
        root_rank: the rank whose values win.
        process_set: broadcast within this process set only.

    Raises:
        TypeError: ``params`` is not a mapping, tensors or pairs of names and tensors.
        ValueError: a name appears twice, ``root_rank`` is not a member of the
            set, or the ranks' names differ (on every rank, naming the
            differences: before any value moves, the ranks compare a digest
            of their names, as DDP compares parameter shapes at construction).

    Example:
        >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    named = _named_tensors(params, "broadcast_parameters")
    ops.core.check_root(root_rank, ops.api.size(), "broadcast_parameters")
    if process_set.included() is not False and root_rank not in process_set.ranks:
        raise ValueError(f"broadcast_parameters: root_rank {root_rank} is not a member "
                         f"of {process_set!r}")
    _agree_on_names([name for name, _ in named], root_rank, process_set)
    handles = []
    for name, tensor in named:
        # detach(): the data plane writes the storage; autograd must not see it.
        handles.append(ops.broadcast_async_(tensor.detach(), root_rank,
                                            name=f"broadcast_parameters.{name}",
                                            process_set=process_set))
    for handle in handles:
        ops.synchronize(handle)


def _agree_on_names(names: List[str], root_rank: int, process_set) -> None:
    """Raise the same ValueError on every rank of ``process_set`` unless all pass
    the same set of ``names``. One small allgather (count and digest of the
    sorted names); the names themselves travel only when they differ."""
    ordered = sorted(names)
    digest = hashlib.blake2b("\0".join(ordered).encode(), digest_size=8).digest()
    mine = torch.tensor([[len(ordered), int.from_bytes(digest, "little", signed=True)]],
                        dtype=torch.int64)
    gathered = ops.allgather(mine, name="broadcast_parameters.names", process_set=process_set)
    if bool((gathered == gathered[0]).all()):
        return
    members = list(process_set.ranks)
    lists = allgather_object(ordered, process_set=process_set)
    root = set(lists[members.index(root_rank)])
    misfits = []
    for rank, theirs in zip(members, lists):
        extra, missing = sorted(set(theirs) - root), sorted(root - set(theirs))
        parts = []
        if extra:
            parts.append(f"has {_some(extra)} that rank {root_rank} lacks")
        if missing:
            parts.append(f"lacks {_some(missing)}")
        if parts:
            misfits.append(f"rank {rank} " + " and ".join(parts))
    raise ValueError("broadcast_parameters: the ranks pass different names (root rank "
                     f"{root_rank}): " + "; ".join(misfits)
                     + "; pass the same model's parameters on every rank")


def _some(names: List[str], most: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:most])
    return shown if len(names) <= most else f"{shown} and {len(names) - most} more"


class _TensorSlot:
    """Stands in for a state tensor in the structure sent with broadcast_object."""

    __slots__ = ("index", "shape", "dtype")

    def __init__(self, index: int, shape, dtype):
        self.index, self.shape, self.dtype = index, tuple(shape), dtype

    def __reduce__(self):
        return (_TensorSlot, (self.index, self.shape, self.dtype))


def _strip(value: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _TensorSlot(len(tensors) - 1, value.shape, value.dtype)
    if isinstance(value, dict):
        return {k: _strip(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_strip(v, tensors) for v in value)
    return value


def _fill(value: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(value, _TensorSlot):
        return tensors[value.index]
    if isinstance(value, dict):
        return {k: _fill(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_fill(v, tensors) for v in value)
    return value


def _initialize_state(optimizer, sparse_params) -> None:
    """Give a fresh optimizer its state, as Horovod does before broadcasting it.

    Every trainable parameter gets a zero gradient (sparse for SparseAdam and
    for the ``model``'s sparse embeddings) and the wrapped optimizer takes one
    step -- never the distributed step, which would reduce. That step must
    not move the parameters: weight decay (``SGD(weight_decay=...)``,
    ``AdamW``) shrinks them even on zero gradients, and on a rank resuming
    next to a root that loaded its state from a checkpoint the parameters
    broadcast just before would no longer match the root's. Their values are
    put back after the step (Horovod leaves them moved).
    """
    kept = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                kept.append((p, p.detach().clone()))
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse_params:
                    p.grad = p.grad.to_sparse()
    from .optimizer import _Distributed

    if isinstance(optimizer, _Distributed):
        _local_step(super(_Distributed, optimizer).step)
    else:
        _local_step(optimizer.step)
    with torch.no_grad():
        for p, value in kept:
            p.copy_(value)


def _local_step(step) -> None:
    """One ``step`` on the zero gradients; a closure when ``step`` demands one (LBFGS)."""
    try:
        closure = inspect.signature(step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read: call it plainly
        closure = None
    if closure is not None and closure.default is inspect.Parameter.empty:
        step(lambda: torch.zeros(()))  # the loss; the gradients are already zero
    else:
        step()


def _sparse_parameters(model) -> set:
    if model is None:
        return set()
    if not isinstance(model, torch.nn.Module):
        raise TypeError("broadcast_optimizer_state: model must be a torch.nn.Module (used to "
                        f"find sparse embeddings), got {type(model).__name__}")
    return {id(p) for m in model.modules()
            if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}


def broadcast_optimizer_state(optimizer, root_rank: int = 0, model=None,
                              process_set=global_process_set) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyper-parameters.

    The root sends its ``state_dict()`` -- structure and Python scalars as one
    object, tensors (momentum buffers, Adam moments, steps) over the data
    plane -- and the others ``load_state_dict`` it. An optimizer without
    state yet (before its first step) is first given one, as in Horovod:
    zero gradients for its trainable parameters and one local step.

    Before any tensor moves, every rank learns every other rank's optimizer
    class and parameter shapes, so optimizers that do not fit the root's, or a
    rank that could not prepare its state, fail the call on every rank alike.

    Args:
        optimizer: a ``torch.optim.Optimizer`` (distributed or not) of the same
            class, with parameter groups of the same sizes and parameter
            shapes, on every rank.
        root_rank: the (global) rank whose state wins.
        model: optional; its sparse ``Embedding`` parameters get sparse zero
            gradients when the state is initialized.
        process_set: broadcast within this process set only.

    Raises:
        TypeError: ``optimizer`` is not an optimizer.
        ValueError: ``root_rank`` is not a member of the set, or some rank's
            optimizer does not fit the root's (on every rank).
        RuntimeError: another rank failed to prepare its state (the rank that
            failed raises its own error).

    Example:
        >>> hvd.broadcast_optimizer_state(opt, root_rank=0)
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("broadcast_optimizer_state expects a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    sparse_params = _sparse_parameters(model)
    ops.core.check_root(root_rank, ops.api.size(), "broadcast_optimizer_state")
    members = list(process_set.ranks)
    if root_rank not in members:
        raise ValueError(f"broadcast_optimizer_state: root_rank {root_rank} is not a member "
                         f"of {process_set!r}")
    me = ops.api.rank()  # root_rank is a global rank, as in Horovod
    tensors: List[torch.Tensor] = []
    skeleton: Optional[bytes] = None
    failure: Optional[BaseException] = None
    try:
        if not optimizer.state_dict()["state"]:
            _initialize_state(optimizer, sparse_params)
        if me == root_rank:
            skeleton = cloudpickle.dumps(_strip(optimizer.state_dict(), tensors))
    except Exception as exc:  # told to every rank below, then raised here
        failure = exc
    # Every rank takes part in this exchange whatever happened above, so a
    # failure or a misfit is known everywhere before any tensor moves.
    reports = allgather_object(
        (_layout(optimizer), skeleton,
         None if failure is None else f"{type(failure).__name__}: {failure}"),
        process_set=process_set)
    failed = [(rank, report[2]) for rank, report in zip(members, reports)
              if report[2] is not None]
    if failure is not None:
        raise failure
    if failed:
        raise RuntimeError("broadcast_optimizer_state failed on " + "; ".join(
            f"rank {rank}: {why}" for rank, why in failed))
    _check_layouts(members, [report[0] for report in reports], root_rank)
    if me == root_rank:
        # State travels on the CPU plane; load_state_dict moves it to each parameter's device.
        handles = [ops.broadcast_async(t.detach().cpu(), root_rank, name=f"optimizer_state.{i}",
                                       process_set=process_set)
                   for i, t in enumerate(tensors)]
        for handle in handles:
            ops.synchronize(handle)
        return
    skeleton = cloudpickle.loads(reports[members.index(root_rank)][1])
    slots: List[_TensorSlot] = []
    _collect_slots(skeleton, slots)
    slots.sort(key=lambda s: s.index)
    received = [torch.empty(s.shape, dtype=s.dtype) for s in slots]
    handles = [ops.broadcast_async_(t, root_rank, name=f"optimizer_state.{i}",
                                    process_set=process_set)
               for i, t in enumerate(received)]
    for handle in handles:
        ops.synchronize(handle)
    state_dict: Dict[str, Any] = _fill(skeleton, received)
    optimizer.load_state_dict(state_dict)


def _layout(optimizer) -> tuple:
    """What must match the root's for its state to fit: class and parameter shapes."""
    cls = type(optimizer)
    return (f"{cls.__module__}.{cls.__qualname__}",
            [[tuple(p.shape) for p in group["params"]] for group in optimizer.param_groups])


def _describe_misfit(mine: tuple, root: tuple, root_rank: int) -> str:
    (cls, groups), (root_cls, root_groups) = mine, root
    if cls != root_cls:
        return f"a {cls}, rank {root_rank}'s is a {root_cls}"
    sizes, root_sizes = [len(g) for g in groups], [len(g) for g in root_groups]
    if sizes != root_sizes:
        return (f"parameter groups of sizes {sizes}, rank {root_rank}'s has "
                f"{root_sizes}")
    for gi, (group, root_group) in enumerate(zip(groups, root_groups)):
        for pi, (shape, root_shape) in enumerate(zip(group, root_group)):
            if shape != root_shape:
                return (f"param_groups[{gi}]['params'][{pi}] of shape {list(shape)}, rank "
                        f"{root_rank}'s is {list(root_shape)}")
    return "a different layout"


def _check_layouts(members: List[int], layouts: List[tuple], root_rank: int) -> None:
    root = layouts[members.index(root_rank)]
    misfits = [f"rank {rank}'s optimizer has {_describe_misfit(layout, root, root_rank)}"
               for rank, layout in zip(members, layouts) if layout != root]
    if misfits:
        raise ValueError("broadcast_optimizer_state: " + "; ".join(misfits)
                         + "; build the same optimizer for the same model on every rank")


def _collect_slots(value: Any, out: List[_TensorSlot]) -> None:
    if isinstance(value, _TensorSlot):
        out.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _collect_slots(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect_slots(v, out)


# Called while torch.compile traces, these run as graph breaks (see
# hvdlike.frontend.compile_guard).
broadcast_parameters = eager(broadcast_parameters)
broadcast_optimizer_state = eager(broadcast_optimizer_state)
