"""Reference: the exact integer product (float64 holds it exactly), scaled in float64, plus
the bias, rounded to bf16. Correct within atol 1e-2 + rtol 1e-2 of it."""

import torch

from task import input_t, output_t


def generate_input(m, n, k, seed) -> input_t:
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randint(-128, 128, (m, k), device="cuda", generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), device="cuda", generator=g, dtype=torch.int8)
    scale_a = torch.rand(m, device="cuda", generator=g) / (64 * k ** 0.5) + 1e-5
    scale_b = torch.rand(n, device="cuda", generator=g) / 64 + 1e-4
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    return a, w, scale_a, scale_b, bias


def ref_kernel(data: input_t) -> output_t:
    a, w, scale_a, scale_b, bias = data
    acc = a.double() @ w.double().t()
    y = acc * scale_a.double()[:, None] * scale_b.double()[None, :] + bias.double()
    return y.to(torch.bfloat16)


def check_implementation(data: input_t, output: output_t):
    expected = ref_kernel(data)
    if not isinstance(output, torch.Tensor) or output.shape != expected.shape or output.dtype != expected.dtype:
        return False, f"expected {tuple(expected.shape)} {expected.dtype}"
    diff = (output.float() - expected.float()).abs()
    bad = ~(diff <= 1e-2 + 1e-2 * expected.float().abs())
    if bad.any():
        return False, f"{int(bad.sum())} of {bad.numel()} values off, max error {diff.max().item():.3e}"
    return True, ""
