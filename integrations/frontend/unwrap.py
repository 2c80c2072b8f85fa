"""A context manager that hands back hvdlike's exception from a framework's wrapper.

JAX reports an exception raised inside a host callback as a
``JaxRuntimeError`` whose text is a formatted copy of it; the JAX and Keras
front ends subclass :class:`Unwrapping` with their own way of finding the
original (:func:`hvdlike.jax.errors.original_error`).
"""

from __future__ import annotations

import contextlib
from typing import Optional


class Unwrapping(contextlib.ContextDecorator):
    """Re-raise, in place of an exception that reports one of hvdlike's, that
    exception (usable as ``with`` or as a decorator); others pass unchanged."""

    @staticmethod
    def _original(exc: BaseException) -> Optional[BaseException]:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        found = self._original(value) if value is not None else None
        if found is None:
            return False
        # The wrapper is only a formatted copy of this one: do not chain it.
        raise found.with_traceback(found.__traceback__) from None
