"""Holding Ctrl-C back while the launcher imports heavy modules.

A ``KeyboardInterrupt`` raised in the middle of importing a third-party module
(torch, numpy) can be swallowed by that module's own import-time error handling
-- the launcher then carries on and runs the whole job -- or leave the module
half-imported. :func:`deferred` records a SIGINT that arrives during such an
import and raises it once the import is over, where the launcher's own handling
turns it into its usual one-line stop.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Run the block with SIGINT held back; raise ``KeyboardInterrupt`` after it if one came.

    Only in the main thread (signal handlers can be set nowhere else), and only
    when SIGINT has Python's default handler (not when ignored or taken over).
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    came = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if came:
        raise KeyboardInterrupt
