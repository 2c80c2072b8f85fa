"""The ``hvdlike`` logger, configured from ``HVDLIKE_LOG_LEVEL`` and
``HVDLIKE_LOG_HIDE_TIME`` at init."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("hvdlike")
logging.addLevelName(5, "TRACE")

_handler = None


def configure(level: int, rank: int, hide_time: bool = False) -> None:
    """Route hvdlike's records to stderr with the time (unless ``hide_time``,
    ``HVDLIKE_LOG_HIDE_TIME=1``) and the rank in every line."""
    global _handler
    if _handler is None:
        _handler = logging.StreamHandler(sys.stderr)
        logger.addHandler(_handler)
        logger.propagate = False
    when = "" if hide_time else "[%(asctime)s.%(msecs)03d] "
    _handler.setFormatter(logging.Formatter(f"{when}[hvdlike rank {rank}] %(levelname)s: "
                                            "%(message)s", datefmt="%Y-%m-%d %H:%M:%S"))
    logger.setLevel(level)
