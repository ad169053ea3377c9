"""Reference: torch's fp16 product (cuBLAS, fp32 accumulation). Correct within the upstream
problem's tolerances, rtol 1e-5 and atol 1e-8, with NaN / inf positions matching -- in effect
the same rounding of every output as cuBLAS."""

import torch

from task import input_t, output_t

RTOL, ATOL = 1e-5, 1e-8


def generate_input(m, n, k, seed) -> input_t:
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=g)
    b = torch.randn(k, n, device="cuda", dtype=torch.float16, generator=g)
    return a, b


def ref_kernel(data: input_t) -> output_t:
    a, b = data
    return a @ b


def check_implementation(data: input_t, output: output_t):
    expected = ref_kernel(data)
    if not isinstance(output, torch.Tensor) or output.shape != expected.shape:
        return False, f"shape mismatch: expected {tuple(expected.shape)}"
    out, ref = output.float(), expected.float()
    same_special = torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf() & (out > 0), ref.isinf() & (ref > 0))
    close = (out - ref).abs() <= ATOL + RTOL * ref.abs()
    close |= (out.isnan() & ref.isnan()) | (out == ref)
    if not same_special or not close.all():
        bad = int((~close).sum())
        return False, f"{bad} of {close.numel()} values differ, max error {(out - ref).abs().nan_to_num(0).max().item():.3e}"
    return True, ""
