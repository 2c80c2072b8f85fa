"""Collectives over whole pytrees: parameters, gradients, optimizer state.

A pytree's array leaves travel together (one negotiation, fused where the
core can fuse); leaves that are not arrays (step counters kept as Python
ints, strings, ...) travel as one pickled object. The tree structure itself
is only compared: every rank must hold a tree of the same structure, as it
does when every rank built the model with the same code; ranks whose trees
differ all get a ``ValueError`` naming them, before any leaf travels.

A reduction runs every training step, so its structure is compared once:
the first reduction of a tree structure (per process set and per runtime,
so a re-formed elastic job compares again) gathers every rank's structure,
and later ones find it among the structures already agreed on. The
comparison runs where the reduction runs, so inside ``jax.jit`` it happens
in the host callback of the first execution, not while tracing.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

import jax
import numpy as np

from hvdlike.core import api
from hvdlike.core.process_sets import global_process_set, resolve
from hvdlike.frontend import synchronize
from hvdlike.frontend.submit import name_for
from hvdlike.frontend.objects import allgather_object, broadcast_object

from . import ops
from .convert import FRONTEND, is_float0, is_traced


def _is_array(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def _no_data(leaf) -> bool:
    """A float0 leaf (gradient w.r.t. an integer input): no values, nothing to send.

    ``jax.grad(..., allow_int=True)`` gives one per integer leaf; every rank
    holds the same (empty) value, so it is passed through as it is.
    """
    return is_float0(getattr(leaf, "dtype", None))


def broadcast_pytree(tree: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set=global_process_set) -> Any:
    """Return ``root_rank``'s ``tree`` on every rank (same structure, JAX arrays).

    Args:
        tree: any pytree (dicts, lists, tuples, dataclasses registered with JAX,
            optax states...) whose structure is the same on every rank.
        root_rank: rank whose values every rank receives.
        name: base name of the collectives (default: an automatic one).
        process_set: ranks taking part.

    Raises:
        TypeError: called inside ``jax.jit`` (broadcast outside the step), or a
            leaf of an unsupported type or dtype.

    Example:
        >>> params = hvd.broadcast_pytree(params, root_rank=0)
        >>> opt_state = hvd.broadcast_pytree(opt_state, root_rank=0)
    """
    leaves, treedef = jax.tree.flatten(tree)
    if any(is_traced(leaf) for leaf in leaves):
        raise TypeError(f"{FRONTEND}.broadcast_pytree cannot run inside jax.jit; broadcast "
                        f"the initial state once, before the training step")
    base = name_for(name, "broadcast_pytree", process_set, kind=False)
    _check_same_structure(leaves, treedef, f"{base}.structure", process_set)
    arrays = [i for i, leaf in enumerate(leaves) if _is_array(leaf) and not _no_data(leaf)]
    others = [i for i, leaf in enumerate(leaves) if not _is_array(leaf)]
    for i in arrays:  # refuse a bad leaf before anything is in flight
        ops.grid._tensor(leaves[i], "broadcast_pytree")
    handles = [ops.grid.broadcast_async(leaves[i], root_rank, f"{base}.{i}", process_set)
               for i in arrays]
    out = list(leaves)
    if others:
        values = broadcast_object([leaves[i] for i in others], root_rank, f"{base}.objects",
                                  process_set)
        for i, value in zip(others, values):
            out[i] = value
    for i, handle in zip(arrays, handles):
        out[i] = synchronize(handle)
    return jax.tree.unflatten(treedef, out)


def _describe(leaves, treedef) -> str:
    kinds = ",".join("array" if _is_array(leaf) else "object" for leaf in leaves)
    return f"{treedef} leaves: [{kinds}]"


def _check_same_structure(leaves, treedef, name: str, process_set,
                          what: str = "broadcast_pytree") -> None:
    """Raise on every rank unless every rank holds a tree of the same structure.

    Without this check a rank whose tree has other keys or more leaves would
    silently keep some of its own values, or wait for broadcasts nobody sends.
    """
    _compare(_describe(leaves, treedef), name, process_set, what)


def _compare(mine: str, name: str, process_set, what: str) -> None:
    """Raise the same ValueError on every rank unless every rank's ``mine`` is equal."""
    everyone = allgather_object(mine, name=name, process_set=process_set)
    if all(d == everyone[0] for d in everyone):
        return
    members = (list(range(len(everyone))) if process_set is global_process_set
               or process_set is None else list(process_set.ranks))
    groups = {}
    for rank, description in zip(members, everyone):
        groups.setdefault(description, []).append(rank)
    lines = "\n".join(f"  ranks {ranks}: {description}" for description, ranks in groups.items())
    raise ValueError(f"{FRONTEND}.{what}: ranks hold pytrees of different "
                     f"structures; every rank must pass the same structure:\n{lines}")


