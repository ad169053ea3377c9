"""int8 quantization and int8 GEMM references.

``quantize_int8_ref`` is the exact rule the quantize kernels follow, in float32 torch
operations (so a kernel can match it bit for bit): one IEEE division per row (the inverse
scale), then a multiply and a round half to even per element; ``gemm_int8_ref`` is float64.
"""

import torch


def int8_range_scale(x, dims, symmetric: bool):
    """(scale, inverse, lo) of the reduction over ``dims`` (kept as size 1) of float32 ``x``.

    The range always includes 0: ``hi = max(x, 0)``, ``lo = min(x, 0)``. Symmetric:
    ``max(hi, -lo) / 127``; asymmetric: ``(hi - lo) / 255``. NaN where the slice holds a NaN
    or an infinity. ``inverse``: ``1 / scale`` (IEEE), or 1 where the scale is 0."""
    hi = x.amax(dim=dims, keepdim=True).clamp_min(0)
    lo = x.amin(dim=dims, keepdim=True).clamp_max(0)
    finite = torch.isfinite(x).all(dim=dims, keepdim=True)
    # Divided by a tensor: torch turns a division by a Python number into a multiplication
    # by its reciprocal, which rounds differently from the IEEE quotient the kernels take.
    levels = torch.full_like(hi, 127.0 if symmetric else 255.0)
    scale = (torch.maximum(hi, -lo) if symmetric else hi - lo) / levels
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale)
    return scale, torch.ones_like(divisor) / divisor, lo


def int8_codes(x, inverse, lo, symmetric: bool):
    """(q int8, zero int32 or None): ``rint(x * inverse)`` (NaN -> 0) saturated to
    [-127, 127]; asymmetric: plus the zero point ``-128 - rint(lo * inverse)`` (``rint(..)``
    saturated to [-255, 0]), saturated to [-128, 127]. (The saturation matters only where the
    inverse of a tiny scale overflows to infinity.)"""
    def rint(t, low, high):
        return torch.round(t).nan_to_num(nan=0.0).clamp(low, high).to(torch.int32)

    if symmetric:
        return rint(x * inverse, -127, 127).to(torch.int8), None
    codes = rint(x * inverse, -256, 255)
    zero = -128 - rint(lo * inverse, -255, 0)
    return (codes + zero).clamp(-128, 127).to(torch.int8), zero


def quantize_int8_ref(x, granularity: str = "row", symmetric: bool = True):
    """(q, scale, zero_point or None) with the scales shaped for broadcasting against x:
    "row" -> (*x.shape[:-1], 1), "column" (2-D x) -> (1, N), "tensor" -> ()."""
    xf = x.float()
    dims = {"row": (-1,), "column": (0,), "tensor": tuple(range(x.dim()))}[granularity]
    scale, inverse, lo = int8_range_scale(xf, dims, symmetric)
    q, zero = int8_codes(xf, inverse, lo, symmetric)
    if granularity == "tensor":
        scale = scale.reshape(())
        zero = None if zero is None else zero.reshape(())
    return q, scale, zero


def dequantize_int8_ref(q, scale, zero_point=None):
    """``(q - zero_point) * scale`` in float64."""
    centered = q.double() - (0 if zero_point is None else zero_point.double())
    return centered * scale.double()


def gemm_int8_ref(a_q, b_q, scale_a=None, scale_b=None, zero_point_a=None, bias=None):
    """``scale_a[:, None] * scale_b[None, :] * ((a_q - zero_point_a[:, None]) @ b_q.T) + bias``
    in float64; a_q (M, K), b_q (N, K); absent scales are 1, an absent zero point 0."""
    a = a_q.double()
    if zero_point_a is not None:
        a = a - zero_point_a.double().reshape(-1, 1)
    out = a @ b_q.double().t()
    if scale_a is not None:
        out = out * scale_a.double().reshape(-1, 1)
    if scale_b is not None:
        out = out * scale_b.double().reshape(1, -1)
    if bias is not None:
        out = out + bias.double()
    return out
