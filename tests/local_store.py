"""A TCPStore on loopback for tests without ranks: one host, any number of clients."""

import socket
from datetime import timedelta

from torch.distributed import TCPStore


def host_store(timeout: float = 10.0) -> TCPStore:
    """A store server on a free loopback port (deleting it takes the server down)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=timeout))


def client(host: TCPStore, timeout: float = 10.0) -> TCPStore:
    """A connection of its own to ``host``, as a separate process would have."""
    return TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=timeout))
