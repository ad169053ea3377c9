"""Reference: the fp8 values decoded to fp32, multiplied in fp32 (TF32 off), scaled, rounded to
bf16. Correct within atol 2e-2 + rtol 2e-2 of it."""

import torch

from task import input_t, output_t


def generate_input(m, n, k, seed) -> input_t:
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(n, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
    scale_a = torch.rand(m, device="cuda", generator=g) / k ** 0.5 + 1e-3
    scale_b = torch.rand(n, device="cuda", generator=g) + 0.5
    return a, w, scale_a, scale_b


def ref_kernel(data: input_t) -> output_t:
    a, w, scale_a, scale_b = data
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        y = (a.float() @ w.float().t()) * scale_a[:, None] * scale_b[None, :]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return y.to(torch.bfloat16)


def check_implementation(data: input_t, output: output_t):
    expected = ref_kernel(data)
    if not isinstance(output, torch.Tensor) or output.shape != expected.shape or output.dtype != expected.dtype:
        return False, f"expected {tuple(expected.shape)} {expected.dtype}"
    diff = (output.float() - expected.float()).abs()
    bad = ~(diff <= 2e-2 + 2e-2 * expected.float().abs())
    if bad.any():
        return False, f"{int(bad.sum())} of {bad.numel()} values off, max error {diff.max().item():.3e}"
    return True, ""
