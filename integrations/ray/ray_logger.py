"""Send values from a rank to the driver's ``callbacks`` (``horovod.ray.ray_logger``'s API).

Inside a function given to :meth:`hvdlike.ray.RayExecutor.run` or ``execute``
with ``callbacks=[...]``, ``log({"loss": 0.3})`` hands the value to every
callback on the driver, in the order logged, while the job runs. Outside such
a call (no callbacks given, or not under the executor) ``log`` warns once and
drops the value, as Horovod does.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

_queue: Optional[Any] = None
_warned = False


def configure(queue: Optional[Any]) -> None:
    """Set (or clear, with None) where :func:`log` sends values; called by the rank actor."""
    global _queue
    _queue = queue


def log(info: Any) -> None:
    """Send ``info`` (anything picklable, typically a dict) to the driver's callbacks."""
    global _warned
    if _queue is not None:
        _queue.put(info)
    elif not _warned:
        _warned = True
        warnings.warn("hvdlike.ray.ray_logger.log called but no callbacks were given to "
                      "run()/execute(): the value is dropped", stacklevel=2)
