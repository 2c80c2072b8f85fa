"""Gradient compression for allreduce: none, fp16, bf16, or your own.

A compressor is any object with ``compress(tensor) -> (tensor, ctx)`` and
``decompress(tensor, ctx) -> tensor``; subclass :class:`Compressor` to write
one and pass it as ``compression=`` to ``allreduce`` or
``DistributedOptimizer``.
"""

from __future__ import annotations

import torch

from hvdlike.frontend.compression import Compressor, NoneCompressor

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class _CastCompressor(Compressor):
    wire = torch.float16

    @classmethod
    def compress(cls, tensor):
        if tensor.is_floating_point() and tensor.dtype != cls.wire:
            return tensor.to(cls.wire), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Send floating-point tensors as float16, restore their dtype after."""

    wire = torch.float16


class BF16Compressor(_CastCompressor):
    """Send floating-point tensors as bfloat16 (wider range than float16)."""

    wire = torch.bfloat16


class Compression:
    """The built-in compressors, as Horovod names them."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
