"""Argument checks shared by :class:`~hvdlike.ray.RayExecutor` and ``HvdlikeConfig``.

Ray users pass these values from Python, often straight from a config file, so
a string where a number belongs or a ``nan`` is common. Comparing such a value
later gives Python's own ``'<=' not supported`` error with no argument named, or
(``nan``) a failure much later inside a rank. These helpers refuse the value at
once with a :class:`~hvdlike.core.errors.ConfigError` (a ``ValueError`` too)
that names the parameter as the API spells it. This module imports no Ray.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any, Dict, List, Mapping, Optional, Sequence

from hvdlike.core.errors import ConfigError


def seconds(where: str, name: str, value: Any) -> float:
    """A finite number of seconds > 0 (bools and strings refused).

    Why finite: an infinite or ``nan`` timeout is not "no timeout" for Ray or
    Gloo; it fails later, far from the argument.
    """
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) \
            or value <= 0:
        raise ConfigError(f"{where}: {name}={value!r} must be a finite number of seconds > 0")
    return float(value)


def amount(where: str, name: str, value: Any) -> float:
    """A finite resource amount > 0 (CPUs or GPUs per rank)."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) \
            or value <= 0:
        raise ConfigError(f"{where}: {name}={value!r} must be a finite number > 0")
    return value


def count(where: str, name: str, value: Any, minimum: int = 1) -> int:
    """An integer >= ``minimum``; ``True`` is refused although Python counts it as 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"{where}: {name}={value!r} must be {what}")
    return value


def cooldown(where: str, value: Any) -> Optional[tuple]:
    """``cooldown_range``: None or (low, high) finite seconds with 0 <= low <= high."""
    if value is None:
        return None
    pair = tuple(value) if isinstance(value, (list, tuple)) else None
    if pair is None or len(pair) != 2 or not all(
            isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v) for v in pair) \
            or not 0 <= pair[0] <= pair[1]:
        raise ConfigError(f"{where}: cooldown_range={value!r}: give (low, high) seconds, "
                          "0 <= low <= high")
    return (float(pair[0]), float(pair[1]))


def nic_list(where: str, nics: Any, name: str = "nics") -> Optional[List[str]]:
    """``nics`` as a list of one interface name (None: chosen per route).

    A plain string is one interface (not its letters); a set, list or tuple
    must hold exactly one name, since Gloo and the store use one interface.
    """
    if nics is None:
        return None
    if isinstance(nics, str):
        nics = [nics]
    if not isinstance(nics, (set, frozenset, list, tuple)):
        raise ConfigError(f"{where}: {name}={nics!r} must be an interface name or a set of one")
    names = list(nics)
    if not names:
        return None
    if len(names) != 1:
        raise ConfigError(f"{where}: {name}={nics!r}: give exactly one interface")
    if not isinstance(names[0], str) or not names[0] or any(c.isspace() or c == ","
                                                             for c in names[0]):
        raise ConfigError(f"{where}: {name}={nics!r}: {names[0]!r} is not an interface name")
    return names


def nic_address(where: str, nic: str, name: str = "nics") -> str:
    """The IPv4 address of ``nic`` on this host, refused with the parameter named.

    The store listens on this host, so a missing interface is known here
    before any Ray resource is reserved.
    """
    import socket

    import psutil

    interfaces = psutil.net_if_addrs()
    if nic not in interfaces:
        raise ConfigError(f"{where}: {name}: interface {nic!r} does not exist on this host "
                          f"(available: {', '.join(sorted(interfaces))})")
    for entry in interfaces[nic]:
        if entry.family == socket.AF_INET:
            return entry.address
    raise ConfigError(f"{where}: {name}: interface {nic!r} has no IPv4 address")


def env_strings(where: str, env: Optional[Mapping[Any, Any]]) -> Dict[str, str]:
    """``extra_env_vars`` with keys and values made strings (``str()``, as Horovod does).

    Environment variables are strings; ``{"NUM": 1}`` is a common way to write one.
    """
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise ConfigError(f"{where}: extra_env_vars={env!r} must be a mapping of names to values")
    converted = {str(k): str(v) for k, v in env.items()}
    for key in converted:
        if not key or "=" in key or "\0" in key:
            raise ConfigError(f"{where}: extra_env_vars: {key!r} is not a variable name")
    return converted


def flag_names(text: str, names: Sequence[tuple] = (
        ("--min-np", "min_workers"), ("--max-np", "max_workers"),
        ("--reset-limit", "reset_limit"), ("--elastic-timeout", "elastic_timeout"),
        ("--blacklist-cooldown-range", "cooldown_range"),
        ("--network-interface", "nics"), ("seen by hvdlike-run", "seen by hvdlike.ray"))) -> str:
    """The launcher's messages with its command-line names replaced by this API's.

    The elastic driver is shared with ``hvdlike-run``; a Ray user never typed
    ``--min-np``, so messages name the Python parameter instead.
    """
    for flag, param in names:
        text = text.replace(flag + " ", param + "=") if flag.startswith("--") else text
        text = text.replace(flag, param)
    return text
