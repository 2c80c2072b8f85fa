"""Stores for tests without ranks: a TCPStore on loopback (one host, any number of
clients), and a dict with the calls the runtime's key logs make."""

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


class DictStore:
    """The store calls the key logs make, on a dict; a read of a missing key fails at
    once (the real store blocks for its whole timeout, then fails)."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        if key not in self.data:
            raise TimeoutError(f"would wait the store's timeout for {key!r}")
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def add(self, key, amount):
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def delete_key(self, key):
        return self.data.pop(key, None) is not None
