"""GEMM references computed in float64."""

import torch


def gemm_ref(a, b, bias=None, alpha=1.0, beta=0.0, c=None):
    """``alpha * a @ b + beta * c + bias`` in float64 (any batch dims torch broadcasts)."""
    out = alpha * (a.double() @ b.double())
    if c is not None:
        out = out + beta * c.double()
    if bias is not None:
        out = out + bias.double()
    return out
