"""Reference: softmax in float32, rounded to bf16. Correct within atol 1e-3 + rtol 1e-2."""

import torch

from task import input_t, output_t


def generate_input(m, n, seed) -> input_t:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(m, n, device="cuda", generator=g) * 3).to(torch.bfloat16)


def ref_kernel(data: input_t) -> output_t:
    return torch.softmax(data.float(), dim=-1).to(data.dtype)


def check_implementation(data: input_t, output: output_t):
    expected = ref_kernel(data)
    if not isinstance(output, torch.Tensor) or output.shape != expected.shape or output.dtype != expected.dtype:
        got = (tuple(output.shape), output.dtype) if isinstance(output, torch.Tensor) else type(output).__name__
        return False, f"got {got}, expected {(tuple(expected.shape), expected.dtype)}"
    diff = (output.float() - expected.float()).abs()
    bad = ~(diff <= 1e-3 + 1e-2 * expected.float().abs())
    if bad.any():
        return False, f"{int(bad.sum())} of {bad.numel()} values off, max error {diff.max().item():.3e}"
    return True, ""
