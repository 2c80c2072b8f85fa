"""The elastic flags of ``hvdlike-run`` as one validated object."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from ..errors import LaunchError

DEFAULT_ELASTIC_TIMEOUT = 600.0


@dataclasses.dataclass
class ElasticSettings:
    """How an elastic job grows, shrinks and gives up."""

    min_np: int
    """``--min-np``: fewer ranks than this for longer than ``elastic_timeout`` fails the job."""
    max_np: int
    """``--max-np``: never more ranks than this, however many slots are discovered."""
    np: int
    """``-np``: ranks to start with (when that many slots exist)."""
    discovery_script: Optional[str] = None
    """``--host-discovery-script``: prints ``host[:slots]`` lines; None: the fixed host list."""
    slots_per_host: Optional[int] = None
    """``--slots-per-host``: slots of a discovered host that names none."""
    reset_limit: Optional[int] = None
    """``--reset-limit``: at most this many re-forms; one more fails the job."""
    elastic_timeout: float = DEFAULT_ELASTIC_TIMEOUT
    """``--elastic-timeout``: seconds the job may stay below ``min_np``."""
    cooldown_range: Optional[Tuple[float, float]] = None
    """``--blacklist-cooldown-range LO HI``: a failed host returns after a random delay
    in [LO, HI] seconds (doubling with each further failure); None: never."""
    discovery_interval: float = 1.0
    """Seconds between runs of the discovery script."""


def validate(settings: ElasticSettings) -> ElasticSettings:
    """Check the flags agree with each other.

    Raises:
        LaunchError: naming the flag and the value that is wrong.
    """
    if settings.min_np < 1:
        raise LaunchError(f"--min-np {settings.min_np} is not valid: expected at least 1")
    if settings.max_np < settings.min_np:
        raise LaunchError(f"--max-np {settings.max_np} is less than --min-np {settings.min_np}")
    if settings.np < settings.min_np:
        raise LaunchError(f"-np {settings.np} is less than --min-np {settings.min_np}")
    if settings.np > settings.max_np:
        raise LaunchError(f"-np {settings.np} is more than --max-np {settings.max_np}")
    if settings.slots_per_host is not None and settings.slots_per_host < 1:
        raise LaunchError(f"--slots-per-host {settings.slots_per_host} is not valid: "
                          f"expected at least 1")
    if settings.reset_limit is not None and settings.reset_limit < 0:
        raise LaunchError(f"--reset-limit {settings.reset_limit} is not valid: expected >= 0")
    if settings.elastic_timeout <= 0:
        raise LaunchError(f"--elastic-timeout {settings.elastic_timeout:g} is not valid: "
                          f"expected seconds > 0")
    if settings.cooldown_range is not None:
        lo, hi = settings.cooldown_range
        if lo < 0 or hi < lo:
            raise LaunchError(f"--blacklist-cooldown-range {lo:g} {hi:g} is not valid: "
                              f"expected 0 <= LO <= HI")
    return settings
