"""``nn.Module`` drop-ins for torch's RMSNorm and LayerNorm (same constructor arguments, same
state_dict keys). On CUDA tensors they run this library's kernels; on other devices they fall
back to torch's implementation."""

from __future__ import annotations

import torch

from .norm_op import layer_norm, rms_norm


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` running :func:`cute_kernels.rms_norm`. ``forward(x, residual=None)``
    returns ``y``, or ``(y, x + residual)`` when a residual is given."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if not x.is_cuda:
            if residual is not None:
                h = x + residual
                return super().forward(h), h
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return rms_norm(x, self.weight, eps, residual)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` running :func:`cute_kernels.layer_norm`. ``forward(x, residual=None)``
    returns ``y``, or ``(y, x + residual)`` when a residual is given."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if not x.is_cuda:
            if residual is not None:
                h = x + residual
                return super().forward(h), h
            return super().forward(x)
        n = 1
        for d in self.normalized_shape:
            n *= d
        if self.weight is None and self.bias is None and x.shape[-len(self.normalized_shape):] != self.normalized_shape:
            raise ValueError(f"x's trailing dims {tuple(x.shape)} do not match {self.normalized_shape}")
        if self.weight is None and self.bias is None and len(self.normalized_shape) > 1:
            x2 = x.reshape(*x.shape[: x.dim() - len(self.normalized_shape)], n)
            r2 = None if residual is None else residual.reshape(x2.shape)
            out = layer_norm(x2, None, None, self.eps, r2)
            return tuple(t.view(x.shape) for t in out) if residual is not None else out.view(x.shape)
        return layer_norm(x, self.weight, self.bias, self.eps, residual)
