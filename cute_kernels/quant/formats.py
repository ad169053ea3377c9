"""NVFP4: e2m1 values, one e4m3 scale per 16 values along K, one fp32 scale per tensor.

A value is ``e2m1 * float(e4m3 block scale) * global_scale``. This module holds the formats and
the reference quantizer, in plain torch (CPU or GPU); the kernels follow its rules.

Codes: 4 bits, sign in bit 3, then a 2-bit exponent and a 1-bit mantissa:
``E2M1_VALUES[code & 7]`` = 0, 0.5, 1, 1.5, 2, 3, 4, 6. Two codes per byte, element ``2j`` in the
low nibble and ``2j + 1`` in the high one -- the bytes of ``torch.float4_e2m1fn_x2``.

Scale layouts (``scale_layout``):
  - "plain": (rows, K / 16) float8_e4m3fn, row-major.
  - "blocked": the cuBLAS / CUTLASS block-scaling layout. The (rows, K / 16) matrix, padded with
    zeros to a multiple of 128 rows and 4 columns, is cut into 128 x 4 tiles stored one after
    the other (row tiles outer, column tiles inner), 512 bytes each; inside a tile, entry
    (r, c) sits at byte ``(r % 32) * 16 + (r // 32) * 4 + c``. Flat, (padded rows * padded
    columns,) float8_e4m3fn.

Quantization (``nvfp4_quantize_ref``), per row of 16 values:
  global_scale = amax(|x|) / (6 * 448) unless given (1 for an all-zero x or one holding NaN);
  scale = e4m3(amax(|block|) / 6 / global_scale), rounded to nearest even, saturated at 448;
  code = e2m1(x * inverse), inverse = 1 / (float(scale) * global_scale) (0 where that is 0),
  rounded to nearest even, saturated at 6; NaN gives code 0.
"""

from __future__ import annotations

import torch

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SCALE_LAYOUTS = ("plain", "blocked")
# Midpoints between neighbouring magnitudes; a tie goes to the even code (mantissa bit 0).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """uint8 codes (0..15) of float ``x``, rounded to nearest even and saturated at +-6."""
    mag = x.float().abs().nan_to_num(nan=0.0)
    mids = torch.tensor(_MIDPOINTS, device=x.device)
    index = torch.bucketize(mag, mids)  # a value equal to a midpoint gets the lower index
    tie_to_odd = (index < len(_MIDPOINTS)) & (index % 2 == 1)
    tie_to_odd &= mag == mids[index.clamp(max=len(_MIDPOINTS) - 1)]
    index = index + tie_to_odd.long()
    sign = (x.float() < 0).to(torch.uint8) << 3
    return index.to(torch.uint8) | sign


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 codes (0..15)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=codes.device)
    return table[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """(..., K) codes -> (..., K / 2) bytes, element 2j in the low nibble (K even)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1 needs an even last dim, got {tuple(codes.shape)}")
    pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """(..., K / 2) bytes (uint8 or float4_e2m1fn_x2) -> (..., K) codes."""
    packed = packed.view(torch.uint8)
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)


def as_float4_x2(packed: torch.Tensor) -> torch.Tensor:
    """The same bytes as ``torch.float4_e2m1fn_x2`` (no copy)."""
    return packed.view(torch.float4_e2m1fn_x2)


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """(rows, cols) scales -> the flat 128 x 4 blocked layout (module docstring)."""
    rows, cols = scales.shape
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    padded = scales.new_zeros((row_tiles * 128, col_tiles * 4))
    padded[:rows, :cols] = scales
    tiles = padded.view(row_tiles, 4, 32, col_tiles, 4)  # (r // 128, (r % 128) // 32, r % 32, c // 4, c % 4)
    return tiles.permute(0, 3, 2, 1, 4).reshape(-1)


def from_blocked(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of ``to_blocked``: (rows, cols) scales."""
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    if flat.numel() != row_tiles * col_tiles * 512:
        raise ValueError(f"a blocked layout of ({rows}, {cols}) scales holds "
                         f"{row_tiles * col_tiles * 512} entries, got {flat.numel()}")
    tiles = flat.reshape(row_tiles, col_tiles, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(row_tiles * 128, col_tiles * 4)[:rows, :cols]


def default_global_scale(x: torch.Tensor) -> torch.Tensor:
    """amax(|x|) / (6 * 448) as a float32 scalar tensor; 1 for an all-zero (or empty) x or one
    holding NaN. The amax is taken in x's own dtype (exact: it is one of x's values), without a
    float32 copy."""
    amax = x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
    scale = amax / (E2M1_MAX * E4M3_MAX)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def nvfp4_quantize_ref(x: torch.Tensor, global_scale=None, scale_layout: str = "plain"):
    """(packed uint8 (M, K / 2), scales float8_e4m3fn, global_scale float32 scalar) of a 2-D
    x (M, K) with K a multiple of 16, by the rules of the module docstring."""
    if x.dim() != 2 or x.shape[1] % BLOCK:
        raise ValueError(f"x must be (M, K) with K a multiple of {BLOCK}, got {tuple(x.shape)}")
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"scale_layout={scale_layout!r}; supported: {SCALE_LAYOUTS}")
    xf = x.float()
    if global_scale is None:
        global_scale = default_global_scale(xf)
    global_scale = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device).reshape(())
    m, k = xf.shape
    blocks = xf.reshape(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    ones = torch.ones_like(amax)
    block_scale = amax / (ones * E2M1_MAX) / global_scale
    scales = block_scale.nan_to_num(nan=0.0).clamp(0, E4M3_MAX).to(torch.float8_e4m3fn)
    denominator = scales.float() * global_scale
    inverse = torch.where(denominator > 0, torch.ones_like(denominator) / denominator,
                          torch.zeros_like(denominator))
    codes = e2m1_codes(blocks * inverse.unsqueeze(-1)).reshape(m, k)
    if scale_layout == "blocked":
        scales = to_blocked(scales)
    return pack_e2m1(codes), scales, global_scale


def nvfp4_dequantize_ref(packed: torch.Tensor, scales: torch.Tensor, global_scale,
                         scale_layout: str = "plain") -> torch.Tensor:
    """float32 (M, K) values of NVFP4 data (``nvfp4_quantize_ref``'s outputs)."""
    codes = unpack_e2m1(packed)
    m, k = codes.shape
    if scale_layout == "blocked":
        scales = from_blocked(scales, m, k // BLOCK)
    per_value = scales.float().repeat_interleave(BLOCK, dim=1)
    return e2m1_values(codes) * per_value * torch.as_tensor(global_scale, dtype=torch.float32,
                                                            device=packed.device)
