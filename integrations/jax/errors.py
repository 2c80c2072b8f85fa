"""hvdlike's own exceptions back out of ``jax.jit``.

A collective inside a jitted function runs in a host callback (see
:mod:`hvdlike.jax.ops`). When it raises, XLA turns the exception into a
``jax.errors.JaxRuntimeError`` whose message is a formatted traceback: the
type is lost, so ``except hvd.HorovodInternalError`` would never fire and the
elastic loop would not re-form the job. The callback therefore records the
exception it raised (per process, the last one); the helpers here hand it
back in place of the JAX error that carries it, and forget it once handed
back:

- :class:`original_errors`, a context manager and decorator for user code;
- :func:`jit`, ``jax.jit`` whose calls do the same;
- :func:`original_error`, the lookup itself (the elastic loop uses it through
  the translator registered at import).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Callable, Optional

import jax

from hvdlike.core.elastic import loop
from hvdlike.frontend.unwrap import Unwrapping

_lock = threading.Lock()
_recorded: Optional[BaseException] = None

# Where JAX logs a failing callback's traceback (besides putting it in the error).
_CALLBACK_LOGGER = "jax._src.callback"


def record(exc: BaseException) -> None:
    """Remember ``exc``, just raised inside a host callback, until it is handed back."""
    global _recorded
    with _lock:
        _recorded = exc


def recorded() -> Optional[BaseException]:
    """The exception last recorded and not yet handed back (for the log filter)."""
    return _recorded


def _carries(jax_error: BaseException, exc: BaseException) -> bool:
    """Whether ``jax_error``'s message is the report of ``exc``.

    A recorded error nobody asked for (the user caught the JAX error
    themselves) must not be handed back for an unrelated JAX error later, so
    the JAX message has to name the recorded exception's type and message.
    """
    message = str(jax_error)
    return type(exc).__name__ in message and str(exc) in message


def original_error(exc: BaseException) -> Optional[BaseException]:
    """The hvdlike exception that ``exc`` (a ``JaxRuntimeError``) reports, or None.

    The recorded exception is forgotten when returned, so each failure is
    handed back once.
    """
    global _recorded
    if not isinstance(exc, jax.errors.JaxRuntimeError):
        return None
    with _lock:
        found = _recorded
        if found is None or not _carries(exc, found):
            return None
        _recorded = None
    return found


class original_errors(Unwrapping):
    """Re-raise, in place of a ``JaxRuntimeError``, the hvdlike exception it reports.

    Usable as ``with hvd.original_errors(): ...`` around a jitted step (and
    ``jax.block_until_ready`` of its result), or as a decorator. Other
    exceptions pass unchanged.

    Example:
        >>> with hvd.original_errors():
        ...     params, opt_state = step(params, opt_state, x, y)
    """

    _original = staticmethod(original_error)


class _Jitted:
    """A ``jax.jit`` function whose calls go through :class:`original_errors`."""

    def __init__(self, jitted):
        self._jitted = jitted
        functools.update_wrapper(self, jitted)

    def __call__(self, *args, **kwargs):
        with original_errors():
            return self._jitted(*args, **kwargs)

    def __get__(self, obj, objtype=None):
        """Bind like a function, so ``hvd.jit`` works on methods as ``jax.jit`` does."""
        return self if obj is None else functools.partial(self.__call__, obj)

    def __getattr__(self, name):
        # lower, trace, eval_shape, clear_cache ... of the jitted function
        return getattr(self._jitted, name)


def jit(fun: Optional[Callable] = None, **jit_kwargs):
    """``jax.jit`` whose calls raise hvdlike's exceptions, not ``JaxRuntimeError``.

    Takes ``jax.jit``'s keyword arguments; usable as ``@hvd.jit`` or
    ``@functools.partial(hvd.jit, static_argnums=...)``.
    """
    if fun is None:
        return functools.partial(jit, **jit_kwargs)
    return _Jitted(jax.jit(fun, **jit_kwargs))


class _QuietRecorded(logging.Filter):
    """Drop JAX's log of a callback failure that hvdlike recorded.

    JAX logs the traceback of every failing callback to stderr; for an
    hvdlike error that is a second copy of what the caller gets anyway (and
    under the elastic loop, of an error that is handled).
    """

    def filter(self, record_: logging.LogRecord) -> bool:
        exc = record_.exc_info[1] if record_.exc_info else None
        return exc is None or exc is not recorded()


def _install() -> None:
    """Quiet JAX's callback log and let the elastic loop see through JAX errors."""
    logging.getLogger(_CALLBACK_LOGGER).addFilter(_QuietRecorded())
    loop.register_translator(original_error)


_install()
