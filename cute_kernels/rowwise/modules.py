"""``nn.Module`` drop-ins for torch's RMSNorm, LayerNorm and CrossEntropyLoss (same constructor
arguments, same state_dict keys).

Device rule (the same for every module of the library): a module follows its input's device.
On CUDA tensors it runs this library's kernels; on any other device it computes the same thing
with torch, so a model moved to the CPU keeps working. The functions (``ck.rms_norm``, ...)
never fall back: they raise :class:`~cute_kernels.DeviceError` for a non-CUDA tensor."""

from __future__ import annotations

import torch

from ..runtime import UnsupportedError
from .cross_entropy_op import cross_entropy
from .cross_entropy_terms import torch_cross_entropy
from .norm_op import layer_norm, rms_norm


def _torch_forward(forward, x, residual):
    """The parent module's forward, with the residual add done by torch (non-CUDA inputs)."""
    if residual is None:
        return forward(x)
    h = x + residual
    return forward(h), h


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` running :func:`cute_kernels.rms_norm`. ``forward(x, residual=None)``
    returns ``y``, or ``(y, x + residual)`` when a residual is given."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if not x.is_cuda:
            return _torch_forward(super().forward, x, residual)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        dims = len(self.normalized_shape)
        if dims == 1:
            return rms_norm(x, self.weight, eps, residual)
        # torch normalizes over every dim of normalized_shape: one row of their product.
        if tuple(x.shape[-dims:]) != tuple(self.normalized_shape):
            raise ValueError(f"x's trailing dims {tuple(x.shape)} do not match {self.normalized_shape}")
        flat = (*x.shape[:-dims], -1)
        weight = None if self.weight is None else self.weight.reshape(-1)
        out = rms_norm(x.reshape(flat), weight, eps, None if residual is None else residual.reshape(flat))
        if residual is None:
            return out.view(x.shape)
        return tuple(t.view(x.shape) for t in out)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` running :func:`cute_kernels.layer_norm`. ``forward(x, residual=None)``
    returns ``y``, or ``(y, x + residual)`` when a residual is given."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if not x.is_cuda:
            return _torch_forward(super().forward, x, residual)
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


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """``torch.nn.CrossEntropyLoss`` running :func:`cute_kernels.cross_entropy` (class index
    targets; the class dim is dim 1 of the input, as in torch; per-class ``weight`` as torch's,
    with label smoothing too). Adds ``lse_square_scale``, ``inplace_backward``, ``softcap`` and
    ``return_z_loss`` (:func:`cute_kernels.cross_entropy`'s). Class-probability targets run torch's loss, so
    they are refused with the z-loss or the cap."""

    def __init__(self, weight=None, size_average=None, ignore_index: int = -100, reduce=None,
                 reduction: str = "mean", label_smoothing: float = 0.0,
                 lse_square_scale: float = 0.0, inplace_backward: bool = False,
                 softcap: float | None = None, return_z_loss: bool = False):
        super().__init__(weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        self.lse_square_scale = lse_square_scale
        self.inplace_backward = inplace_backward
        self.softcap = softcap
        self.return_z_loss = return_z_loss

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        plain = not self.lse_square_scale and not self.softcap and not self.return_z_loss
        if target.is_floating_point() and not plain:
            raise UnsupportedError(
                f"class-probability targets ({target.dtype}) with lse_square_scale="
                f"{self.lse_square_scale} / softcap={self.softcap} / return_z_loss="
                f"{self.return_z_loss} are not supported; use class indices")
        if target.is_floating_point() or (not input.is_cuda and plain):
            return super().forward(input, target)
        logits = input.movedim(1, -1) if input.dim() > 2 else input
        if not input.is_cuda:  # torch has no z-loss or cap: the same computation with torch
            return torch_cross_entropy(logits, target, self.ignore_index, self.label_smoothing,
                                       self.reduction, self.lse_square_scale, self.weight,
                                       self.softcap, self.return_z_loss)
        return cross_entropy(logits, target, self.ignore_index, self.label_smoothing,
                             self.reduction, self.lse_square_scale, self.inplace_backward,
                             self.weight, self.softcap, self.return_z_loss)
