"""What ranks tell each other while negotiating: requests and responses.

A :class:`Request` is what one rank wants to do with one named tensor. The
coordinator turns the requests of all ranks for a name into one
:class:`Response`, which every rank executes in the same order. Both are small,
picklable and free of tensors.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import operator
from typing import Optional, Tuple


class OpType(enum.IntEnum):
    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    ALLTOALL = 3
    REDUCESCATTER = 4
    BARRIER = 5
    JOIN = 6


class ReduceOp(enum.IntEnum):
    """Reduction operators; values match Horovod's so integer constants carry over."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


@dataclasses.dataclass(frozen=True)
class Request:
    """One rank's request for one named collective."""

    name: str
    op: OpType
    dtype: str
    shape: Tuple[int, ...]
    device: str = "cpu"
    reduce_op: ReduceOp = ReduceOp.SUM
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    splits: Optional[Tuple[int, ...]] = None
    group: str = ""
    group_size: int = 0
    # The shapes of the tensors a fused buffer holds ("8x4,8,4x8,4"), for buffers
    # built by a front end (DistributedOptimizer's buckets): two ranks whose
    # buckets hold differently shaped parameters of the same total size differ here.
    layout: str = ""
    # The name was made for this one call (a barrier's, an unnamed object
    # collective's, a process-set change's) and never comes again: its
    # response is executed but not cached (see Response.once).
    once: bool = False
    rank: int = 0

    def signature(self) -> tuple:
        """Everything the response depends on except the submitting rank."""
        # Called for every submitted tensor on the negotiation fast path: a flat
        # attribute tuple, not dataclasses.astuple (which deep-copies, ~20x slower).
        return _signature_fields(self)

    def with_rank(self, rank: int) -> "Request":
        """This request as submitted by ``rank``.

        A shallow copy through ``__dict__``: ``dataclasses.replace`` re-runs the
        frozen ``__init__`` and costs ~10 us, paid for every submitted tensor.
        """
        if rank == self.rank:
            return self
        clone = object.__new__(Request)
        clone.__dict__.update(self.__dict__)
        clone.__dict__["rank"] = rank
        return clone

    def describe(self) -> str:
        parts = [self.op.name.lower(), self.dtype, "x".join(map(str, self.shape)) or "scalar",
                 self.device]
        if self.op in (OpType.ALLREDUCE, OpType.REDUCESCATTER):
            parts.append(self.reduce_op.name.lower())
            if self.prescale != 1.0 or self.postscale != 1.0:
                parts.append(f"prescale={self.prescale:g} postscale={self.postscale:g}")
        if self.op == OpType.BROADCAST:
            parts.append(f"root={self.root}")
        if self.splits is not None:
            parts.append(f"splits={list(self.splits)}")
        if self.group:
            parts.append(f"(member of group {self.group!r} of {self.group_size})")
        if self.layout:
            shown = self.layout if len(self.layout) <= 300 else self.layout[:300] + "..."
            parts.append(f"holding {shown}")
        return " ".join(parts)


_signature_fields = operator.attrgetter(
    *(f.name for f in dataclasses.fields(Request) if f.name != "rank"))
_REQUEST_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Request)
                     if f.default is not dataclasses.MISSING}


def new_request(name: str, op: OpType, dtype: str, shape: Tuple[int, ...], device: str,
                reduce_op: ReduceOp = ReduceOp.SUM, prescale: float = 1.0,
                postscale: float = 1.0, group: str = "", group_size: int = 0,
                **fields) -> Request:
    """``Request(name=name, ..., **fields)`` for the per-tensor submission path.

    Fills ``__dict__`` directly: the generated frozen ``__init__`` sets each of
    the 13 fields through ``object.__setattr__`` and costs about three times as
    much. Nothing is validated here, as nothing is in ``__init__`` either.
    """
    request = _new_object(Request)
    values = request.__dict__
    values.update(_REQUEST_DEFAULTS)
    values["name"] = name
    values["op"] = op
    values["dtype"] = dtype
    values["shape"] = shape
    values["device"] = device
    values["reduce_op"] = reduce_op
    values["prescale"] = prescale
    values["postscale"] = postscale
    values["group"] = group
    values["group_size"] = group_size
    if fields:
        values.update(fields)
    return request


_new_object = object.__new__

# Fusion classes (Response.fusion_terms): key -> number, for the first keys
# seen. Bounded, as scale factors that change every step make new keys.
_FUSION_CLASSES: dict = {}
_FUSION_CLASSES_MAX = 4096
_fusion_numbers = itertools.count()
_ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1,
                  "int16": 2, "int32": 4, "int64": 8, "uint8": 1, "bool": 1}


def _element_size(dtype: str) -> int:
    size = _ELEMENT_BYTES.get(dtype)
    if size is None:  # a dtype beyond the usual ones: ask torch once
        import torch

        size = _ELEMENT_BYTES[dtype] = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return size


