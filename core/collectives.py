"""Framework-neutral collectives on torch tensors: validate, build entries, submit.

Every front end (torch, numpy, jax, keras) ends up here with torch tensors
(numpy and jax arrays are wrapped without copying where the layout allows).
Checks that need no other rank -- argument types, dtypes, root ranges, split
sums -- happen here, in the caller's thread, so misuse raises at the call
site; checks across ranks happen in the coordinator.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Callable, List, Optional, Sequence

import torch

from .errors import InvalidSplitsError, UnsupportedOpError
from .messages import OpType, ReduceOp, Request, new_request
from .tensor_queue import Entry

REDUCIBLE = {
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
}
# Unsigned integers wider than a byte (torch 2.3 and up; JAX's PRNG keys are uint32):
# moved under their own dtype name, so ranks that disagree on signedness are told
# apart in negotiation; never reduced (see wire.movable for how they travel).
WIDE_UNSIGNED = frozenset(d for d in (getattr(torch, f"uint{bits}", None) for bits in (16, 32, 64))
                          if d is not None)
MOVABLE = REDUCIBLE | {torch.complex64, torch.complex128} | WIDE_UNSIGNED
_REDUCESCATTER_OPS = (ReduceOp.SUM, ReduceOp.AVERAGE)
# Module globals: an enum attribute lookup costs ~50 ns, paid per tensor.
_ALLREDUCE = OpType.ALLREDUCE
_ADASUM = ReduceOp.ADASUM


_DTYPE_NAMES: dict = {}
# name -> (the last allreduce request submitted under it, what it was built
# from). A request is immutable, so a training loop that submits the same name,
# shape and options every step gets the same object back instead of a new one
# per tensor, and the response cache recognises it by identity
# (ResponseCache.lookup_many). Cleared when full: names that change every step
# (automatic names) only churn it.
_ALLREDUCE_REQUESTS: dict = {}
_ALLREDUCE_REQUESTS_MAX = 8192


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def _plain_dispatch(cls: type) -> bool:
    """Whether tensors of ``cls`` hold their own memory (no ``__torch_dispatch__`` of theirs)."""
    known = _PLAIN_CLASSES.get(cls)
    if known is None:
        dispatch = getattr(cls, "__torch_dispatch__", None)
        base = getattr(torch.Tensor, "__torch_dispatch__", None)
        known = _PLAIN_CLASSES[cls] = getattr(dispatch, "__func__", dispatch) is getattr(
            base, "__func__", base)
    return known


_PLAIN_CLASSES: dict = {torch.Tensor: True}
_is_functorch_wrapped = getattr(getattr(torch._C, "_functorch", None),
                                "is_functorch_wrapped_tensor", None)


def kind_problem(tensor: torch.Tensor) -> Optional[str]:
    """Why ``tensor`` is not plain memory the data planes can move, or None.

    Sparse compressed layouts, nested tensors, subclasses that intercept torch
    operations (``DTensor``, ``FakeTensor``, wrapper subclasses) and tensors
    inside ``torch.func`` transforms passed the dtype checks and then failed in
    the data plane -- for every later collective too.
    """
    if tensor.layout is not torch.strided:
        return f"a tensor of layout {tensor.layout} (use a dense, strided tensor: .to_dense())"
    if tensor.is_nested:
        return "a nested tensor (communicate its components, or a padded dense tensor)"
    if not _plain_dispatch(type(tensor)):
        return (f"a {type(tensor).__name__}, a tensor subclass that intercepts torch operations "
                f"(pass the plain tensor it holds: for a DTensor, .full_tensor() or "
                f".to_local())")
    if _is_functorch_wrapped is not None and _is_functorch_wrapped(tensor):
        return ("a tensor inside a torch.func transform (vmap, grad): collectives need "
                "real tensors; call them outside the transform")
    return None


def check_tensor(tensor: Any, what: str, allowed=MOVABLE) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise TypeError(f"{what} expects a dense tensor, got a sparse one "
                        "(use sparse_allreduce_async or sparse_as_dense)")
    problem = kind_problem(tensor)
    if problem is not None:
        raise TypeError(f"{what} cannot communicate {problem}")
    if tensor.dtype not in allowed:
        names = ", ".join(sorted(dtype_name(d) for d in allowed))
        raise TypeError(f"{what} does not support dtype {dtype_name(tensor.dtype)}; "
                        f"supported: {names}")
    return tensor


def check_op(op: Any, what: str, allowed: Sequence[ReduceOp] = tuple(ReduceOp)) -> ReduceOp:
    if type(op) is ReduceOp and op in allowed:  # the usual case, without ReduceOp(op)
        return op
    if isinstance(op, bool):  # ReduceOp(True) would be Sum: Horovod's ``average`` slot?
        raise TypeError(f"{what}: op must be a reduction op (Average, Sum, Min, Max, Product, "
                        f"Adasum), got {op!r}; to choose between averaging and summing "
                        f"pass op=Average or op=Sum")
    try:
        reduce_op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"{what}: unknown reduction op {op!r}") from None
    if reduce_op not in allowed:
        raise UnsupportedOpError(f"{what} does not support op {reduce_op.name.title()}; "
                         f"use one of {', '.join(o.name.title() for o in allowed)}")
    return reduce_op


def check_root(root_rank: Any, size: int, what: str) -> int:
    if type(root_rank) is not int:  # numpy ints and other integer types are fine
        index = None
        if not isinstance(root_rank, bool):
            try:
                index = operator.index(root_rank)
            except TypeError:
                pass
        if index is None:
            raise TypeError(f"{what}: root_rank must be an int, got "
                            f"{type(root_rank).__name__}")
        root_rank = index
    if not 0 <= root_rank < size:
        raise ValueError(f"{what}: root_rank {root_rank} is out of range for {size} rank(s)")
    return root_rank


def _check_factors(prescale: float, postscale: float, what: str,
                   dtype: Optional[torch.dtype] = None) -> None:
    """Scale factors must be finite: a NaN would also never equal the other ranks'.
    A bool reduction (any / all) has nothing to scale: a factor other than 1 is
    refused rather than ignored."""
    for label, value in (("prescale_factor", prescale), ("postscale_factor", postscale)):
        if not math.isfinite(value):
            raise ValueError(f"{what}: {label} must be a finite number, got {value}")
        if dtype == torch.bool and value != 1.0:
            raise ValueError(f"{what}: {label} {value:g} cannot scale a bool tensor (its "
                             f"reductions are 'any' and 'all'); convert it to a number "
                             f"dtype first")


def _request(op: OpType, tensor: torch.Tensor, name: str, **fields) -> Request:
    # tensor.device builds a torch.device object (~0.4 us); is_cpu does not.
    device = "cpu" if tensor.is_cpu else tensor.device.type
    return new_request(name, op, dtype_name(tensor.dtype), tuple(tensor.shape), device,
                       **fields)


def _copy_back(target: torch.Tensor, what: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Writes the result into a non-contiguous ``target`` of an in-place collective.

    A target whose elements share memory (an ``expand``-ed tensor: a stride of 0
    over a dimension longer than 1) cannot take a result; it is refused here,
    before the collective runs, rather than after every rank has run it.
    """
    if any(stride == 0 and n > 1 for stride, n in zip(target.stride(), target.shape)):
        raise ValueError(f"{what}_: the tensor cannot be written in place, several of its "
                         f"elements share memory (an expanded tensor, shape "
                         f"{list(target.shape)}, strides {list(target.stride())}); pass "
                         f"tensor.clone() or use {what}, which returns a new tensor")

    def finish(result: torch.Tensor) -> torch.Tensor:
        target.copy_(result)
        return target
    return finish


