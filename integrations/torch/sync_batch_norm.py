"""Batch normalization over the global batch: ``SyncBatchNorm``.

In training mode each rank computes, per channel, its element count, mean
and sum of squared deviations (M2), and all ranks allgather those rows. The
rows combine exactly (Chan et al.'s parallel variance), even when ranks hold
different batch sizes, so the forward normalizes with the statistics of the
concatenated batch -- without the cancellation of ``E[x^2] - E[x]^2``.

The backward needs two per-channel sums over the global batch (of ``dy`` and
of ``dy * x_hat``): one allreduce. The weight and bias gradients stay local
sums, like every other parameter's, and ``DistributedOptimizer`` averages
them; the input gradient is that of the sum of all ranks' losses, as in
``torch.nn.SyncBatchNorm``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from hvdlike.core import current
from hvdlike.core.process_sets import global_process_set

from . import ops

def _channels_last_2d(x: torch.Tensor) -> torch.Tensor:
    """``(N, C, *)`` -> ``(C, N * prod(*))``."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Shape a ``(C,)`` vector to broadcast against ``x`` of shape ``(N, C, *)``."""
    return v.reshape((1, -1) + (1,) * (x.dim() - 2))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set,
                name):
        channels = x.shape[1]
        flat = _channels_last_2d(x.detach()).to(torch.float64)
        count = flat.shape[1]
        mean = flat.mean(1) if count else flat.new_zeros(channels)
        m2 = ((flat - mean[:, None]) ** 2).sum(1)
        row = torch.cat([flat.new_tensor([float(count)]), mean, m2]).unsqueeze(0)
        rows = ops.allgather(row, name=f"{name}.stats", process_set=process_set)
        counts = rows[:, 0]
        total = counts.sum()
        if total <= 1:
            raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel over all "
                             f"ranks in training mode, got input of shape {tuple(x.shape)} "
                             f"and {int(total.item())} value(s) in total")
        means, m2s = rows[:, 1:channels + 1], rows[:, channels + 1:]
        global_mean = (counts[:, None] * means).sum(0) / total
        global_m2 = (m2s + counts[:, None] * (means - global_mean) ** 2).sum(0)
        var = global_m2 / total
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                unbiased = global_m2 / (total - 1)
                running_mean.mul_(1 - momentum).add_(global_mean.to(running_mean.dtype),
                                                     alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype),
                                                    alpha=momentum)
        mean_x = _per_channel(global_mean.to(x.dtype), x)
        invstd_x = _per_channel(invstd.to(x.dtype), x)
        x_hat = (x - mean_x) * invstd_x
        out = x_hat
        if weight is not None:
            out = out * _per_channel(weight, x)
        if bias is not None:
            out = out + _per_channel(bias, x)
        ctx.save_for_backward(x_hat, weight, invstd_x)
        ctx.total = float(total.item())
        ctx.process_set = process_set
        ctx.name = name
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, dy):
        x_hat, weight, invstd_x = ctx.saved_tensors
        # Half-precision sums over a batch overflow (65504 in float16): sum,
        # reduce and combine in float32, as torch's own batch norm kernels do.
        work = torch.float32 if dy.dtype in (torch.float16, torch.bfloat16) else dy.dtype
        dy_w, x_hat = dy.to(work), x_hat.to(work)
        dims = [0] + list(range(2, dy.dim()))
        sum_dy = dy_w.sum(dims)
        sum_dy_xhat = (dy_w * x_hat).sum(dims)
        grad_x = None
        if ctx.needs_input_grad[0]:
            both = ops.allreduce(torch.cat([sum_dy, sum_dy_xhat]), name=f"{ctx.name}.grad",
                                 op=ops.Sum, process_set=ctx.process_set)
            g_dy, g_dy_xhat = both.chunk(2)
            w = _per_channel(weight.to(work), dy) if weight is not None else 1.0
            grad_x = (w * invstd_x.to(work)) * (
                dy_w - _per_channel(g_dy, dy) / ctx.total
                - x_hat * _per_channel(g_dy_xhat, dy) / ctx.total)
            grad_x = grad_x.to(dy.dtype)
        grad_w = (sum_dy_xhat.to(weight.dtype)
                  if weight is not None and ctx.needs_input_grad[1] else None)
        grad_b = sum_dy.to(ctx.bias_dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization whose training statistics span all ranks' batches.

    Same arguments and behaviour as ``torch.nn.BatchNorm*d`` / ``torch.nn.SyncBatchNorm``
    for inputs ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)`` or ``(N, C, D, H, W)``;
    ranks may have different ``N``. Evaluation mode uses the running
    statistics and communicates nothing.

    Args:
        num_features: number of channels ``C``.
        eps, momentum, affine, track_running_stats: as in ``torch.nn.BatchNorm2d``.
        process_set: synchronize within this process set.
        name: base name of this layer's collectives; defaults to a number
            assigned at construction, so build layers in the same order on
            every rank.

    Example:
        >>> model = hvd.SyncBatchNorm.convert_sync_batchnorm(model)
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set=global_process_set, device=None, dtype=None,
                 name: Optional[str] = None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_set = process_set
        self.sync_name = name if name is not None else f"SyncBatchNorm.{current.instance_number('SyncBatchNorm')}"

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of at least 2 dimensions "
                             f"(N, C, ...), got {input.dim()}D")
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) got an input with "
                             f"{input.shape[1]} channels")

    def _synchronizes(self) -> bool:
        # Batch statistics are used -- and shared -- in training and, without
        # running statistics, in eval mode too (as Horovod's layer does; torch's
        # own SyncBatchNorm keeps eval-mode batch statistics local).
        return ((self.training or self.running_mean is None) and current.get() is not None
                and self.process_set.size() > 1)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        if not self._synchronizes():
            use_batch = self.training or self.running_mean is None
            return F.batch_norm(
                input,
                self.running_mean if not self.training or self.track_running_stats else None,
                self.running_var if not self.training or self.track_running_stats else None,
                self.weight, self.bias, use_batch, factor, self.eps)
        running = self.track_running_stats
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, self.running_mean if running else None,
            self.running_var if running else None, self.eps, factor, self.process_set,
            self.sync_name)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module,
                               process_set=global_process_set) -> torch.nn.Module:
        """Return ``module`` with every ``BatchNorm*d`` replaced by a :class:`SyncBatchNorm`.

        Parameters and running statistics are carried over; the layers are
        numbered in module order, which is the same on every rank.
        """
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, process_set=process_set)
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.train(module.training)
        for child_name, child in module.named_children():
            out.add_module(child_name, cls.convert_sync_batchnorm(child, process_set))
        return out
