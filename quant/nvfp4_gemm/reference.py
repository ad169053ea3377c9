"""Reference: both operands decoded exactly (e2m1 value times e4m3 scale), the products summed
in float64 and rounded to fp16; rtol = atol = 1e-3 (infinities must match). Inputs as GPU MODE's
nvfp4_gemm generates them: code bytes uniform in {0, 1} (low nibble 0 or 0.5, high nibble 0),
scales uniform in {1, 2}."""

import torch

from nvfp4_utils import blocked_view, close_match, decode, random_codes
from task import input_t, output_t

DEVICE = "cuda"


def generate_input(m, n, k, l, seed) -> input_t:
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def scales(rows):
        ints = torch.randint(1, 3, (l, rows, k // 16), dtype=torch.int8, device=DEVICE, generator=g)
        return ints.to(torch.float8_e4m3fn).permute(1, 2, 0)

    a, b = random_codes(g, l, m, k, 2), random_codes(g, l, n, k, 2)
    sfa, sfb = scales(m), scales(n)
    c = torch.randn((l, m, n), dtype=torch.float16, device=DEVICE, generator=g).permute(1, 2, 0)
    return a, b, sfa.cpu(), sfb.cpu(), blocked_view(sfa), blocked_view(sfb), c


def ref_kernel(data: input_t) -> output_t:
    a, b, sfa, sfb, _, _, c = data
    out = torch.empty_like(c)
    for i in range(a.shape[2]):
        product = decode(a[:, :, i], sfa[:, :, i]) @ decode(b[:, :, i], sfb[:, :, i]).t()
        out[:, :, i] = product.to(torch.float16)
    return out


def check_implementation(data: input_t, output: output_t):
    return close_match(output, ref_kernel(data))
