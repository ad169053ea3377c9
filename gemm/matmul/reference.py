"""Reference: torch's fp16 product (cuBLAS, fp32 accumulation). Correct within the upstream
problem's tolerances, rtol 1e-5 and atol 1e-8, with NaN / inf positions matching -- in effect
the same rounding of every output as cuBLAS.

Inputs and cases follow the upstream problem: values uniform in [0, 1), every dimension a
multiple of 16 (its statement guarantees it). Shapes outside that are outside the problem: at
127 x 255 x 513 (randn inputs) 91 of 32385 fp16 outputs of ``ck.gemm`` differ from cuBLAS's by
one unit in the last place (3.1e-2 or less), since the two sum K in different orders there, and
rtol 1e-5 rejects that."""

import torch

from task import input_t, output_t

RTOL, ATOL = 1e-5, 1e-8


def generate_input(m, n, k, seed) -> input_t:
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.empty(m, k, device="cuda", dtype=torch.float16).uniform_(0, 1, generator=g)
    b = torch.empty(k, n, device="cuda", dtype=torch.float16).uniform_(0, 1, generator=g)
    c = torch.empty(m, n, device="cuda", dtype=torch.float16)
    return a, b, c


def ref_kernel(data: input_t) -> output_t:
    a, b, _ = data
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
