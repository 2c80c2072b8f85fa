"""The job secret and what is derived from it (no torch needed: the launcher uses it too).

The secret itself is only ever a MAC key. Store key prefixes, the key of store
value MACs and public job tags are one-way derivations of it, separated by a
label, so none of them helps to recover the secret or another derivation.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from .errors import HvdlikeInternalError


class StoreTamperedError(HvdlikeInternalError):
    """A value read from the rendezvous store failed authentication."""

    def __init__(self, key: str, why: str):
        super().__init__(
            f"the rendezvous store was tampered with: key {key!r} {why}; the value was "
            "not used (someone without the job secret -- or, in an elastic job, without "
            "this generation's key -- wrote into the job's store)")
        self.key = key


def new_secret() -> str:
    """An unguessable job secret (128 bits, hex)."""
    return secrets.token_hex(16)


def derive(secret: str, label: str) -> bytes:
    """A one-way function of the secret, separated by ``label``."""
    if not secret:
        raise HvdlikeInternalError("no job secret: cannot derive store keys")
    return hmac.new(secret.encode(), b"hvdlike derive\0" + label.encode(), hashlib.sha256).digest()


def key_prefix(secret: str) -> str:
    """The prefix of every store key of the job; reveals nothing about the secret."""
    return f"hvdlike/{derive(secret, 'key prefix').hex()[:24]}/"


def job_tag(secret: str) -> str:
    """A short public name of the job (shared-memory segment names, logs)."""
    return derive(secret, "job tag").hex()[:16]


