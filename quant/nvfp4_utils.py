"""Shared by the NVFP4 problems (listed in each task.yml as ../nvfp4_utils.py): input generation
in the public problems' layouts, exact decoding, and the output check."""

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def random_codes(g, l, rows, k, high):
    """(rows, K / 2, L) float4_e2m1fn_x2 codes, each batch's (rows, K / 2) contiguous, bytes
    uniform in [0, high)."""
    raw = torch.randint(0, high, (l, rows, k // 2), dtype=torch.uint8, device=g.device, generator=g)
    return raw.permute(1, 2, 0).view(torch.float4_e2m1fn_x2)


def blocked_view(scales):
    """(rows, cols, L) scales, rows % 128 == 0 and cols % 4 == 0 -> the cuBLAS / CUTLASS
    block-scaling layout's memory (each batch's 128 x 4 tiles of 512 bytes, row tiles outer; in
    a tile, entry (r, c) at byte (r % 32) * 16 + (r // 32) * 4 + c), viewed as
    (32, 4, rows / 128, 4, cols / 4, L)."""
    rows, cols, batch = scales.shape
    tiles = scales.permute(2, 0, 1).reshape(batch, rows // 128, 4, 32, cols // 4, 4)
    return tiles.permute(0, 1, 4, 3, 2, 5).contiguous().permute(3, 4, 1, 5, 2, 0)


def decode(packed, scales, dtype=torch.float64):
    """(rows, K / 2) codes (element 2j in the low nibble) and (rows, K / 16) e4m3 scales -> the
    (rows, K) values in ``dtype`` (exact in float64, float32, and in fp16 for scales that fit)."""
    raw = packed.view(torch.uint8)
    codes = torch.stack((raw & 15, raw >> 4), dim=-1).reshape(raw.shape[0], -1)
    table = torch.tensor(E2M1, dtype=dtype, device=raw.device)
    return table[codes.long()] * scales.to(raw.device, dtype).repeat_interleave(16, dim=1)


def close_match(output, expected, rtol=1e-3, atol=1e-3):
    """(ok, message): same shape and dtype, |output - expected| <= atol + rtol |expected|,
    NaN and infinities where the expected output has them."""
    if not isinstance(output, torch.Tensor) or output.shape != expected.shape or output.dtype != expected.dtype:
        return False, f"expected {tuple(expected.shape)} {expected.dtype}"
    got, want = output.float(), expected.float()
    diff = (got - want).abs()
    bad = (diff > atol + rtol * want.abs()) | (got.isnan() != want.isnan())
    bad |= (got.isposinf() != want.isposinf()) | (got.isneginf() != want.isneginf())
    if bad.any():
        return False, f"{int(bad.sum())} of {bad.numel()} values off, max error {diff.max().item():.3e}"
    return True, ""