def allreduce_entry(tensor, name: str, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                    postscale_factor=1.0, inplace=False, group="", group_size=0,
                    layout: str = "") -> Entry:
    reduce_op = check_op(op, "allreduce")
    if not isinstance(tensor, torch.Tensor) or tensor.is_sparse:
        check_tensor(tensor, "allreduce", REDUCIBLE)  # raises, naming what is wrong
    prescale, postscale = float(prescale_factor), float(postscale_factor)
    # The request is built once per name and reused while everything it says
    # stays the same: the collective submitted by the hundred per step (see
    # _ALLREDUCE_REQUESTS). ``terms`` are the inputs it was built from.
    terms = (tensor.dtype, reduce_op, prescale, postscale, group, group_size,
             True if tensor.is_cpu else tensor.device.type, layout)
    known = _ALLREDUCE_REQUESTS.get(name)
    if known is not None and known[1] == terms and known[0].shape == tensor.shape:
        request = known[0]
    else:
        check_tensor(tensor, "allreduce", REDUCIBLE)
        _check_factors(prescale, postscale, "allreduce", tensor.dtype)
        if reduce_op is _ADASUM and not tensor.is_floating_point():
            raise TypeError(f"allreduce: op Adasum needs a floating-point tensor, got "
                            f"{dtype_name(tensor.dtype)}")
        request = new_request(name, _ALLREDUCE, dtype_name(tensor.dtype), tuple(tensor.shape),
                              "cpu" if tensor.is_cpu else tensor.device.type, reduce_op,
                              prescale, postscale, group, group_size,
                              **({"layout": layout} if layout else {}))
        if len(_ALLREDUCE_REQUESTS) >= _ALLREDUCE_REQUESTS_MAX:
            _ALLREDUCE_REQUESTS.clear()
        _ALLREDUCE_REQUESTS[name] = (request, terms)
    finish = None
    if inplace and tensor.is_contiguous():
        output = tensor
    else:
        output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        if inplace:
            finish = _copy_back(tensor, "allreduce")
    return Entry(request, tensor, output, None, finish)


