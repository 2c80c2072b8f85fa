"""hvdlike's own exceptions back out of a Keras step on the JAX backend.

On the JAX backend the gradient allreduce runs inside the jitted train step,
as a host callback (see :mod:`hvdlike.jax.errors`). A collective that fails
there -- ranks building different models, a lost peer -- reaches the caller of
``model.fit`` as ``jax.errors.JaxRuntimeError``, whose message is a formatted
copy of hvdlike's exception. These helpers give the original back, as their
``hvdlike.jax`` namesakes do; on the torch backend the collectives raise
hvdlike's exceptions directly and the helpers change nothing.
"""

from __future__ import annotations

import importlib
from typing import Optional

from hvdlike.frontend.unwrap import Unwrapping

from .backend import backend_name


def _jax_errors():
    """:mod:`hvdlike.jax.errors` on the JAX backend, None on others (jax may be absent)."""
    if backend_name() != "jax":
        return None
    return importlib.import_module("hvdlike.jax.errors")


def original_error(exc: BaseException) -> Optional[BaseException]:
    """The hvdlike exception that ``exc`` (a ``JaxRuntimeError``) reports, or None."""
    errors = _jax_errors()
    return errors.original_error(exc) if errors is not None else None


class original_errors(Unwrapping):
    """Re-raise, in place of a ``JaxRuntimeError``, the hvdlike exception it reports.

    Example:
        >>> with hvd.original_errors():
        ...     model.fit(x, y, callbacks=[...])
    """

    _original = staticmethod(original_error)
