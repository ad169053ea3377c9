"""Reference: the three operands decoded exactly (e2m1 value times e4m3 scale), both products
summed in float64, SiLU and the product in float64, rounded to fp16; rtol = atol = 1e-3
(infinities must match). Inputs as GPU MODE's nvfp4_dual_gemm generates them: code bytes uniform
in {0, 1} (low nibble 0 or 0.5, high nibble 0), every scale -1."""

import torch

from nvfp4_utils import blocked_view, close_match, decode, random_codes
from task import input_t, output_t

DEVICE = "cuda"


def generate_input(m, n, k, l, seed) -> input_t:
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def scales(rows):
        return torch.full((l, rows, k // 16), -1.0, device=DEVICE).to(torch.float8_e4m3fn).permute(1, 2, 0)

    a, b1, b2 = random_codes(g, l, m, k, 2), random_codes(g, l, n, k, 2), random_codes(g, l, n, k, 2)
    sfa, sfb1, sfb2 = scales(m), scales(n), scales(n)
    c = torch.randn((l, m, n), dtype=torch.float16, device=DEVICE, generator=g).permute(1, 2, 0)
    return (a, b1, b2, sfa, sfb1, sfb2, blocked_view(sfa), blocked_view(sfb1), blocked_view(sfb2), c)


def ref_kernel(data: input_t) -> output_t:
    a, b1, b2, sfa, sfb1, sfb2, _, _, _, c = data
    out = torch.empty_like(c)
    for i in range(a.shape[2]):
        x = decode(a[:, :, i], sfa[:, :, i])
        gate = x @ decode(b1[:, :, i], sfb1[:, :, i]).t()
        up = x @ decode(b2[:, :, i], sfb2[:, :, i]).t()
        out[:, :, i] = (torch.nn.functional.silu(gate) * up).to(torch.float16)
    return out


def check_implementation(data: input_t, output: output_t):
    return close_match(output, ref_kernel(data))
