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
from typing import Callable

import torch

_compiler = getattr(torch, "compiler", None)
is_compiling: Callable[[], bool] = getattr(_compiler, "is_compiling", None) or (lambda: False)
_disable = getattr(_compiler, "disable", None)


REASON = ("hvdlike collectives run outside compiled graphs: with fullgraph=True, call them "
          "outside the compiled function")


def outside(fn: Callable) -> Callable:
    """``fn`` itself, run without Dynamo (``torch.compiler.disable``), for a call
    made while compiling; ``fn`` where torch has no compiler."""
    if _disable is None:
        return fn
    try:
        return _disable(fn, reason=REASON)  # the reason shows in fullgraph's error
    except TypeError:  # an older torch: no reason argument
        return _disable(fn)


def eager(fn: Callable) -> Callable:
    """``fn`` that runs as a graph break when called while ``torch.compile`` traces."""
    if _disable is None:
        return fn
    disabled = outside(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call
