"""RMSNorm / LayerNorm references computed in float64 (differentiable)."""

import torch


def _h(x, residual):
    h = x.double()
    return h if residual is None else h + residual.double()


def rms_norm_ref(x, weight=None, eps=1e-6, residual=None, bias=None, weight_offset=0.0):
    """RMSNorm of ``x`` (+ residual) over its last dim, times ``weight + weight_offset`` plus
    ``bias``. A 2-D (H, D) weight or bias over x (..., H, D) is per head: each head's D values
    are one row, scaled by that head's weight row (what ``ck.rms_norm`` does)."""
    h = _h(x, residual)
    y = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.double() + weight_offset)
    if bias is not None:
        y = y + bias.double()
    return y


def layer_norm_ref(x, weight=None, bias=None, eps=1e-5, residual=None):
    """LayerNorm over the trailing dims that ``weight`` / ``bias`` cover (the last without)."""
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
