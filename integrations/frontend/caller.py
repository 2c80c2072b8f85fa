"""Warnings that point at the user's line, not at hvdlike's or torch's frames."""

from __future__ import annotations

import sys
import warnings


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by the caller of this function
    that names the first frame outside hvdlike and torch (a ``GradScaler``, a
    learning-rate scheduler or a compile guard may stand in between)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith(
            ("hvdlike.", "torch.", "keras.")):
        frame, level = frame.f_back, level + 1
    return level


def deprecated_average(what: str) -> None:
    """Horovod's ``average=`` flag still works and warns as Horovod's does."""
    warnings.warn(f"{what}: the average argument is deprecated (as in Horovod); pass "
                  f"op=Average or op=Sum instead", DeprecationWarning,
                  stacklevel=user_stacklevel())