@dataclasses.dataclass(frozen=True)
class Response:
    """What every rank executes for one name, identical on all ranks.

    ``first_dims`` holds each rank's first dimension (allgather) and
    ``splits`` each rank's split list (alltoall), so a rank can size its
    output without asking again. ``error`` set means every rank fails the
    handle with that message instead of executing.
    """

    name: str
    op: OpType
    dtype: str
    shape: Tuple[int, ...]
    device: str = "cpu"
    reduce_op: ReduceOp = ReduceOp.SUM
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    first_dims: Optional[Tuple[int, ...]] = None
    splits: Optional[Tuple[Tuple[int, ...], ...]] = None
    group: str = ""
    error: str = ""
    joined: Tuple[int, ...] = ()
    # Every rank asked for a name made for one call (Request.once): no rank
    # caches this response. Decided once, by the coordinator, so the ranks'
    # caches stay identical whatever each rank's request said.
    once: bool = False

    # Cached responses execute every step, so what the executor derives from
    # their (frozen) fields is computed once and kept in the instance dict.

    @functools.cached_property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def fusion_key(self) -> Optional[tuple]:
        """Responses with equal keys may share one fusion buffer; None: never fused."""
        return self._fusion_key

    @functools.cached_property
    def _fusion_key(self) -> Optional[tuple]:
        if self.error or self.op != OpType.ALLREDUCE or self.reduce_op == ReduceOp.ADASUM:
            return None
        return (self.op, self.dtype, self.device, self.reduce_op, self.prescale,
                self.postscale, self.joined)

    @functools.cached_property
    def fusion_terms(self) -> Tuple[Optional[int], int]:
        """``(fusion class, bytes)``: responses of one class may share a fusion
        buffer (None: never fused). A class is a small int standing for
        :meth:`fusion_key` (equal keys, equal classes; the key itself once the
        table of numbers is full), which a planner hashes and compares hundreds
        of times a cycle far faster than the tuple."""
        key = self._fusion_key
        nbytes = self.numel * _element_size(self.dtype)
        if key is None:
            return None, nbytes
        cls = _FUSION_CLASSES.get(key)
        if cls is None:
            if len(_FUSION_CLASSES) < _FUSION_CLASSES_MAX:
                cls = _FUSION_CLASSES.setdefault(key, next(_fusion_numbers))
            else:
                # Full (never emptied): the key stands for itself. Either way equal
                # keys get equal classes and unequal keys unequal ones, whatever
                # came first, so every rank plans the same batches.
                cls = key
        return cls, nbytes


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _known_dtype(dtype) -> bool:
    if dtype in _ELEMENT_BYTES:
        return True
    if not isinstance(dtype, str) or not dtype.isidentifier():
        return False
    import torch

    return isinstance(getattr(torch, dtype, None), torch.dtype)


def malformed(request, sender: int, size: int) -> str:
    """What is wrong with a request set rank ``sender`` sent to the coordinator
    (``""``: nothing).

    A rank builds its requests from its own tensors, so an honest one always
    passes; these checks stop a request no rank could have built (a rank that
    lies, or a message damaged on its way) from being answered with garbage,
    from taking another rank's place, or from waiting for ever. They say
    nothing of the values a rank then sends.
    """
    if not isinstance(request, Request):
        return f"a {type(request).__name__} where a request belongs"
    name = request.__dict__.get("name")
    if not isinstance(name, str):
        return f"a request whose name is {name!r}"
    what = f"request {name!r}"
    fields = request.__dict__
    if fields.get("rank") != sender:
        return f"{what} in the name of rank {fields.get('rank')!r} of the set (it is rank {sender})"
    if not isinstance(fields.get("op"), OpType):
        return f"{what} with operation {fields.get('op')!r}"
    if not isinstance(fields.get("reduce_op"), ReduceOp):
        return f"{what} with reduction op {fields.get('reduce_op')!r}"
    if not _known_dtype(fields.get("dtype")):
        return f"{what} with dtype {fields.get('dtype')!r}"
    if not isinstance(fields.get("device"), str):
        return f"{what} with device {fields.get('device')!r}"
    shape = fields.get("shape")
    if not isinstance(shape, tuple) or not all(_int(d) and d >= 0 for d in shape):
        return f"{what} with shape {shape!r}"
    splits = fields.get("splits")
    if splits is not None:
        if (not isinstance(splits, tuple) or not all(_int(s) and s >= 0 for s in splits)
                or sum(splits) != (shape[0] if shape else 1)):
            return f"{what} with splits {splits!r} for shape {shape!r}"
    root = fields.get("root")
    if not _int(root) or (request.op == OpType.BROADCAST and not 0 <= root < size):
        return f"{what} with root rank {root!r} (the set has {size} ranks)"
    if not all(isinstance(fields.get(f), (int, float)) and not isinstance(fields.get(f), bool)
               for f in ("prescale", "postscale")):
        return f"{what} with scale factors {fields.get('prescale')!r}, {fields.get('postscale')!r}"
    if not isinstance(fields.get("group"), str) or not _int(fields.get("group_size")) \
            or fields.get("group_size") < 0:
        return f"{what} with group {fields.get('group')!r} of {fields.get('group_size')!r}"
    if not isinstance(fields.get("once", False), bool):
        return f"{what} with once={fields.get('once')!r} (a bool belongs there)"
    layout = fields.get("layout", "")
    if not isinstance(layout, str) or len(layout) > MAX_LAYOUT_CHARS:
        return f"{what} with a layout that is not a text of at most {MAX_LAYOUT_CHARS} characters"
    return ""


MAX_LAYOUT_CHARS = 1 << 20
