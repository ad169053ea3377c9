"""RMSNorm / LayerNorm references computed in float64 (differentiable)."""

import torch


def _h(x, residual):
    h = x.double()
    return h if residual is None else h + residual.double()


def rms_norm_ref(x, weight=None, eps=1e-6, residual=None):
    h = _h(x, residual)
    n_dims = 1 if weight is None else weight.dim()
    dims = tuple(range(-n_dims, 0))
    y = h * torch.rsqrt(h.pow(2).mean(dim=dims, keepdim=True) + eps)
    return y if weight is None else y * weight.double()


def layer_norm_ref(x, weight=None, bias=None, eps=1e-5, residual=None):
    h = _h(x, residual)
    affine = weight if weight is not None else bias
    n_dims = 1 if affine is None else affine.dim()
    dims = tuple(range(-n_dims, 0))
    mean = h.mean(dim=dims, keepdim=True)
    var = (h - mean).pow(2).mean(dim=dims, keepdim=True)
    y = (h - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    return y
