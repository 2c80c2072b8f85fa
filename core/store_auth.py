"""The job secret, and the authenticated view of the rendezvous store.

``TCPStore`` has no access control: anybody who can reach its port can list,
read, write and delete keys. hvdlike therefore never lets the job secret reach
the store. The secret only keys two one-way derivations:

* the **key prefix** every key of the job lives under
  (``hvdlike/<HMAC(secret, "key prefix")[:24 hex]>/``) -- stable for the job,
  useless for recovering the secret;
* the **MAC key** of every value: :class:`AuthenticatedStore` stores
  ``MAGIC || HMAC-SHA256(mac key, full key || value) || value`` and checks it on
  every read, so a value is bound to the exact key (which carries the
  generation, the process set and the record's name) and to the job.

An elastic job's generations each have a random key of their own, which the
launcher hands only to that generation's members (:mod:`.elastic.protocol`):
the runtime keys of a generation are MACed with it too, so a process removed
from the job -- which still knows the job secret -- cannot write anything a
later generation accepts.

A value that is unsigned, truncated, oversized, forged, or copied from another
key, generation or job raises :class:`StoreTamperedError` naming the key; it is
never returned. Gloo's own rendezvous records (peer addresses) go through the
same view, so a forged address never reaches Gloo.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import timedelta
from typing import List, Optional

import torch.distributed as dist

from .errors import HvdlikeInternalError
from .job_secret import (  # noqa: F401 - re-exported
    StoreTamperedError, derive, job_tag, key_prefix, new_secret,
)

MAGIC = b"hvs1"
_MAC_BYTES = 32
_HEADER = len(MAGIC) + _MAC_BYTES
# The largest value a runtime record may have. Bigger values are refused
# before their MAC is even computed: nothing hvdlike writes comes close.
DEFAULT_MAX_VALUE_BYTES = 1 << 20


class AuthenticatedStore(dist.Store):
    """A ``Store`` that signs what it writes and verifies what it reads.

    Keep a Python reference to it for as long as anything built on it lives:
    ``PrefixStore`` and process groups hold only its C++ half.

    Wraps the raw ``TCPStore`` client (or a ``HashStore``): keys get the job's
    derived prefix; values carry a MAC over the full key. It can be wrapped in
    ``PrefixStore`` and handed to ``ProcessGroupGloo`` like any store.

    Args:
        inner: the store connection to use.
        secret: the job secret (kept only as derived keys).
        max_value_bytes: values longer than this are refused on read.
    """

    def __init__(self, inner, secret: str, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
                 generation_key: Optional[bytes] = None):
        super().__init__()
        self._inner = inner
        self._secret = secret
        self._prefix = key_prefix(secret)
        self._mac_key = derive(secret, "value mac")
        if generation_key is not None:
            # An elastic generation's view: only holders of the generation's
            # key (its members and the launcher) can write what it reads.
            self._mac_key = hmac.new(self._mac_key, b"generation\0" + generation_key,
                                     hashlib.sha256).digest()
        self.max_value_bytes = max_value_bytes

    def for_generation(self, generation_key: Optional[bytes]) -> "AuthenticatedStore":
        """A view of the same connection whose values are MACed with an elastic
        generation's key as well as the job secret (None: the job's view)."""
        return AuthenticatedStore(self._inner, self._secret, self.max_value_bytes, generation_key)

    # -- helpers ---------------------------------------------------------------------

    @property
    def prefix(self) -> str:
        return self._prefix

    def _full(self, key: str) -> str:
        return self._prefix + key

    def _mac(self, key: str, value: bytes) -> bytes:
        message = MAGIC + key.encode() + b"\0" + value
        return hmac.new(self._mac_key, message, hashlib.sha256).digest()

    def seal(self, key: str, value) -> bytes:
        """The stored form of ``value`` under ``key`` (key without the job prefix)."""
        value = value.encode() if isinstance(value, str) else bytes(value)
        return MAGIC + self._mac(key, value) + value

    def open(self, key: str, blob: bytes, limit: Optional[int] = None) -> bytes:
        """Verify a stored form read from ``key``; return the value or raise."""
        limit = self.max_value_bytes if limit is None else limit
        if len(blob) > limit + _HEADER:
            raise StoreTamperedError(key, f"holds {len(blob)} bytes, more than the "
                                          f"{limit} a value of it may have")
        if len(blob) < _HEADER or not blob.startswith(MAGIC):
            raise StoreTamperedError(key, "holds a value hvdlike did not write (no signature)")
        mac, value = blob[len(MAGIC):_HEADER], blob[_HEADER:]
        if not hmac.compare_digest(mac, self._mac(key, value)):
            raise StoreTamperedError(key, "holds a value whose signature does not match "
                                          "(forged, altered, or copied from another key, "
                                          "generation or job)")
        return value

    # -- the Store interface -------------------------------------------------------------

    def set(self, key: str, value) -> None:
        self._inner.set(self._full(key), self.seal(key, value))

    def get(self, key: str) -> bytes:
        return self.open(key, bytes(self._inner.get(self._full(key))))

    def get_limited(self, key: str, limit: int) -> bytes:
        """``get`` with a size limit other than the store's default (large payloads)."""
        return self.open(key, bytes(self._inner.get(self._full(key))), limit)

    def add(self, key: str, amount: int) -> int:
        """Authenticated counter: a signed decimal updated by compare-and-set."""
        full = self._full(key)
        while True:
            exists = self._inner.check([full])
            current = bytes(self._inner.get(full)) if exists else b""
            # An existing key is verified even when empty: a blank written by
            # someone else must not reset the counter.
            value = int(self.open(key, current, 64).split(b":")[0]) if exists else 0
            if amount == 0:
                return value
            # A nonce makes every write unique, so a client whose compare-and-set
            # lost the race never mistakes the winner's value for its own.
            new = self.seal(key, f"{value + amount}:{secrets.token_hex(8)}")
            expected = current
            if bytes(self._inner.compare_set(full, expected, new)) == new:
                return value + amount

    def check(self, keys: List[str]) -> bool:
        return self._inner.check([self._full(k) for k in keys])

    def wait(self, keys: List[str], timeout: Optional[timedelta] = None) -> None:
        full = [self._full(k) for k in keys]
        if timeout is None:
            self._inner.wait(full)
        else:
            self._inner.wait(full, timeout)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(self._full(key))

    def compare_set(self, key: str, expected, desired) -> bytes:
        raise HvdlikeInternalError("compare_set is not offered by the authenticated store; "
                                   "use add() for counters")

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self._inner.timeout
