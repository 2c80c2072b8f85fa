"""The compressor interface every front end shares (no framework in it).

A compressor is any object with ``compress(value) -> (value, ctx)`` and
``decompress(value, ctx) -> value``; each front end adds the casting ones for
its own array type (``hvdlike.torch.Compression``, ``hvdlike.keras.Compression``).
"""

from __future__ import annotations


class Compressor:
    """Interface: shrink a value before communication and restore it after."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send values as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor
