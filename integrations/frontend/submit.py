"""Submitting entries and waiting for them, the same way for every front end.

Results are converted to the front end's array type by each entry's
``finish`` hook, on the runtime's completion thread, so a handle already holds
the final value: :func:`synchronize` and :func:`poll` need not know which
front end created it, and one front end's ``synchronize`` accepts another's
handles.
"""

from __future__ import annotations

from typing import Any, List, Optional

from hvdlike.core import api, current
from hvdlike.core import collectives as core
from hvdlike.core.errors import DuplicateNameError, HvdlikeInternalError
from hvdlike.core.handles import Handle
from hvdlike.core.process_sets import global_process_set, resolve

from .compile_guard import eager, is_compiling, outside


class GroupHandle:
    """Handle of a grouped collective: completes when every member has."""

    def __init__(self, handles: List[Handle]):
        self.handles = handles

    def __repr__(self) -> str:
        return f"<hvdlike GroupHandle of {len(self.handles)}>"

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def result(self, results: List[Any]) -> Any:
        """What :func:`synchronize` returns, given each member's result."""
        return results


def poll(handle) -> bool:
    """True when the collective behind ``handle`` has completed (never blocks)."""
    if isinstance(handle, (Handle, GroupHandle)):
        return handle.done()
    raise TypeError(f"poll expects a handle returned by an *_async call, "
                    f"got {type(handle).__name__}")


def wait(handle: Handle, timeout: Optional[float] = None):
    """Wait for one handle; after ``shutdown()`` only already-completed handles return."""
    runtime = current.get()
    if runtime is not None:
        return runtime.wait(handle, timeout)
    # shutdown() completed every pending handle with HvdlikeInternalError (Horovod's
    # HorovodInternalError), which waiting raises here; a handle it did not know
    # cannot complete any more.
    if not handle.done():
        raise HvdlikeInternalError(f"collective {handle.name!r} cannot complete: hvdlike has "
                                   f"been shut down")
    return handle.wait(timeout=timeout)


def synchronize(handle, timeout: Optional[float] = None):
    """Wait for ``handle`` and return its result (a list for grouped handles).

    Raises the collective's error on this rank: ``MismatchError`` when ranks
    disagreed, ``HvdlikeInternalError`` when the job broke, ``TimeoutError``
    after ``timeout`` seconds.
    """
    if type(handle) is Handle and handle._done:
        # Already complete: no runtime, no blocking, no further calls (after one
        # synchronize that ran the cycle, the rest of a step's handles land here).
        if handle._error is None:
            return handle._result
        raise handle._error
    if is_compiling():  # a graph break: the wait runs cycles on this thread
        return _synchronize_outside(handle, timeout)
    if isinstance(handle, GroupHandle):
        return handle.result([wait(h, timeout) for h in handle.handles])
    if isinstance(handle, Handle):
        return wait(handle, timeout)
    raise TypeError(
        f"synchronize expects a handle returned by an *_async call, got {type(handle).__name__}")


_synchronize_outside = outside(synchronize)


class OpName(str):
    """A collective's name as negotiated: given its kind already (see :func:`name_for`)."""

    __slots__ = ()


def name_for(name: Optional[str], op: str, process_set=global_process_set,
             kind: bool = True) -> str:
    """The name ``op`` negotiates for a caller's ``name``, as Horovod forms it.

    A given name is prefixed with the collective's kind (``allreduce.loss``,
    ``allgather.loss``), so one name may serve collectives of different kinds
    in flight together; no name gives the next automatic one for ``op``
    (``allreduce.noname.3``), counted per process set so the members of a set
    agree on it whatever ranks outside the set do. What this returns is final:
    passed again (a call staged by ``jax.jit`` runs later with the name its
    trace chose) it comes back unchanged. ``kind=False`` is for a composite
    call (a pytree's broadcast) whose parts add their own kind to it.
    """
    if type(name) is OpName:
        return name
    if name is None or name == "":  # Horovod names an empty name automatically too
        return OpName(api.runtime().auto_name(op, resolve(process_set)))
    if not isinstance(name, str):
        raise TypeError(f"{op}: name must be a str, got {type(name).__name__}")
    return OpName(f"{op}.{name}") if kind else name


