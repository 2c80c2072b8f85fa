"""The job's rendezvous store as one rank sees it: host it or join it.

A :class:`JobStore` belongs to one runtime. When this rank must host the store
(rank 0 under ``mpirun`` or ``srun``), the first :meth:`JobStore.connect`
creates the ``TCPStore`` server on a socket bound to the rendezvous address
only -- ``TCPStore`` alone would listen on every interface -- and later calls
join it as clients. Every connection is wrapped in
:class:`~.store_auth.AuthenticatedStore`, so callers only ever see verified
values under the job's derived key prefix. :meth:`JobStore.close` drops the
server (and with it every key the job wrote).
"""

from __future__ import annotations

import atexit
import datetime
import errno
import os
import socket
from typing import Optional

from . import secret_share
from .errors import HvdlikeInternalError
from .store_auth import AuthenticatedStore
from .topology import Rendezvous, Topology


def listen_socket(addr: str, port: int = 0, backlog: int = 512) -> socket.socket:
    """A TCP socket listening on ``addr`` only (``port`` 0: any free port).

    Raises:
        OSError: the address cannot be bound.
    """
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def serve(addr: str, port: int, world_size: int, timeout: datetime.timedelta):
    """A ``TCPStore`` server listening on ``addr`` only; returns ``(store, port)``.

    Raises:
        OSError: the address cannot be bound.
        RuntimeError: torch could not start the server.
    """
    import torch.distributed as dist

    sock = listen_socket(addr, port)
    port = sock.getsockname()[1]
    try:
        store = dist.TCPStore(addr, port, world_size, True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now and closes it itself
    return store, port


# Beyond the store's own timeout, how long a client connection may take before
# it is given up: the store's timeout bounds each request, not the handshake.
_HANDSHAKE_GRACE_SECONDS = 5.0


def client(addr: str, port: int, world_size: int, timeout: datetime.timedelta):
    """A ``TCPStore`` client of ``addr:port``, given up after ``timeout`` (+ a grace).

    torch's client sends a handshake once connected and waits for the answer
    with no deadline: a port that accepts connections but never answers (not a
    store, or a stopped one) would block the caller for good. The connection is
    made on a daemon thread instead; if it does not finish in time the caller
    gets an error and the thread is left behind, blocked in the socket, until
    the process exits (it holds no lock of the caller's).

    Raises:
        TimeoutError: connected, but no store answered in time.
        OSError, RuntimeError: as ``TCPStore`` raises them.
    """
    import threading

    import torch.distributed as dist

    box: dict = {}

    def connect() -> None:
        try:
            box["store"] = dist.TCPStore(addr, port, world_size, False, timeout=timeout,
                                         wait_for_workers=False)
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc

    worker = threading.Thread(target=connect, name="hvdlike-store-connect", daemon=True)
    worker.start()
    worker.join(timeout.total_seconds() + _HANDSHAKE_GRACE_SECONDS)
    if "error" in box:
        raise box["error"]
    if "store" not in box:
        refused = _refused(addr, port)
        if refused:  # torch's client was still retrying its connection
            raise TimeoutError(f"nothing answered at {addr}:{port} within "
                               f"{timeout.total_seconds():g}s ({refused}): the store is gone "
                               f"or was never there")
        raise TimeoutError(f"{addr}:{port} accepted the connection but did not answer as a "
                           f"store (is it the job's rendezvous port?)")
    return box["store"]


def _refused(addr: str, port: int) -> str:
    """Why a plain TCP connection to ``addr:port`` fails now ("" when it connects)."""
    import socket

    try:
        with socket.create_connection((addr, port), timeout=2.0):
            return ""
    except OSError as exc:
        return exc.strerror or type(exc).__name__


# Servers a runtime on part of the job hosted (init(comm=[ranks]) under srun):
# the ranks of other lists still use them, so they outlive that runtime and are
# reused by this process's next runtime. (addr, port) -> server.
_KEPT_SERVERS: dict = {}


# Secret-file tags removed when this process exits. Registered at import, before
# any runtime's own exit handler, so it runs after them (last in, first out).
_FORGET_AT_EXIT: set = set()


def _forget_at_exit(tag: str) -> None:
    _FORGET_AT_EXIT.add(tag)


if hasattr(os, "register_at_fork"):
    # A child forked from a rank must not remove the files its parent still serves.
    os.register_at_fork(after_in_child=_FORGET_AT_EXIT.clear)


@atexit.register
def _forget_kept_secret_files() -> None:
    for tag in _FORGET_AT_EXIT:
        secret_share.forget(tag)


class JobStore:
    """Connections of one runtime to the job's store (hosting it when asked)."""

    def __init__(self, topology: Topology, rendezvous: Rendezvous, timeout_seconds: float):
        self.topology = topology
        self.rendezvous = rendezvous
        self.timeout_seconds = timeout_seconds
        self._server = None  # the TCPStore server this rank hosts, if any
        # init(comm=[ranks]): other lists' runtimes use this job's store too, so a
        # hosted server stays up after close() (see _KEPT_SERVERS).
        self.keep_server = False
        self._local = None   # the in-process store of a single-process job
        # Every view handed out, held strongly: a PrefixStore or process group
        # keeps only the C++ half of a Python store alive, and the Python half
        # must outlive them for its methods to be found.
        self._views = []
        # An elastic generation's key (see elastic/protocol.py): set, every
        # connection MACs with it as well as with the job secret.
        self.generation_key: Optional[bytes] = None

    def connect(self) -> AuthenticatedStore:
        """A new authenticated connection (the first call of the hosting rank serves).

        Raises:
            HvdlikeInternalError: the store cannot be reached or served in time.
        """
        import torch.distributed as dist

        topo, rdzv = self.topology, self.rendezvous
        timeout = datetime.timedelta(seconds=self.timeout_seconds)
        secret = rdzv.secret or "single-process"
        if topo.size == 1 and not rdzv.addr:
            if self._local is None:
                self._local = dist.HashStore()
            return self._keep(AuthenticatedStore(self._local, secret,
                                                 generation_key=self.generation_key))
        try:
            raw = None
            if rdzv.host_store and topo.rank == 0 and self._server is None:
                raw = self._server = self._serve(timeout)
            if raw is None:
                raw = client(rdzv.addr, rdzv.port, topo.size, timeout)
        except Exception as exc:  # OSError, RuntimeError, DistStoreError, TimeoutError
            raise HvdlikeInternalError(
                f"rank {topo.rank} could not reach the rendezvous store at "
                f"{rdzv.addr}:{rdzv.port} within {self.timeout_seconds:g}s "
                f"({rdzv.launcher}): {exc}") from None
        return self._keep(AuthenticatedStore(raw, secret, generation_key=self.generation_key))

    def _serve(self, timeout: datetime.timedelta):
        """The store this rank 0 serves; None when it must connect to one instead."""
        rdzv = self.rendezvous
        kept = _KEPT_SERVERS.get((rdzv.addr, rdzv.port))
        if kept is not None:
            return kept
        if rdzv.launcher != "torchrun":
            return serve(rdzv.addr, rdzv.port, self.topology.size, timeout)[0]
        # env:// without torchrun's agent (a PyTorchJob running python itself):
        # MASTER_ADDR may name a service rather than this pod's own address, so
        # listen on every interface, as init_process_group("env://") does. When
        # the port is taken, that call ran first and serves the store: use it.
        try:
            return serve("::" if ":" in rdzv.addr else "0.0.0.0", rdzv.port,
                         self.topology.size, timeout)[0]
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            return None

    def _keep(self, view: AuthenticatedStore) -> AuthenticatedStore:
        self._views.append(view)
        return view

    def close(self) -> None:
        """Drop the hosted server, the in-process store and any shared secret file.

        With ``keep_server`` (``init(comm=[...])``) the ranks of other lists may
        not have started yet: they need the server and the secret file as long
        as this process runs, so the file goes when it exits (a process killed
        first leaves it to :func:`.secret_share.sweep`).
        """
        if not self.keep_server:
            self.joined()
        elif self.rendezvous.secret_file_tag and self.topology.rank == 0:
            _forget_at_exit(self.rendezvous.secret_file_tag)
        if self._server is not None and self.keep_server:
            _KEPT_SERVERS[(self.rendezvous.addr, self.rendezvous.port)] = self._server
        self._server = None
        self._local = None
        self._views = []

    @property
    def hosts_server(self) -> bool:
        """Whether this rank hosts the job's store server and drops it when it closes."""
        return self._server is not None and not self.keep_server

    def joined(self) -> None:
        """Every rank has joined: rank 0 removes a secret it shared through a file."""
        if self.rendezvous.secret_file_tag and self.topology.rank == 0:
            secret_share.forget(self.rendezvous.secret_file_tag)
