"""Hosts, slots and rank assignment: pure functions, no I/O except hostfile reading.

``-H host1:4,host2:4`` and hostfiles (``host slots=N``) become a list of
:class:`HostSlots`; :func:`assign_ranks` fills them in order and gives every rank
its Horovod topology (rank, local rank, cross rank and sizes).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from typing import List, Optional, Sequence

from hvdlike.core.topology import Topology, topologies

from . import small_file
from .errors import LaunchError

# [user@] then a host name, an IPv4 address, or a bracketed IPv6 address.
_HOST = r"(?:[A-Za-z0-9_.\-]+@)?(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+)"
_HOST_SPEC = re.compile(rf"^({_HOST})(?::(\S*))?$")


@dataclasses.dataclass(frozen=True)
class HostSlots:
    """A host and how many ranks it may run."""

    host: str
    slots: int


@dataclasses.dataclass(frozen=True)
class RankPlacement:
    """Where one rank runs and its place in the job."""

    host: str
    topology: Topology

    @property
    def rank(self) -> int:
        return self.topology.rank


MAX_RANKS = 65536
HOSTFILE_MAX_BYTES = 1 << 20  # thousands of hosts fit; /dev/zero does not
"""The most ranks a job (and slots a host) may have: larger counts are typing mistakes,
and would exhaust this machine's memory before any rank started."""


def _clip(text: str, most: int = 80) -> str:
    """``repr(text)``, shortened when long: an error quotes what it refuses, not megabytes."""
    if len(text) <= most:
        return repr(text)
    return f"{text[:most]!r}... ({len(text)} characters)"


def _slots(text: str, where: str) -> int:
    # ASCII digits only: str.isdigit() also accepts '²' or '٣'.
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise LaunchError(f"{where}: slots {_clip(text)} must be a positive integer")
    if int(text) > MAX_RANKS:
        raise LaunchError(f"{where}: slots {_clip(text)} is more than the limit of "
                          f"{MAX_RANKS}")
    return int(text)


def _bare_ipv6(token: str) -> Optional[str]:
    """``token`` (``[user@]address``) when its address is a bare IPv6 one, else None."""
    user, at, name = token.rpartition("@")
    if name.count(":") < 2:
        return None
    try:
        ipaddress.IPv6Address(name)
    except ValueError:
        return None
    return token


def _ipv6_hint(token: str) -> str:
    """What to write instead of a bare IPv6 address followed by ``:slots``, if it is one."""
    user, at, name = token.rpartition("@")
    address, _, slots = name.rpartition(":")
    spellings = []
    if _bare_ipv6(token):
        spellings.append(f"{user}{at}[{name}]")
    if slots.isdigit() and _bare_ipv6(address):
        spellings.append(f"{user}{at}[{address}]:{slots}")
    if not spellings:
        return ""
    return f" (an IPv6 address goes in brackets: {' or '.join(spellings)})"


def _strip_brackets(host: str) -> str:
    return host[1:-1] if host.startswith("[") else host


def _checked_host(host: str, where: str) -> str:
    """``host`` (``[user@]name``) without IPv6 brackets, once its name could be one:
    what a resolver or ssh would otherwise fail on obscurely (or take as an option)."""
    user, _, name = host.rpartition("@")
    if user.startswith("-") or name.startswith("-"):
        raise LaunchError(f"{where}: a host or user name cannot start with '-'")
    if name.startswith("["):
        return _strip_brackets(host)
    labels = name[:-1].split(".") if name.endswith(".") else name.split(".")
    if "" in labels:
        raise LaunchError(f"{where}: host name {_clip(name)} has an empty part between dots")
    if max(map(len, labels)) > 63 or len(name) > 253:
        raise LaunchError(f"{where}: host name {_clip(name)} is too long (at most 63 characters "
                          "between dots, 253 in all)")
    return host


def checked_name(host, where: str) -> str:
    """A host given on its own (``HostSlots.host``) checked as an entry of ``-H`` is:
    ``[user@]host``, an IPv6 address with or without brackets; returned as
    :func:`parse_hosts` would give it.

    Raises:
        LaunchError: naming ``where`` and the host.
    """
    if not isinstance(host, str):
        raise LaunchError(f"{where}: host must be a str, got {type(host).__name__} {host!r:.60}")
    user, at, name = host.rpartition("@")
    spec = host
    if ":" in name and not name.startswith("["):  # an IPv6 address, as parse_hosts leaves it
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            raise LaunchError(f"{where}: host {host!r} is not valid: a host name has no ':' "
                              f"(the slots go in HostSlots.slots)") from None
        spec = f"{user}{at}[{name}]"
    if re.fullmatch(_HOST, spec) is None:
        raise LaunchError(f"{where}: host {host!r} is not valid: expected [user@]host")
    return _checked_host(spec, f"{where} ({host!r})")


