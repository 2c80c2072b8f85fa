"""The ``hvdlike`` logger, configured from ``HVDLIKE_LOG_LEVEL`` at init."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("hvdlike")
logging.addLevelName(5, "TRACE")

_handler = None


def configure(level: int, rank: int) -> None:
    """Route hvdlike's records to stderr with the rank in every line."""
    global _handler
    if _handler is None:
        _handler = logging.StreamHandler(sys.stderr)
        logger.addHandler(_handler)
        logger.propagate = False
    _handler.setFormatter(logging.Formatter(f"[hvdlike rank {rank}] %(levelname)s: %(message)s"))
    logger.setLevel(level)
