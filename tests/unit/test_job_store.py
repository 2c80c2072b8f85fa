"""The rendezvous store connection: bounded even when the port never answers."""

import socket
import threading

import pytest

from hvdlike.core import bootstrap
from hvdlike.core.errors import HvdlikeInternalError
from hvdlike.core.job_store import JobStore


@pytest.fixture
def silent_port():
    """A port that accepts every connection and never sends a byte."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    held, stop = [], threading.Event()

    def accept() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield sock.getsockname()[1]
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    sock.close()


@pytest.mark.timeout(60)
def test_a_port_that_accepts_but_never_answers_fails_the_connect(silent_port):
    topo = bootstrap.Topology(rank=1, size=2)
    rdzv = bootstrap.Rendezvous(launcher="torchrun", addr="127.0.0.1", port=silent_port,
                                secret="s", host_store=False)
    job_store = JobStore(topo, rdzv, 1)
    try:
        with pytest.raises(HvdlikeInternalError) as info:
            job_store.connect()
    finally:
        job_store.close()
    message = str(info.value)
    assert f"127.0.0.1:{silent_port}" in message and "rank 1" in message