def allgather_entry(tensor, name: str, group="", group_size=0, once=False) -> Entry:
    """``once``: ``name`` was made for this call alone (see ``Request.once``)."""
    tensor = check_tensor(tensor, "allgather")
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    request = _request(OpType.ALLGATHER, tensor, name, group=group, group_size=group_size,
                       once=once)
    return Entry(request, tensor, None, None)


def broadcast_entry(tensor, root_rank: int, size: int, name: str, inplace=False,
                    once=False) -> Entry:
    """``once``: ``name`` was made for this call alone (see ``Request.once``)."""
    tensor = check_tensor(tensor, "broadcast")
    root = check_root(root_rank, size, "broadcast")
    finish = None
    if inplace and tensor.is_contiguous():
        output = tensor
    else:
        if inplace:
            finish = _copy_back(tensor, "broadcast")
        output = tensor.clone(memory_format=torch.contiguous_format)
    request = _request(OpType.BROADCAST, tensor, name, root=root, once=once)
    return Entry(request, tensor, output, None, finish)


def split_counts(splits, what: str) -> List[int]:
    """``splits`` (a sequence of integers or a 1-D integer tensor) as a list of ints;
    an :class:`InvalidSplitsError` (a TypeError and a ValueError) naming what is
    wrong otherwise -- never a truncated float."""
    bad = InvalidSplitsError
    if isinstance(splits, torch.Tensor):
        dtype = str(splits.dtype).replace("torch.", "")
        if splits.is_floating_point() or splits.is_complex() or splits.dtype == torch.bool:
            raise bad(f"{what}: splits must be integers, got a {dtype} tensor")
        if splits.dim() > 1:
            raise bad(f"{what}: splits must be a 1-D integer tensor or a list of ints, "
                      f"got a {splits.dim()}-D {dtype} tensor")
        return [int(s) for s in splits.reshape(-1).tolist()]
    if isinstance(splits, (str, bytes)) or not hasattr(splits, "__iter__"):
        raise bad(f"{what}: splits must be a list of ints or a 1-D integer tensor, got "
                  f"{type(splits).__name__} {splits!r:.60}")
    out = []
    for i, s in enumerate(splits):
        if isinstance(s, bool) or not isinstance(s, numbers.Integral):
            raise bad(f"{what}: splits must be integers; splits[{i}] is "
                      f"{type(s).__name__} {s!r:.40}")
        out.append(int(s))
    return out


def alltoall_entry(tensor, splits, size: int, name: str) -> Entry:
    tensor = check_tensor(tensor, "alltoall")
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    first = tensor.shape[0]
    if splits is None:
        if first % size:
            raise ValueError(f"alltoall: first dimension {first} does not divide evenly "
                             f"across {size} ranks; pass splits")
        split_list = [first // size] * size
    else:
        split_list = split_counts(splits, "alltoall")
        if len(split_list) != size:
            raise ValueError(f"alltoall: splits has {len(split_list)} entries, expected one "
                             f"per rank ({size})")
        if any(s < 0 for s in split_list):
            raise ValueError(f"alltoall: splits must be non-negative, got {split_list}")
        if sum(split_list) != first:
            raise ValueError(f"alltoall: splits {split_list} add up to {sum(split_list)}, "
                             f"but the tensor's first dimension is {first}")
    request = _request(OpType.ALLTOALL, tensor, name, splits=tuple(split_list))
    return Entry(request, tensor, None, None)


def reducescatter_entry(tensor, name: str, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                        postscale_factor=1.0, group="", group_size=0) -> Entry:
    tensor = check_tensor(tensor, "reducescatter", REDUCIBLE)
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    reduce_op = check_op(op, "reducescatter", _REDUCESCATTER_OPS)
    prescale, postscale = float(prescale_factor), float(postscale_factor)
    _check_factors(prescale, postscale, "reducescatter", tensor.dtype)
    request = _request(OpType.REDUCESCATTER, tensor, name, reduce_op=reduce_op,
                       prescale=prescale, postscale=postscale,
                       group=group, group_size=group_size)
    return Entry(request, tensor, None, None)


def barrier_entry(name: str) -> Entry:
    """A barrier's entry. Every barrier's name is made for its call (an automatic
    name, a process-set change's), so it is never cached (``Request.once``)."""
    request = Request(name=name, op=OpType.BARRIER, dtype="uint8", shape=(), once=True)
    return Entry(request, None, None, None)


def join_entry(name: str = "join", device: str = "cpu") -> Entry:
    request = Request(name=name, op=OpType.JOIN, dtype="uint8", shape=(), device=device)
    return Entry(request, None, None, None)


def grouped(make: Callable[..., Entry], tensors: Sequence[Any], name: str, what: str,
            **kwargs) -> List[Entry]:
    """Entries for a grouped collective: negotiated and executed as one unit."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{what} expects a list of tensors, got {type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"{what} needs at least one tensor")
    n = len(tensors)
    return [make(t, f"{name}.{i}", group=name, group_size=n, **kwargs)
            for i, t in enumerate(tensors)]

