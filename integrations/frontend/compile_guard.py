"""Collectives stay outside ``torch.compile``'s tracing.

A collective called from a function being compiled would otherwise be traced
like user code: Dynamo follows the call into the runtime, which negotiates
and runs the data plane on the calling thread, and compiles *that* -- copies
into shared memory, views of fusion buffers -- into graphs, with wrong results
or a broken runtime. :func:`eager` makes such a call a graph break instead: the
compiled code before and after it stays compiled, the collective runs as in
eager mode. Outside compilation it costs one check (about 0.1 us).
"""

from __future__ import annotations

import functools
import sys
from typing import Callable

import torch

_compiler = getattr(torch, "compiler", None)
is_compiling: Callable[[], bool] = getattr(_compiler, "is_compiling", None) or (lambda: False)
_disable = getattr(_compiler, "disable", None)


REASON = ("hvdlike collectives run outside compiled graphs: with fullgraph=True, call them "
          "outside the compiled function")


# fn -> fn wrapped by torch.compiler.disable. Making one imports torch._dynamo
# (over a second), which a process that never compiles should not pay at
# ``import hvdlike.torch``: they are made for every guarded function at the first
# guarded call after something else imported torch._dynamo (``torch.compile``
# does), normally an eager one such as ``broadcast_parameters``. A first call
# that is already being traced makes its own on the way (a few more graph
# breaks once; with ``fullgraph=True`` Dynamo's error then names ``disable``).
_DISABLED: dict = {}
_GUARDED: list = []
_pending = [True]


def _disabled(fn: Callable) -> Callable:
    found = _DISABLED.get(fn)
    if found is None:
        try:
            found = _disable(fn, reason=REASON)  # the reason shows in fullgraph's error
        except TypeError:  # an older torch: no reason argument
            found = _disable(fn)
        _DISABLED[fn] = found
    return found


def _prepare() -> None:
    """Make every guarded function's disabled twin once torch._dynamo is loaded."""
    if "torch._dynamo" in sys.modules:
        for fn in _GUARDED:
            _disabled(fn)
        _pending[0] = False


def outside(fn: Callable) -> Callable:
    """``fn`` run without Dynamo (``torch.compiler.disable``), for a call made while
    compiling; ``fn`` itself where torch has no compiler."""
    if _disable is None:
        return fn
    _GUARDED.append(fn)

    def call(*args, **kwargs):
        return _disabled(fn)(*args, **kwargs)

    return call


def eager(fn: Callable) -> Callable:
    """``fn`` that runs as a graph break when called while ``torch.compile`` traces."""
    if _disable is None:
        return fn
    _GUARDED.append(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if is_compiling():
            return _disabled(fn)(*args, **kwargs)
        if _pending[0]:
            _prepare()
            if _pending[0]:  # nothing compiles in this process
                return fn(*args, **kwargs)
        # Not being traced does not mean Dynamo is away: a compiled function's
        # frame that it gave up on (a graph break it could not resume from) runs
        # eagerly with Dynamo's frame hook still on, which would compile ``fn``'s
        # own frames -- the optimizer step, the runtime -- as new graphs. The
        # disabled twin turns the hook off for the call (about 0.4 us).
        return _disabled(fn)(*args, **kwargs)

    return call


def prepare_if_needed() -> None:
    """For the per-tensor paths, which check :func:`is_compiling` inline."""
    if _pending[0]:
        _prepare()
