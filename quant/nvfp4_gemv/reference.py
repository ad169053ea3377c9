"""Reference: both operands decoded exactly (e2m1 value times e4m3 scale), the dot products
summed in float64 and rounded to fp16; rtol = atol = 1e-3. Inputs as GPU MODE's nvfp4_gemv
generates them: code bytes uniform in 0..3 (low nibble 0, 0.5, 1 or 1.5; high nibble 0), scales
uniform in {0, 1, 2}."""

import torch

from task import input_t, output_t

DEVICE = "cuda"
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def blocked_view(scales):
    """(rows, cols, L) scales, rows % 128 == 0 and cols % 4 == 0 -> the blocked layout's memory,
    viewed as (32, 4, rows / 128, 4, cols / 4, L)."""
    rows, cols, batch = scales.shape
    tiles = scales.permute(2, 0, 1).reshape(batch, rows // 128, 4, 32, cols // 4, 4)
    memory = tiles.permute(0, 1, 4, 3, 2, 5).contiguous()  # (L, row tile, col tile, 32, 4, 4)
    return memory.permute(3, 4, 1, 5, 2, 0)


def generate_input(m, k, l, seed) -> input_t:
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def codes(rows):
        return torch.randint(0, 4, (l, rows, k // 2), dtype=torch.uint8, device=DEVICE,
                             generator=g).permute(1, 2, 0).view(torch.float4_e2m1fn_x2)

    def scales(rows):
        ints = torch.randint(0, 3, (l, rows, k // 16), dtype=torch.int8, device=DEVICE, generator=g)
        return ints.to(torch.float8_e4m3fn).permute(1, 2, 0)

    a, b = codes(m), codes(128)
    sfa, sfb = scales(m), scales(128)
    c = torch.randn((l, m, 1), dtype=torch.float16, device=DEVICE, generator=g).permute(1, 2, 0)
    return a, b, sfa.cpu(), sfb.cpu(), blocked_view(sfa), blocked_view(sfb), c


def decode(packed, scales):
    """(rows, K / 2, L) codes and (rows, K / 16, L) scales -> float64 (rows, K, L) values."""
    raw = packed.view(torch.uint8)
    codes = torch.stack((raw & 15, raw >> 4), dim=2).reshape(raw.shape[0], -1, raw.shape[2])
    table = torch.tensor(E2M1, dtype=torch.float64, device=raw.device)
    return table[codes.long()] * scales.to(raw.device).double().repeat_interleave(16, dim=1)


def ref_kernel(data: input_t) -> output_t:
    a, b, sfa, sfb, _, _, c = data
    av, bv = decode(a, sfa), decode(b[:1], sfb[:1])
    c[:, 0, :] = torch.einsum("mkl,kl->ml", av, bv[0]).to(torch.float16)
    return c


def check_implementation(data: input_t, output: output_t):
    expected = ref_kernel(tuple(t.clone() for t in data))
    if not isinstance(output, torch.Tensor) or output.shape != expected.shape or output.dtype != expected.dtype:
        return False, f"expected {tuple(expected.shape)} {expected.dtype}"
    got, want = output.float(), expected.float()
    diff = (got - want).abs()
    bad = (diff > 1e-3 + 1e-3 * want.abs()) | (got.isnan() != want.isnan())
    bad |= (got.isposinf() != want.isposinf()) | (got.isneginf() != want.isneginf())
    if bad.any():
        return False, f"{int(bad.sum())} of {bad.numel()} values off, max error {diff.max().item():.3e}"
    return True, ""
