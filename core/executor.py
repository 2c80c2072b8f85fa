"""Execution of negotiated responses on the data plane.

The background thread calls :meth:`Executor.execute` with the cycle's ordered
responses. Fusable allreduces are packed into pooled flat buffers
(:mod:`fusion`); every batch is launched asynchronously on the data-plane
group for its device, and a :class:`Finisher` thread waits for completions in
launch order, copies results out and completes handles. The background thread
therefore never waits on tensor traffic and can negotiate the next cycle
while data is in flight.

Gloo cannot reduce every dtype torch has: reductions on int16 run in int32
and on bool in uint8; pure data movement (broadcast, allgather, alltoall)
reinterprets the bytes of such tensors as a dtype of the same width.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import fusion, nan_order
from .adasum import AdasumRunner
from .errors import HvdlikeInternalError, MismatchError
from .memo import BoundedMemo
from .messages import OpType, ReduceOp, Response
from .tensor_queue import Entry
from .wire import movable, scale, torch_dtype, wire_dtype

Work = Tuple[Response, Optional[Entry]]
Complete = Callable[[Entry, Any, Optional[BaseException]], None]


@dataclasses.dataclass(frozen=True)
class CompletionHooks:
    """How the executor hands results back to the runtime that owns it.

    Attributes:
        complete: ``complete(entry, result, error)`` for one entry.
        complete_many: success for a batch of entries at once (one queue
            release and one handle lock for the whole batch).
        explain: turns a transport failure into the job's fatal error.
    """

    complete: Complete
    complete_many: Callable[[List[Entry], List[Any]], None]
    explain: Callable[[BaseException], BaseException]

_REDUCE = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVERAGE: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}
# Floating min/max off the shared-memory plane reduce an integer image (see
# _allreduce_work); a module global: an enum attribute lookup costs ~50 ns.
_MIN_MAX = (ReduceOp.MIN, ReduceOp.MAX)
# For booleans, sum/average mean "any", product means "all".
_BOOL_REDUCE = {
    ReduceOp.SUM: dist.ReduceOp.MAX,
    ReduceOp.AVERAGE: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.MIN,
}


class _Voted:
    """The work of an allreduce already reduced from the vote's data (see offer())."""

    inline = True
    engine = "SHM"

    @staticmethod
    def wait(timeout=None) -> bool:
        return True


