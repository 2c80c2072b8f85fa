"""The store keys of one runtime generation, and their removal when it ends.

Every part of a runtime writes under the generation's prefix (``gen<N>/``):
Gloo's and NCCL's rendezvous records, the shared-memory exchange, the health
watcher's heartbeats and reports. The store outlives the runtime (the
launcher hosts it for the whole job), so a process that re-forms or calls
``init()``/``shutdown()`` many times would pile keys up without end.

:class:`KeyLog` is the store every part of a runtime writes through; it
remembers each key written. At a clean close, :func:`forget` runs a last
exchange: every other rank publishes the keys it wrote, and rank 0, once it
holds every list (every rank has stopped using the generation), deletes them
all, the lists included. After a failure the generation's keys stay behind
(the job is ending anyway); a new generation never reads an old one's keys.
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import List, Optional

import torch.distributed as dist

_KEYS = "closed/keys/"
_CLOSED = "closed/count"  # ranks that published their lists (see forget)


class KeyLog(dist.Store):
    """The keys under ``prefix`` of the Python store ``inner``, remembering those written.

    Keys are prefixed here, in Python, and recorded exactly as ``inner`` gets
    them, so :func:`forget` can delete them through ``inner`` (a C++
    ``PrefixStore`` cannot pass ``delete_key`` on to a store written in Python).
    Keep a Python reference to it while anything built on it lives: a
    ``PrefixStore`` or process group holds only its C++ half.
    """

    def __init__(self, inner, prefix: str, publish: Optional[str] = None):
        super().__init__()
        self._inner = inner
        self._prefix = prefix
        self._keys = set()
        self._lock = threading.Lock()
        # Elastic generations: the list of keys written so far is kept in the
        # store under this key (itself included), so the keys of a generation
        # that ended in a failure -- no clean close, maybe a dead writer --
        # can still be found and deleted (see elastic/protocol.forget_generation).
        self._publish = prefix + publish if publish else None

    @property
    def inner(self):
        """The connection this log writes through."""
        return self._inner

    @property
    def prefix(self) -> str:
        """The generation's prefix, which every recorded key starts with."""
        return self._prefix

    def written(self) -> List[str]:
        with self._lock:
            return sorted(self._keys)

    def _note(self, key: str) -> str:
        full = self._prefix + key
        with self._lock:
            new = full not in self._keys
            self._keys.add(full)
            if new and self._publish:  # under the lock: lists are written in order
                self._keys.add(self._publish)
                self._inner.set(self._publish, json.dumps(sorted(self._keys)))
        return full

    def note(self, key: str) -> None:
        """Record ``key`` (below the prefix), written through another connection
        of the same store: it is deleted with the keys written here."""
        self._note(key)

    def take(self, part: str) -> List[str]:
        """Stop recording the keys written under ``part`` (a path below the
        prefix, such as a removed process set's ``ps<id>/``) and return them:
        whoever takes them deletes them (see :func:`forget_part`)."""
        start = self._prefix + part
        with self._lock:
            taken = sorted(key for key in self._keys if key.startswith(start))
            self._keys.difference_update(taken)
            if taken and self._publish:
                self._inner.set(self._publish, json.dumps(sorted(self._keys)))
        return taken

    def set(self, key: str, value) -> None:
        self._inner.set(self._note(key), value)

    def get(self, key: str) -> bytes:
        return self._inner.get(self._prefix + key)

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(self._note(key), amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._inner.compare_set(self._note(key), expected, desired)

    def check(self, keys: List[str]) -> bool:
        return self._inner.check([self._prefix + k for k in keys])

    def wait(self, keys: List[str], timeout: Optional[timedelta] = None) -> None:
        full = [self._prefix + k for k in keys]
        if timeout is None:
            self._inner.wait(full)
        else:
            self._inner.wait(full, timeout)

    def delete_key(self, key: str) -> bool:
        full = self._prefix + key
        with self._lock:
            self._keys.discard(full)
        return self._inner.delete_key(full)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def has_extended_api(self) -> bool:
        return False

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self._inner.timeout


def forget(store, prefix: str, logs: List[KeyLog], rank: int, size: int) -> bool:
    """Publish this rank's keys of the generation; the last rank to do so deletes them all.

    Call once per rank, after the rank stopped touching the generation (its
    groups are closed and its health watcher has stopped). Every rank counts
    itself in after publishing its list; the one that completes the count
    knows every other rank has stopped touching the generation too, reads
    the lists and deletes every key. No rank waits for another here: a rank
    whose script goes on computing after the job's last collective does not
    hold up the others' exit. (Only a rank that hosts the store server waits
    for the last closer afterwards, see :func:`wait_closed`; its launcher,
    mpirun or srun, waits for every rank anyway.) A rank that never gets
    here (it died) leaves the keys in the store.

    Args:
        store: the Python store the logs wrote to (keys as the logs recorded them).
        prefix: the generation's prefix (the lists are published under it too).
        logs: the logs this rank's parts wrote through.
        rank, size: this rank and the number of ranks in the generation.

    Returns:
        True on the rank that deleted the keys.
    """
    keys = sorted({key for log in logs for key in log.written()})
    mine = f"{prefix}{_KEYS}{rank}"
    store.set(mine, json.dumps(keys))
    counter = f"{prefix}{_CLOSED}"
    if store.add(counter, 1) < size:
        return False
    everything = set(keys)
    for other in range(size):
        name = f"{prefix}{_KEYS}{other}"
        # Counted in, so published -- unless something else removed it since:
        # never wait for it (a blocking read would hold this rank's exit for
        # the store's whole timeout).
        if other != rank and store.check([name]):
            everything.update(json.loads(store.get(name)))
        everything.add(name)
    everything.discard(counter)
    for key in sorted(everything):
        store.delete_key(key)
    store.delete_key(counter)  # last: gone, it says this rank is done with the store
    return True


class _Taken:
    """Keys taken out of a :class:`KeyLog`, shown to :func:`forget` as a log."""

    def __init__(self, keys: List[str]):
        self._keys = keys

    def written(self) -> List[str]:
        return list(self._keys)


def forget_part(log: KeyLog, part: str, rank: int, size: int) -> bool:
    """:func:`forget` for one part of a generation that ends before it does: the
    keys written under ``part`` (see :meth:`KeyLog.take`) by its ``size``
    members, ``rank`` being this one's number among them.

    A process set added and removed many times would otherwise leave its
    rendezvous and shared-memory records in the store until the runtime
    closes. Call once per member, after it stopped using the part (the set's
    groups are closed); the last member to do so deletes every member's keys.

    Returns:
        True on the member that deleted the keys.
    """
    return forget(log.inner, log.prefix + part, [_Taken(log.take(part))], rank, size)


def wait_closed(store, prefix: str, seconds: float, poll: float = 0.02) -> bool:
    """Wait (at most ``seconds``) until the last rank of the generation has
    finished :func:`forget` -- every rank is done with the store; True if it did.

    For the rank that hosts the store server (mpirun, srun) and is not the
    last closer: dropping the server under a peer still deleting keys, or
    still counting itself in, fills that peer's stderr with torch's
    broken-connection warnings. The launcher waits for every rank anyway.
    """
    import time

    counter = f"{prefix}{_CLOSED}"
    deadline = time.monotonic() + seconds
    while store.check([counter]):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)
    return True