def parse_hosts(text: str) -> List[HostSlots]:
    """Parse ``-H host1:4,host2:4`` (a host without ``:N`` has one slot).

    Args:
        text: comma-separated ``host[:slots]`` entries.

    Returns:
        The hosts in the order given.

    Raises:
        LaunchError: an entry is empty, malformed, repeated, or has bad slots.

    Example:
        >>> parse_hosts("a:2,b")
        [HostSlots(host='a', slots=2), HostSlots(host='b', slots=1)]
    """
    if not text.strip():
        raise LaunchError("-H/--hosts is empty: expected host[:slots][,host[:slots]...]")
    result = []
    for entry in text.split(","):
        entry = entry.strip()
        match = _HOST_SPEC.match(entry)
        where = f"-H/--hosts entry {_clip(entry)}"
        if not match or _ipv6_hint(entry):
            raise LaunchError(f"{where} is not valid: expected host or host:slots"
                              f"{_ipv6_hint(entry)}")
        host, slots = match.group(1), match.group(2)
        result.append(HostSlots(_checked_host(host, where),
                                1 if slots is None else _slots(slots, where)))
    return no_repeats(result, "-H/--hosts")


def parse_hostfile(text: str, name: str = "hostfile") -> List[HostSlots]:
    """Parse a hostfile: ``host slots=N`` per line (``host`` alone: 1 slot).

    ``#`` starts a comment; blank lines are ignored. ``host:N`` is accepted too.

    Raises:
        LaunchError: naming the file and line of the first malformed entry.
    """
    result = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{name} line {number} ({_clip(line)})"
        tokens = line.split()
        bare = _bare_ipv6(tokens[0])
        if bare is not None:
            # A bare IPv6 address takes its slots from slots= only; without one,
            # an address that could also be read as address:slots is ambiguous.
            user, at, name = bare.rpartition("@")
            address, _, tail = name.rpartition(":")
            given = any(t.startswith("slots=") for t in tokens[1:])
            if tail.isdigit() and _bare_ipv6(address) and not given:
                raise LaunchError(f"{where} is ambiguous: write {user}{at}[{name}] for the "
                                  f"address, or {user}{at}[{address}]:{tail} for its slots")
            host, slots_text = f"{user}{at}[{name}]", None
        else:
            match = _HOST_SPEC.match(tokens[0])
            if match is None:
                raise LaunchError(f"{where} is not valid: expected 'host slots=N'"
                                  f"{_ipv6_hint(tokens[0])}")
            host, slots_text = match.groups()
        slots = 1 if slots_text is None else _slots(slots_text, where)
        given = set() if slots_text is None else {"slots"}
        for token in tokens[1:]:
            option = re.fullmatch(r"(slots|max_slots|max-slots)=(\S*)", token)
            if option is None:
                raise LaunchError(f"{where} is not valid: expected 'host slots=N'")
            key = "slots" if option.group(1) == "slots" else "max_slots"
            if key in given:
                raise LaunchError(f"{where} gives {key} twice")
            given.add(key)
            value = _slots(option.group(2), where)  # max_slots is checked, then unused
            if key == "slots":
                slots = value
        result.append(HostSlots(_checked_host(host, where), slots))
    if not result:
        raise LaunchError(f"{name} lists no hosts")
    return no_repeats(result, name)


def read_hostfile(path: str) -> List[HostSlots]:
    """Read and parse the hostfile at ``path``.

    Raises:
        LaunchError: the file cannot be read or is malformed.
    """
    text = small_file.read_text(path, f"cannot read hostfile {path!r}", HOSTFILE_MAX_BYTES,
                                "a hostfile")
    return parse_hostfile(text, f"hostfile {path!r}")


def no_repeats(hosts: List[HostSlots], where: str) -> List[HostSlots]:
    seen = set()
    for entry in hosts:
        if entry.host in seen:
            raise LaunchError(f"{where} names host {_clip(entry.host)} twice")
        seen.add(entry.host)
    return hosts


def assign_ranks(hosts: Sequence[HostSlots], np: Optional[int]) -> List[RankPlacement]:
    """Fill hosts in order with ``np`` ranks (all slots when ``np`` is None).

    Args:
        hosts: hosts and their slots, in order.
        np: number of ranks; must be between 1 and the total number of slots.

    Returns:
        One :class:`RankPlacement` per rank, in rank order.

    Raises:
        LaunchError: ``np`` is below 1 or above the number of slots.

    Example:
        >>> [p.host for p in assign_ranks([HostSlots("a", 2), HostSlots("b", 2)], 3)]
        ['a', 'a', 'b']
    """
    total = sum(entry.slots for entry in hosts)
    if np is None:
        np = total
    if np < 1:
        raise LaunchError(f"-np {np} is not valid: expected at least 1 process")
    if np > MAX_RANKS:
        raise LaunchError(f"-np {np} is not valid: expected at most {MAX_RANKS} processes")
    if np > total:
        listed = ", ".join(f"{h.host}:{h.slots}" for h in hosts)
        raise LaunchError(f"-np {np} is more than the {total} slot(s) available ({listed})")
    host_of_rank: List[str] = []
    for entry in hosts:
        take = min(entry.slots, np - len(host_of_rank))
        host_of_rank.extend([entry.host] * take)
    return [RankPlacement(host, topo) for host, topo in zip(host_of_rank, topologies(host_of_rank))]
