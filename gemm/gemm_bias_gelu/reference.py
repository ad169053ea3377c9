"""Reference: the product in fp32, bias added and tanh-GELU applied in fp32, rounded to bf16.
Correct within atol 2e-2 + rtol 2e-2 (bf16 output rounding, fp32 accumulation in any order)."""

import torch
import torch.nn.functional as F

from task import input_t, output_t


def generate_input(m, n, k, seed) -> input_t:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(k, n, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
    return x, w, bias


def ref_kernel(data: input_t) -> output_t:
    x, w, bias = data
    return F.gelu(x.float() @ w.float() + bias.float(), approximate="tanh").to(torch.bfloat16)


def check_implementation(data: input_t, output: output_t):
    expected = ref_kernel(data)
    if not isinstance(output, torch.Tensor) or output.shape != expected.shape or output.dtype != expected.dtype:
        return False, f"expected {tuple(expected.shape)} {expected.dtype}"
    diff = (output.float() - expected.float()).abs()
    bad = ~(diff <= 2e-2 + 2e-2 * expected.float().abs())
    if bad.any():
        return False, f"{int(bad.sum())} of {bad.numel()} values off, max error {diff.max().item():.3e}"
    return True, ""