def broadcast_variables(variables: Any, root_rank: int = 0, name: Optional[str] = None,
                        process_set=global_process_set) -> Any:
    """Horovod's name for :func:`broadcast_pytree` (parameters or optimizer state)."""
    return broadcast_pytree(variables, root_rank, name, process_set)


# Per runtime (a re-formed elastic job starts with none): {(treedef, set id), ...}
# of the reduced tree structures every rank of the set has been seen to share.
_agreed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_agreed_lock = threading.Lock()


def _agree_once(treedef, what: str, process_set):
    """A ``before`` hook for the reduction: compare ``treedef`` across ranks, once.

    Pairing leaves by position alone would silently reduce rank 0's ``a``
    with rank 1's ``x``. Comparing costs a collective, so a structure every
    rank has already agreed on is not compared again; a reduction whose
    ranks disagree raises the same ValueError on every rank and is not
    remembered.
    """
    def before(name: str) -> None:
        runtime = api.runtime()
        key = (treedef, resolve(process_set))
        with _agreed_lock:
            seen = _agreed.setdefault(runtime, set())
            if key in seen:
                return
        _compare(str(treedef), f"{name}.structure", process_set, what)
        with _agreed_lock:
            seen.add(key)
    return before


def _check_reducible(tree, leaves, what: str) -> None:
    """Refuse leaves no reduction can take (strings, None-like objects), naming their path."""
    for i, leaf in enumerate(leaves):
        if not (_is_array(leaf) or is_traced(leaf)
                or isinstance(leaf, (bool, int, float, complex))):
            paths = jax.tree_util.tree_flatten_with_path(tree)[0]
            where = jax.tree_util.keystr(paths[i][0]) if i < len(paths) else f"#{i}"
            raise TypeError(f"{FRONTEND}.{what}: leaf {where} is a "
                            f"{type(leaf).__module__}.{type(leaf).__qualname__}; only array "
                            f"and number leaves can be reduced")


def allreduce_pytree(tree: Any, name: Optional[str] = None, op=ops.Average,
                     prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> Any:
    """Reduce every array leaf of ``tree`` across ranks in one grouped allreduce.

    Works eagerly and inside ``jax.jit`` (see :mod:`hvdlike.jax.ops`). float0
    leaves (gradients w.r.t. integer inputs) hold no values and come back as
    they are. Every rank must pass a tree of the same structure; the first
    reduction of a structure checks that (see the module's docstring).

    Raises:
        ValueError: ranks pass trees of different structures (on every rank).
        TypeError: a leaf is neither an array nor a number.
    """
    return _reduce_tree(tree, name, op, prescale_factor, postscale_factor, process_set,
                        "allreduce_pytree")


def _reduce_tree(tree, name, op, prescale_factor, postscale_factor, process_set, what: str):
    leaves, treedef = jax.tree.flatten(tree)
    _check_reducible(tree, leaves, what)
    carried = [i for i, leaf in enumerate(leaves) if not _no_data(leaf)]
    if not carried:
        return tree
    reduced = ops.grouped_allreduce_then([leaves[i] for i in carried], name, op,
                                         prescale_factor, postscale_factor, process_set,
                                         before=_agree_once(treedef, what, process_set))
    out = list(leaves)
    for i, value in zip(carried, reduced):
        out[i] = value
    return jax.tree.unflatten(treedef, out)
