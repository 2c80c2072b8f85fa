"""Authenticated pickles for ``hvdlike.run``: the function going out, results coming back.

Unpickling runs code, so nothing is unpickled unless it carries an HMAC-SHA256
under the job secret. The MAC covers a purpose label (``payload``, or
``result/<rank>``) as well as the bytes, so a result cannot pose as the payload
or as another rank's result, and a blob sealed for one job (one secret) is
refused by every other job. Blobs travel through the job's authenticated store
view (keys under the derived prefix, values signed again there, bound to their
key), and the MAC key is derived from the secret, never the secret itself.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Optional

PAYLOAD_KEY = "launcher/run/payload"
# The largest payload or result the store carries for hvdlike.run; a reader
# refuses anything bigger before checking or unpickling it.
MAX_BLOB_BYTES = 1 << 30
# The store's server refuses a message above 8 MiB, so bigger blobs travel as
# pieces of this size under "<key>/<i>", with a marker under the key itself.
CHUNK_BYTES = 4 << 20
CHUNKED = b"hvdlike.run/chunked\0"
VERSION = b"hvdlike.run/1"


class PayloadError(Exception):
    """A blob failed authentication or is malformed: it was not unpickled."""


def result_key(rank: int, generation: Optional[int] = None) -> str:
    """Where rank ``rank`` files its outcome (per generation in an elastic job)."""
    if generation is None:
        return f"launcher/run/result/{rank}"
    return f"launcher/run/result/{generation}/{rank}"


def result_purpose(rank: int, generation: Optional[int] = None) -> str:
    """What an outcome is sealed for: a blob moved to another key does not unseal."""
    return f"result/{rank}" if generation is None else f"result/{generation}/{rank}"


def refusal_key(rank: int, generation: Optional[int] = None) -> str:
    """Where rank ``rank`` records that it refused the payload (it failed
    authentication), so the caller tells a refusal from a function's own exit status."""
    if generation is None:
        return f"launcher/run/refused/{rank}"
    return f"launcher/run/refused/{generation}/{rank}"


def refusal_purpose(rank: int, generation: Optional[int] = None) -> str:
    return f"refused/{rank}" if generation is None else f"refused/{generation}/{rank}"


# A rank's outcome carries its return value, and the exception its function
# raised, pickled on their own inside it: the caller unpickles the outcome (plain
# text and numbers) first, so a value or exception that does not unpickle there
# is reported as such, with the rank's message and traceback intact.
VALUE_PICKLE = "value_pickle"
EXCEPTION_PICKLE = "exception_pickle"


def _mac(secret: str, purpose: str, data: bytes) -> bytes:
    from hvdlike.core.job_secret import derive

    mac = hmac.new(derive(secret, "hvdlike.run payload"), VERSION + b"\0", hashlib.sha256)
    mac.update(purpose.encode() + b"\0")
    mac.update(data)  # no copy of a large blob
    return mac.digest()


def seal(secret: str, purpose: str, obj: Any) -> bytes:
    """Pickle ``obj`` with cloudpickle and prefix the MAC (32 bytes)."""
    import cloudpickle

    if not secret:
        raise PayloadError("no job secret: cannot authenticate the payload")
    data = cloudpickle.dumps(obj)
    return _mac(secret, purpose, data) + data


def verify(secret: str, purpose: str, blob: bytes) -> memoryview:
    """The pickled bytes of a blob made by :func:`seal`, once its MAC matches
    (not unpickled: what fails to unpickle is then told apart from a forgery).

    Raises:
        PayloadError: missing secret, truncated blob, or a MAC that does not match
            (forged, altered, sealed for another job or another purpose).
    """
    if not secret:
        raise PayloadError("no job secret: refusing to unpickle an unauthenticated payload")
    if len(blob) < 32:
        raise PayloadError(f"{purpose}: truncated blob ({len(blob)} bytes)")
    view = memoryview(blob)
    mac, data = bytes(view[:32]), view[32:]
    if not hmac.compare_digest(mac, _mac(secret, purpose, data)):
        raise PayloadError(f"{purpose}: authentication failed; refusing to unpickle it")
    return data


def unseal(secret: str, purpose: str, blob: bytes) -> Any:
    """Verify and unpickle a blob made by :func:`seal`.

    Raises:
        PayloadError: as :func:`verify`; nothing is unpickled then.
        Exception: whatever unpickling the authentic bytes raises (a module this
            process cannot import, a class whose ``__reduce__`` fails here, ...).
    """
    import pickle

    return pickle.loads(verify(secret, purpose, blob))


def put(store, key: str, blob: bytes) -> None:
    """Store ``blob`` under ``key``, in pieces when it is bigger than one store message.

    The pieces go first and the marker naming them last, so a reader that sees
    ``key`` finds every piece in place.

    Raises:
        PayloadError: ``blob`` is bigger than :data:`MAX_BLOB_BYTES`.
    """
    if len(blob) > MAX_BLOB_BYTES:
        raise PayloadError(f"{len(blob)} bytes pickled, more than the {MAX_BLOB_BYTES} "
                           f"bytes hvdlike.run carries")
    if len(blob) <= CHUNK_BYTES:
        store.set(key, blob)
        return
    pieces = (len(blob) + CHUNK_BYTES - 1) // CHUNK_BYTES
    for i in range(pieces):
        store.set(f"{key}/{i}", blob[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES])
    store.set(key, CHUNKED + f"{pieces} {len(blob)}".encode())


def get(store, key: str) -> bytes:
    """The blob :func:`put` stored under ``key`` (its MAC is still to be checked).

    Raises:
        PayloadError: the marker is malformed or the pieces do not add up.
    """
    head = bytes(store.get(key))
    if not head.startswith(CHUNKED):
        return head
    try:
        pieces, total = (int(part) for part in head[len(CHUNKED):].decode().split())
    except ValueError:
        raise PayloadError(f"{key}: malformed piece count") from None
    if not 0 < total <= MAX_BLOB_BYTES or pieces != (total + CHUNK_BYTES - 1) // CHUNK_BYTES:
        raise PayloadError(f"{key}: {pieces} piece(s) of {total} bytes is not a valid blob")
    blob = b"".join(bytes(store.get(f"{key}/{i}")) for i in range(pieces))
    if len(blob) != total:
        raise PayloadError(f"{key}: the pieces hold {len(blob)} bytes, not {total}")
    return blob