def set_size(process_set) -> int:
    """Number of ranks in ``process_set`` (this rank must be a member)."""
    return api.runtime().process_set(resolve(process_set)).size


def submit(entries, process_set, frontend: str) -> List[Handle]:
    """Hand ``entries`` to the runtime on behalf of ``frontend``; return their handles.

    Raises:
        DuplicateNameError: a name is already in flight; the message names the
            front end that submitted it first.
    """
    set_id = 0 if process_set is global_process_set else resolve(process_set)
    runtime = current.SLOT.runtime
    if runtime is None:
        runtime = api.runtime()  # raises NotInitializedError
    try:
        return runtime.submit(entries, set_id, frontend)
    except DuplicateNameError as exc:
        raise _name_in_use(exc, entries, frontend) from exc
    except ValueError as exc:
        raise _named_by(exc, entries, frontend) from None


def submit_one(entry, frontend: str) -> Handle:
    """:func:`submit` of one entry to the global process set."""
    runtime = current.SLOT.runtime
    if runtime is None:
        runtime = api.runtime()  # raises NotInitializedError
    try:
        return runtime.submit_one(entry, frontend)
    except DuplicateNameError as exc:
        raise _name_in_use(exc, [entry], frontend) from exc
    except ValueError as exc:
        raise _named_by(exc, [entry], frontend) from None


def run(entry, process_set, frontend: str):
    """Run one collective synchronously on behalf of ``frontend``; return its result.

    :func:`submit` and :func:`synchronize` in one, which lets the runtime run
    a steady-state collective on this thread (``Runtime.run``).
    """
    set_id = resolve(process_set)
    try:
        return api.runtime().run(entry, set_id, frontend)
    except DuplicateNameError as exc:
        raise _name_in_use(exc, [entry], frontend) from exc
    except ValueError as exc:
        raise _named_by(exc, [entry], frontend) from None


def _named_by(exc: ValueError, entries, frontend: str) -> ValueError:
    """The runtime's refusal of ``entries`` (a rank outside the set, a broadcast
    root outside it, a set not registered), prefixed with the front end and
    operation as every argument error of the front ends is; other kinds of
    ValueError pass unchanged."""
    if type(exc) is not ValueError:
        return exc
    message = str(exc)
    op = entries[0].request.op.name.lower() if entries else ""
    if op and message.startswith(op + ":"):
        return ValueError(f"{frontend}.{message}")
    return ValueError(f"{frontend}.{op}: {message}" if op else f"{frontend}: {message}")


def _name_in_use(exc: DuplicateNameError, entries, frontend: str) -> DuplicateNameError:
    holder = getattr(exc, "holder", None)
    clash = holder.request.name if holder is not None else entries[0].request.name
    where = f"submitted through {holder.origin}" if holder is not None and holder.origin \
        else "submitted through an earlier call"
    what = entries[0].request.op.name.lower()
    return DuplicateNameError(
        f"{frontend}.{what}: the name {clash!r} is already used by a collective still in "
        f"flight, {where}; synchronize that handle first or pick "
        f"another name (names are shared by all front ends)")


def barrier(process_set=global_process_set) -> None:
    """Block until every rank of ``process_set`` reaches the barrier."""
    entry = core.barrier_entry(name_for(None, "barrier", process_set))
    synchronize(submit([entry], process_set, "hvdlike")[0])


def join(device=-1) -> int:
    """Declare that this rank has no more data; return the last rank to join.

    Until every rank has joined, this rank takes part in the other ranks'
    allreduces with zeros, so they keep training without hanging.
    ``device`` is accepted for Horovod compatibility.
    """
    entry = core.join_entry(name_for(None, "join"))
    return synchronize(submit([entry], global_process_set, "hvdlike")[0])


# Called while torch.compile traces, these run as graph breaks (see
# hvdlike.frontend.compile_guard).
poll, barrier, join = eager(poll), eager(barrier), eager(join)
