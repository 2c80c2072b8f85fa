"""The current-runtime slot: the only process-wide state hvdlike keeps.

Module-level functions (``hvdlike.rank()``, every front end's collectives)
reach the live :class:`~hvdlike.core.runtime.Runtime` through :data:`SLOT`.
Everything else -- process sets, counters, locks, the timeline -- belongs to
a runtime, so tearing one down and building the next (``shutdown()`` then
``init()``, or an elastic re-form) leaves nothing behind.

The slot also counts the runtimes made in this process: each gets the next
generation number, which names its store keys apart from its predecessors'.
This module imports nothing from hvdlike, so any module may import it.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, Optional

from .errors import NotInitializedError


class Slot:
    """Holds the live runtime; ``lock`` serializes ``init()`` and ``shutdown()``."""

    def __init__(self):
        self.runtime: Optional[Any] = None
        self.lock = threading.RLock()
        self.generations = 0  # runtimes built in this process
        self.exit_hooks_installed = False
        # Instances of front-end objects made while no runtime lives (kind -> count).
        self.counters: Dict[str, int] = {}
        # This process was forked from one whose runtime was live (see _forked).
        self.inherited = False
        # Runtimes shut down from inside a negotiation cycle (a signal handler), whose
        # parts are freed later: the next shutdown() (at exit, at the latest) waits for that.
        self.closing: list = []

    def next_generation(self) -> int:
        with self.lock:
            self.generations += 1
            return self.generations


SLOT = Slot()


def _forked() -> None:
    """In a child forked after ``init()`` (a DataLoader worker, ``os.fork``).

    The child holds a copy of its parent's runtime: the parent's segments,
    sockets and store connection, and none of its threads. Driving them from
    here would break the parent's job (its peers would take the child's
    traffic for the parent's), and the child's exit must not announce a
    shutdown, remove files or abort MPI in the parent's name. The copy keeps
    answering ``rank()``/``size()`` and refuses everything else, naming why.
    A lock another thread held at the fork stays held in the child: made anew.
    """
    SLOT.lock = threading.RLock()
    current = SLOT.runtime
    if current is not None:
        SLOT.inherited = True
        current.forked_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def get():
    """The live runtime, or None."""
    return SLOT.runtime


def require():
    """The live runtime; raises :class:`NotInitializedError` before ``init()``."""
    current = SLOT.runtime
    if current is None:
        raise NotInitializedError(
            "hvdlike has not been initialized; call hvdlike.init() (or hvd.init()) first")
    return current


def instance_number(kind: str) -> int:
    """The next number of a front-end object of ``kind`` (an optimizer, a layer).

    Counted by the live runtime, so ranks that built their objects under
    different runtimes (a rank that joined at a re-form) still agree; before
    ``init()``, counted here.
    """
    current = SLOT.runtime
    if current is not None:
        return current.counter(f"instances/{kind}")
    with SLOT.lock:
        n = SLOT.counters.get(kind, 0)
        SLOT.counters[kind] = n + 1
        return n