_VOTED = _Voted()
# Copies a list of tensors in one call (None on builds without it).
_foreach_copy = getattr(torch, "_foreach_copy_", None)
# Splits a flat tensor straight into a list of outputs (None on builds without it).
_split_copy = getattr(torch, "split_with_sizes_copy", None)
# Fused batches of at least this many tensors keep their buffer's views between
# steps (Executor._split_views): with 500 tensors of 4 KiB a copy from kept
# views took 0.22 ms against 0.32 ms for split_with_sizes_copy.
_VIEWS_MIN_TENSORS = 16
class Finisher:
    """Waits for launched collectives in order and runs their completion."""

    def __init__(self, explain: Callable[[BaseException], BaseException]):
        self._queue: "queue.Queue" = queue.Queue()
        self._explain = explain
        self._thread = threading.Thread(target=self._loop, name="hvdlike-finisher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, work, finalize: Callable[[], None], fail: Callable[[BaseException], None]):
        self._queue.put((work, finalize, fail))

    def _loop(self) -> None:
        torch.set_grad_enabled(False)  # this thread's own mode: it records no graph
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, finalize, fail = item
            try:
                if work is not None:
                    work.wait()
                finalize()
            except BaseException as exc:  # a dead peer or timeout surfaces here
                fail(self._explain(exc))

    def close(self, timeout: float = 5.0) -> None:
        """Finish what was submitted, then stop (a no-op if never started or closed)."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join(timeout)


class Executor:
    """Runs responses on the data plane of one process set.

    Args:
        groups: the set's :class:`~hvdlike.core.transport.Groups`.
        rank, size: this rank's place in the set.
        settings: the runtime's live settings (the fusion threshold, which the
            autotuner may change between cycles).
        hooks: where results go (:class:`CompletionHooks`).
        recording: the runtime's timeline slot (``recording.timeline`` is a
            Timeline while one records, else None).
    """

    def __init__(self, groups, rank: int, size: int, settings, hooks: CompletionHooks,
                 recording, host: str = "", adasum_hierarchical: Optional[bool] = None,
                 ranks: Optional[Sequence[int]] = None):
        self.groups = groups
        self.rank = rank
        self.size = size
        self.ranks = list(ranks) if ranks is not None else list(range(size))  # global, to name
        self.settings = settings
        self.complete = hooks.complete
        self.complete_many = hooks.complete_many
        self.explain = hooks.explain
        self.recording = recording
        self.pool = fusion.BufferPool()
        self._options: Dict[tuple, Any] = {}
        self._offers = BoundedMemo(256)  # id(response) -> offer() terms (see there)
        self._views = BoundedMemo(8)  # id(buffer) -> (buffer, sizes, views), see _split_views
        self._views.generation = -1
        self.finisher = Finisher(hooks.explain)
        # Its group is made on first use; host: this member's host key.
        self.adasum = AdasumRunner(groups, rank, size, host, adasum_hierarchical)
        self.launched = 0
        self._batch_started = 0.0
        self._last_plan: tuple = ([], -1, [])  # (responses, threshold, batches) of the last cycle

    @property
    def fusion_threshold(self) -> int:
        return self.settings.fusion_threshold

    def start(self) -> None:
        self.finisher.start()

    def close(self, timeout: float = 5.0) -> None:
        self.finisher.close(timeout)
        self.pool.clear()
        self._views.clear()

    def execute(self, work: Sequence[Work]) -> None:
        # Collectives write into tensors that may require grad (allreduce_ of a
        # parameter, as Horovod allows): no graph is recorded for them, on any thread.
        with torch.no_grad():
            self._execute(work)

    def _execute(self, work: Sequence[Work]) -> None:
        runnable = []
        for response, entry in work:
            if response.error:
                if entry is not None:
                    self.complete(entry, None, MismatchError(response.error))
            else:
                runnable.append((response, entry))
        responses = [r for r, _ in runnable]
        for batch in self._plan(responses):
            items = [runnable[i] for i in batch]
            if self.recording.timeline is not None:
                self._batch_started = time.monotonic()
            try:
                self._launch(items)
            except BaseException as exc:
                error = HvdlikeInternalError(f"could not start collective: {exc}")
                for _, entry in items:
                    if entry is not None:
                        self.complete(entry, None, error)
                if not isinstance(exc, Exception):
                    raise  # an interrupt or sys.exit() stays what it is (Runtime._interrupted)
                raise error from exc

    # -- helpers ---------------------------------------------------------------

    def _plan(self, responses: List[Response]) -> List[List[int]]:
        """:func:`fusion.plan`, reused while a cycle repeats the previous one.

        Training executes the same cached responses (the same objects) in the
        same order every step; comparing the lists costs one identity check
        per response, planning again about a microsecond.
        """
        if not responses:  # an idle cycle: keep the memo for the next busy one
            return []
        last, threshold, batches = self._last_plan
        current = self.settings.fusion_threshold
        if threshold == current and responses == last:
            return batches
        batches = fusion.plan(responses, current, self.settings.separate_groups, self._alone())
        self._last_plan = (responses, current, batches)
        return batches

    def _alone(self) -> Optional[Dict[str, int]]:
        """Per device, the tensor size from which fusing costs more than it saves.

        On the shared-memory and MPI planes a large allreduce costs little more
        alone than its share of a fused one, while fusing copies it into the
        buffer and out again: 8 x 4 MiB took 20 ms fused, 8.5 ms one by one
        (``ShmDataGroup.alone_bytes``, ``MpiDataGroup.alone_bytes``).
        """
        plane = self.groups.cpu_plane
        nbytes = getattr(plane, "alone_bytes", 0) if plane is not None else 0
        return {"cpu": nbytes} if nbytes else None

    def _submit(self, work, items: List[Work], finalize: Callable[[], List[Any]],
                release: Optional[torch.Tensor] = None) -> None:
        def done():
            results = finalize()
            if release is not None:
                self.pool.give(release)
            done_entries = [entry for _, entry in items if entry is not None]
            if len(done_entries) != len(items):  # a joined rank's stand-ins
                results = [r for (_, e), r in zip(items, results) if e is not None]
            self.complete_many(done_entries, results)

        def fail(error: BaseException):
            for _, entry in items:
                if entry is not None:
                    self.complete(entry, None, error)

        timeline = self.recording.timeline
        if timeline is not None:
            done = timeline.wrap(items, self._batch_started, done, getattr(work, "engine", ""),
                                 getattr(work, "phases", None))
        self.launched += 1
        if getattr(work, "inline", False):
            # A blocking engine (MPI, see mpi_plane.py) runs on this thread, in
            # launch order, as Horovod's background thread does: no hand-off to
            # the finisher, and one thread issues every call on the communicator.
            try:
                work.wait()
                done()
            except BaseException as exc:
                fail(self.explain(exc))
                if not isinstance(exc, Exception):
                    raise  # an interrupt or sys.exit() on this thread ends its cycle
            return
        self.finisher.submit(work, done, fail)

    def _group(self, response: Response):
        return self.groups.data(response.device.split(":")[0])

    def _device(self, response: Response, entry: Optional[Entry]) -> torch.device:
        if entry is not None:
            return entry.tensor.device
        return torch.device(response.device)

    def _launch(self, items: List[Work]) -> None:
        op = items[0][0].op
        if op == OpType.ALLREDUCE and items[0][0].reduce_op == ReduceOp.ADASUM:
            # Never fused: one response per batch; the exchanges run on the finisher.
            self._submit(None, items, self.adasum.finalizer(items))
        elif op == OpType.ALLREDUCE:
            if len(items) == 1 and items[0][1] is not None:
                self._allreduce_one(items)
            else:
                self._allreduce_fused(items)
        elif op == OpType.ALLGATHER:
            self._allgather(items)
        elif op == OpType.BROADCAST:
            self._broadcast(items)
        elif op == OpType.ALLTOALL:
            self._alltoall(items)
        elif op == OpType.REDUCESCATTER:
            self._reducescatter(items)
        elif op == OpType.BARRIER:
            self._submit(self._group(items[0][0]).barrier(), items, lambda: [None])
        elif op == OpType.JOIN:
            self._submit(None, items, lambda: [items[0][0].root])
        else:  # pragma: no cover - the coordinator only emits known ops
            raise HvdlikeInternalError(f"unknown operation {op!r}")

    @staticmethod
    def _op_key(response: Response, dtype: torch.dtype) -> tuple:
        """What names a reduction: (logical, op). Equal keys, equal reduce options."""
        return (dtype == torch.bool, response.reduce_op)

    def _reduce_options(self, response: Response, dtype: torch.dtype):
        # One options object per _op_key, reused: building one costs
        # microseconds, paid by every small allreduce. Nothing changes them.
        key = self._op_key(response, dtype)
        opts = self._options.get(key)
        if opts is None:
            opts = dist.AllreduceOptions()
            opts.reduceOp = (_BOOL_REDUCE if key[0] else _REDUCE)[response.reduce_op]
            self._options[key] = opts
        return opts

    def _pre_factor(self, response: Response) -> float:
        return 1.0 if response.dtype == "bool" else response.prescale

    def _post_scale(self, tensor: torch.Tensor, response: Response) -> None:
        if response.dtype == "bool":
            return  # logical reductions: nothing to scale
        divisor = self.size if response.reduce_op == ReduceOp.AVERAGE else 1
        scale(tensor, response.postscale, divisor)

    def _allreduce_work(self, buf: torch.Tensor, response: Response, dtype: torch.dtype):
        """Start the allreduce of ``buf``; a plane that can scales the result itself.

        The shared-memory plane divides an average (or applies a postscale) on
        the portion each member reduces, before the others read it: one pass
        over 1/n of the data instead of every member's pass over all of it.

        It reduces min and max with torch's NaN rule; on every other plane
        (Gloo, MPI, NCCL, the hierarchical one) a floating min or max reduces
        the integer image of :mod:`.nan_order`, which keeps that rule, and the
        work's ``wait()`` maps it back into ``buf``.
        """
        group = self._group(response)
        opts = self._reduce_options(response, dtype)
        if getattr(group, "scales", False):
            return group.allreduce([buf], opts, post=lambda t: self._post_scale(t, response),
                                   key=self._op_key(response, dtype))
        if response.reduce_op in _MIN_MAX and nan_order.orders(buf.dtype):
            return nan_order.allreduce(group, buf, opts, response.reduce_op is ReduceOp.MAX,
                                      self.pool)
        return group.allreduce([buf], opts)

    # -- allreduce -------------------------------------------------------------

    def offer(self, response: Response, entry: Optional[Entry], capacity: int):
        """What the fast cycle's vote can carry of this allreduce, or None.

        A small dense CPU allreduce on a shared-memory plane sends its
        (prescaled) input along with the vote that agrees to run it; when
        every member did, each reduces it straight from there in member order
        -- the same operations on the same values as the plane's own small
        allreduce, so the same result -- and the exchange of its own is saved.
        Returns ``(dtype, count, write)``; ``write(view)`` fills this member's
        part of the vote. Not with a timeline (it records the plane's phases).
        """
        if entry is None or self.recording.timeline is not None:
            return None
        # What the response alone decides, kept per (cached, reused) response.
        memo = self._offers.get(id(response))
        if memo is None or memo[0] is not response:
            memo = self._offer_terms(response, capacity)
        _, dtype, count, factor = memo
        tensor = entry.tensor
        if dtype is None or not tensor.is_cpu or not tensor.is_contiguous():
            return None
        flat = tensor if tensor.dim() == 1 else tensor.reshape(-1)

        def write(view: torch.Tensor) -> None:
            view.copy_(flat)
            scale(view, factor)

        return dtype, count, write

    def _offer_terms(self, response: Response, capacity: int) -> tuple:
        """``(response, dtype, count, prescale)`` for :meth:`offer`; dtype None:
        this response never rides on the vote."""
        dtype = torch_dtype(response.dtype)
        count = response.numel
        terms = (response, None, 0, 1.0)
        if (response.op is OpType.ALLREDUCE and response.reduce_op is not ReduceOp.ADASUM
                and not response.group and not response.joined and count
                and dtype != torch.bool and wire_dtype(dtype) == dtype
                and count * torch.empty(0, dtype=dtype).element_size() <= capacity):
            can_reduce = getattr(self._group(response), "can_reduce", None)  # shared memory
            if can_reduce is not None and can_reduce(self._reduce_options(response, dtype),
                                                     self._op_key(response, dtype)):
                terms = (response, dtype, count, self._pre_factor(response))
        return self._offers.add(id(response), terms)

    def allreduce_voted(self, item: Work, parts) -> None:
        """Finish allreduce ``item`` from ``parts``, every member's input sent with
        the vote (see :meth:`offer`), before the set's next control exchange."""
        response, entry = item
        try:
            dtype = torch_dtype(response.dtype)
            out = entry.output
            flat = out if out.dim() == 1 else out.view(-1)
            with torch.no_grad():  # see execute()
                self._group(response).reduce_parts(parts, flat,
                                                   self._reduce_options(response, dtype),
                                                   self._op_key(response, dtype))
                self._post_scale(flat, response)
        except BaseException as exc:
            error = HvdlikeInternalError(f"could not complete collective: {exc}")
            self.complete(entry, None, error)
            if not isinstance(exc, Exception):
                raise  # an interrupt or sys.exit() stays what it is
            raise error from exc
        if self.recording.timeline is not None:
            self._submit(_VOTED, [item], lambda: [out])
            return
        # Already done: no work to hand on, one completion.
        self.launched += 1
        self.complete(entry, out, None)

    def _allreduce_one(self, items: List[Work]) -> None:
        response, entry = items[0]
        dtype = torch_dtype(response.dtype)
        out = entry.output
        wire = wire_dtype(dtype)
        if wire != dtype:
            buf = entry.tensor.to(wire).contiguous()
        else:
            if out.data_ptr() != entry.tensor.data_ptr():
                out.copy_(entry.tensor)
            buf = out
        scale(buf, self._pre_factor(response))
        work = self._allreduce_work(buf, response, dtype)

        def finalize():
            if not getattr(work, "scaled", False):
                self._post_scale(buf, response)
            if buf is not out:
                out.copy_(buf)
            return [out]

        self._submit(work, items, finalize)

    def _allreduce_fused(self, items: List[Work]) -> None:
        response = items[0][0]
        dtype = torch_dtype(response.dtype)
        wire = wire_dtype(dtype)
        device = self._device(response, next((e for _, e in items if e is not None), None))
        sizes = [r.numel for r, _ in items]
        total = sum(sizes)
        whole = self.pool.take(total, wire, device)
        flat = whole[:total]
        # One torch call per batch, not per tensor: every small op releases and
        # retakes the GIL, which the training thread is contending for.
        batched = wire == dtype and _foreach_copy is not None
        if batched:
            # 1-D tensors go in as they are: a reshape is a torch call (~1 us) each.
            torch.cat([flat.new_zeros(n) if e is None else
                       e.tensor if e.tensor.dim() == 1 else e.tensor.reshape(-1)
                       for (_, e), n in zip(items, sizes)], out=flat)
        else:
            offset = 0
            for (r, entry), n in zip(items, sizes):
                part = flat[offset:offset + n]
                if entry is None:
                    part.zero_()
                else:
                    part.view(entry.tensor.shape).copy_(entry.tensor)
                offset += n
        scale(flat, self._pre_factor(response))
        work = self._allreduce_work(flat, response, dtype)

        def finalize():
            if not getattr(work, "scaled", False):
                self._post_scale(flat, response)
            if batched and all(e is not None for _, e in items):
                # Into every output in one call, from views of the buffer kept
                # while the batch repeats (as training's do): making hundreds of
                # views per step is most of what a split costs.
                outs = [e.output if e.output.dim() == 1 else e.output.view(-1)
                        for _, e in items]
                views = self._split_views(whole, sizes)
                if views is not None:
                    _foreach_copy(outs, views)
                elif _split_copy is not None:
                    _split_copy(flat, sizes, out=outs)
                else:
                    _foreach_copy(outs, list(flat.split(sizes)))
                return [e.output for _, e in items]
            parts = flat.split(sizes)
            if batched:
                pairs = [(e.output, part) for (_, e), part in zip(items, parts)
                         if e is not None]
                if pairs:
                    _foreach_copy([o if o.dim() == 1 else o.view(-1) for o, _ in pairs],
                                  [p for _, p in pairs])
            else:
                for (_, entry), part in zip(items, parts):
                    if entry is not None:
                        entry.output.view(-1).copy_(part)
            return [entry.output if entry is not None else None for _, entry in items]

        self._submit(work, items, finalize, release=whole)

    def _split_views(self, whole: torch.Tensor, sizes: List[int]) -> Optional[List[torch.Tensor]]:
        """Views of pooled buffer ``whole`` in ``sizes``, or None where not worth keeping.

        Kept per buffer while the pool is unchanged (``BufferPool.generation``):
        a buffer the pool let go of is not kept alive here beyond the next call.
        Only for batches of many tensors, where rebuilding the views costs
        tenths of a millisecond per step.
        """
        if len(sizes) < _VIEWS_MIN_TENSORS:
            return None
        memo = self._views
        if memo.generation != self.pool.generation:
            memo.clear()
            memo.generation = self.pool.generation
        kept = memo.get(id(whole))
        if kept is not None and kept[0] is whole and kept[1] == sizes:
            return kept[2]
        views = list(whole[:sum(sizes)].split(sizes))
        memo.add(id(whole), (whole, sizes, views))
        return views

    # -- data movement -----------------------------------------------------------

    def _allgather(self, items: List[Work]) -> None:
        response, entry = items[0]
        dims = response.first_dims
        longest = max(dims) if dims else 0
        rest = tuple(response.shape[1:])
        dtype = torch_dtype(response.dtype)
        device = self._device(response, entry)
        try:
            local = torch.zeros((longest,) + rest, dtype=dtype, device=device)
            gathered = torch.empty((longest * self.size,) + rest, dtype=dtype, device=device)
        except (RuntimeError, MemoryError) as exc:
            # The sizes are what the members' requests claimed; name the largest claim.
            most = max(range(self.size), key=lambda r: dims[r])
            raise HvdlikeInternalError(
                f"allgather {response.name!r}: no room here for {self.size} x {longest:,} "
                f"rows of shape {list(rest)} ({dtype}); rank {self.ranks[most]} asked to "
                f"send the most, {dims[most]:,} rows ({exc})") from exc
        if entry is not None and entry.tensor.numel():
            local[: entry.tensor.shape[0]].copy_(entry.tensor)
        chunks = [movable(c) for c in gathered.chunk(self.size)] if longest else []
        if longest:
            work = self._group(response).allgather([chunks], [movable(local)])
        else:
            work = None

        def finalize():
            if all(d == longest for d in dims):
                return [gathered]
            parts = [gathered[r * longest: r * longest + d] for r, d in enumerate(dims)]
            return [torch.cat(parts)]

        self._submit(work, items, finalize)

    def _broadcast(self, items: List[Work]) -> None:
        response, entry = items[0]
        if entry is None:
            out = torch.empty(response.shape, dtype=torch_dtype(response.dtype),
                              device=response.device)
        else:
            out = entry.output
            if self.rank == response.root and out.data_ptr() != entry.tensor.data_ptr():
                out.copy_(entry.tensor)
        opts = dist.BroadcastOptions()
        opts.rootRank = response.root
        work = self._group(response).broadcast([movable(out)], opts) if out.numel() else None
        self._submit(work, items, lambda: [out])

    def _alltoall(self, items: List[Work]) -> None:
        response, entry = items[0]
        send = list(response.splits[self.rank])
        recv = [response.splits[r][self.rank] for r in range(self.size)]
        rest = tuple(response.shape[1:])
        dtype = torch_dtype(response.dtype)
        device = self._device(response, entry)
        if entry is None:
            source = torch.zeros((sum(send),) + rest, dtype=dtype, device=device)
        else:
            source = entry.tensor.contiguous()
        out = torch.empty((sum(recv),) + rest, dtype=dtype, device=device)
        if any(any(row) for row in response.splits):  # every member calls, as it must
            work = self._group(response).alltoall_base(movable(out), movable(source), recv, send)
        else:
            work = None
        received = torch.tensor(recv, dtype=torch.int32)
        self._submit(work, items, lambda: [(out, received)])

    def _reducescatter(self, items: List[Work]) -> None:
        response, entry = items[0]
        dtype = torch_dtype(response.dtype)
        wire = wire_dtype(dtype)
        device = self._device(response, entry)
        if entry is None:
            buf = torch.zeros(response.shape, dtype=wire, device=device)
        else:
            buf = entry.tensor.to(wire, copy=True).contiguous()
        scale(buf, self._pre_factor(response))
        first = response.shape[0] if response.shape else 1
        base, extra = divmod(first, self.size)
        start = self.rank * base + min(self.rank, extra)
        count = base + (1 if self.rank < extra else 0)
        work = (self._group(response).allreduce([buf], self._reduce_options(response, dtype))
                if buf.numel() else None)

        def finalize():
            mine = buf[start:start + count]
            self._post_scale(mine, response)
            return [mine.to(dtype).clone() if mine.dtype != dtype else mine.clone()]

        self._submit(work, items, finalize)
