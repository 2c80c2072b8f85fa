"""A small bounded memo: keep what is costly to rebuild, without growing forever."""

from __future__ import annotations


class BoundedMemo(dict):
    """A dict of at most ``limit`` keys that starts over when full.

    For values a hot path rebuilds per key at a cost of microseconds (tensor
    views over a shared-memory segment, per-response decisions), where a job
    repeats the same few keys: a job that keeps bringing new keys empties the
    memo instead of growing it. ``add(key, value)`` stores and returns ``value``.
    """

    def __init__(self, limit: int = 64):
        super().__init__()
        self.limit = limit

    def add(self, key, value):
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value
