"""The rendezvous store hosted by the launcher, and where to bind it.

The store is a ``torch.distributed.TCPStore`` server listening on a socket the
launcher binds itself, so it listens only on the chosen address (TCPStore alone
would listen on every interface). The launcher's own reads and writes go through
the same authenticated view the ranks use (:mod:`hvdlike.core.store_auth`): keys
under a prefix derived from the job secret, values signed with it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import pwd
import socket
from functools import lru_cache
from typing import Iterable, List, Sequence, Tuple

from hvdlike.core.job_secret import new_secret  # noqa: F401 - re-exported for the launcher
from hvdlike.core.topology import local_address_towards

from .errors import LaunchError


@lru_cache(maxsize=1)
def _local_addresses() -> frozenset:
    import psutil

    found = set()
    for addrs in psutil.net_if_addrs().values():
        for entry in addrs:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                found.add(entry.address.split("%", 1)[0])
    return frozenset(found)


def _bare(host: str) -> str:
    return host.rsplit("@", 1)[-1]


def resolve(host: str) -> List[str]:
    """IP addresses of ``host`` (IPv4 first).

    Raises:
        LaunchError: the name does not resolve.
    """
    name = _bare(host)
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise LaunchError(f"host {name!r} does not resolve: {exc.strerror}") from None
    except (UnicodeError, ValueError) as exc:  # e.g. a part between dots over 63 characters
        raise LaunchError(f"host {name!r} is not a valid host name ({exc})") from None
    addrs = [info[4][0] for info in infos]
    return sorted(set(addrs), key=lambda a: (":" in a, addrs.index(a)))


@lru_cache(maxsize=1)
def _my_names() -> frozenset:
    return frozenset(("localhost", socket.gethostname(), socket.getfqdn()))


def is_local(host: str) -> bool:
    """Whether ``host`` is this machine (no ssh needed). ``user@host`` naming
    another user than this one is not: ssh then logs in as that user, as asked."""
    user = host.rpartition("@")[0] if "@" in host else ""
    if user and user != _current_user():
        return False
    name = _bare(host)
    if name in _my_names():
        return True
    try:
        addrs = [name] if _is_ip(name) else resolve(name)
    except LaunchError:
        return False
    return any(ipaddress.ip_address(a).is_loopback or a in _local_addresses() for a in addrs)


def _current_user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:  # a uid without a passwd entry (containers)
        return str(os.getuid())


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def interface_address(interface: str) -> str:
    """The IPv4 address of a network interface.

    Raises:
        LaunchError: no such interface, or it has no IPv4 address.
    """
    import psutil

    interfaces = psutil.net_if_addrs()
    if interface not in interfaces:
        raise LaunchError(
            f"--network-interface {interface!r} does not exist here "
            f"(available: {', '.join(sorted(interfaces))})"
        )
    for entry in interfaces[interface]:
        if entry.family == socket.AF_INET:
            return entry.address
    raise LaunchError(f"--network-interface {interface!r} has no IPv4 address")


def check_interfaces(names: Sequence[str]) -> None:
    """Every interface of ``names`` exists here, and the first (the store's) has an
    IPv4 address.

    Raises:
        LaunchError: naming the first interface that does not.
    """
    import psutil

    if not names:
        return
    interface_address(names[0])
    interfaces = psutil.net_if_addrs()
    for name in names[1:]:
        if name not in interfaces:
            raise LaunchError(f"--network-interface {name!r} does not exist here "
                              f"(available: {', '.join(sorted(interfaces))})")


def choose_address(remote_hosts: Iterable[str], interface: str = "") -> str:
    """The address the store binds to, reachable from every host.

    Args:
        remote_hosts: hosts reached over ssh (empty: a single-machine job).
        interface: ``--network-interface``; wins when given.

    Returns:
        The interface's address; else ``127.0.0.1`` for a local job; else the
        local address that routes to the first remote host.

    Raises:
        LaunchError: the interface is unknown or no route leads to the hosts.
    """
    if interface:
        return interface_address(interface)
    remote_hosts = list(remote_hosts)
    if not remote_hosts:
        return "127.0.0.1"
    for host in remote_hosts:
        for addr in resolve(host):
            local = local_address_towards(addr, 22)
            if local:
                return local
    raise LaunchError(
        f"no local network address routes to {', '.join(remote_hosts)}; "
        "pick one with --network-interface"
    )


class StoreServer:
    """The job's TCPStore server, bound to one address; use as a context manager."""

    def __init__(self, addr: str, world_size: int, secret: str, timeout_seconds: float = 60.0):
        self.addr = addr
        self.secret = secret
        self._world_size = world_size
        self._timeout = datetime.timedelta(seconds=timeout_seconds)
        self._store = None
        self.port = 0

    def __enter__(self) -> "StoreServer":
        from .interrupts import deferred

        with deferred():  # a Ctrl-C inside torch's import could be swallowed there
            from hvdlike.core.job_store import serve  # imports torch

        try:
            self._store, self.port = serve(self.addr, 0, self._world_size, self._timeout)
        except OSError as exc:
            raise LaunchError(f"cannot listen on {self.addr}: {exc.strerror or exc}") from None
        except Exception as exc:  # torch raises RuntimeError or DistError subclasses
            raise LaunchError(f"cannot start the rendezvous store on {self.addr}: {exc}") from None
        return self

    def client(self, max_value_bytes: int = 0):
        """The job's authenticated view of this server (the launcher's own connection)."""
        from hvdlike.core.store_auth import AuthenticatedStore

        store = AuthenticatedStore(self._store, self.secret)
        if max_value_bytes:
            store.max_value_bytes = max_value_bytes
        return store

    def endpoint(self) -> Tuple[str, int]:
        return self.addr, self.port

    def __exit__(self, *exc_info) -> None:
        self._store = None
