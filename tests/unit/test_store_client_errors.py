"""What a rank is told when the store it was given does not answer in time."""

import datetime
import socket
import threading

import pytest
import torch.distributed as dist

from hvdlike.core import job_store


@pytest.fixture
def stuck_client(monkeypatch):
    """torch's client never finishing (its retries outlast the deadline)."""
    release = threading.Event()

    def never(*args, **kwargs):
        release.wait(30)
        raise RuntimeError("released")

    monkeypatch.setattr(dist, "TCPStore", never)
    monkeypatch.setattr(job_store, "_HANDSHAKE_GRACE_SECONDS", 0.0)
    yield
    release.set()


def test_a_port_nothing_listens_on_is_not_called_a_port_that_accepted(stuck_client):
    with socket.socket() as probe:  # a port that was free a moment ago, now closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(TimeoutError) as info:
        job_store.client("127.0.0.1", port, 2, datetime.timedelta(seconds=0.2))
    assert f"nothing answered at 127.0.0.1:{port} within 0.2s (Connection refused)" in \
        str(info.value)
    assert "accepted" not in str(info.value)


def test_a_port_that_accepts_but_is_not_a_store_is_named_so(stuck_client):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        with pytest.raises(TimeoutError, match="accepted the connection but did not answer"):
            job_store.client("127.0.0.1", port, 2, datetime.timedelta(seconds=0.2))
