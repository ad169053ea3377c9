"""Reference: RMSNorm in float32, rounded to bf16. Correct within atol 1e-2 + rtol 1e-2."""

import torch

from task import input_t, output_t

EPS = 1e-6


def generate_input(m, n, seed) -> input_t:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(torch.bfloat16)
    return x, w


def ref_kernel(data: input_t) -> output_t:
    x, w = data
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def check_implementation(data: input_t, output: output_t):
    expected = ref_kernel(data)
    if not isinstance(output, torch.Tensor) or output.shape != expected.shape or output.dtype != expected.dtype:
        return False, f"expected {tuple(expected.shape)} {expected.dtype}"
    diff = (output.float() - expected.float()).abs()
    bad = ~(diff <= 1e-2 + 1e-2 * expected.float().abs())
    if bad.any():
        return False, f"{int(bad.sum())} of {bad.numel()} values off, max error {diff.max().item():.3e}"
    return True, ""
