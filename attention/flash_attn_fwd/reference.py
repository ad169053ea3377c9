"""Reference: attention in float32 on the GPU (scores, softmax and the product), bf16 result.
Correct when every output is within atol 2e-2 + rtol 2e-2 of it (bf16 output rounding and the
kernel's bf16 probabilities allow no tighter bound)."""

import math

import torch

from task import input_t, output_t


def generate_input(batch, seqlen_q, seqlen_k, heads, heads_kv, dim, causal, seed) -> input_t:
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(batch, seqlen_k, heads_kv, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(batch, seqlen_k, heads_kv, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, int(causal)


def ref_kernel(data: input_t) -> output_t:
    q, k, v, causal = data
    group = q.shape[2] // k.shape[2]
    kf = k.float().repeat_interleave(group, dim=2)
    vf = v.float().repeat_interleave(group, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q.float(), kf) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        rows = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        allowed = torch.arange(sk, device=q.device)[None, :] <= rows
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", probs, vf).to(q.dtype)


def check_implementation(data: input_t, output: output_t):
    expected = ref_kernel(data)
    if not isinstance(output, torch.Tensor) or output.shape != expected.shape:
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        return False, f"shape {shape}, expected {tuple(expected.shape)}"
    if output.dtype != expected.dtype:
        return False, f"dtype {output.dtype}, expected {expected.dtype}"
    diff = (output.float() - expected.float()).abs()
    bad = ~(diff <= 2e-2 + 2e-2 * expected.float().abs())
    if bad.any():
        return False, f"{int(bad.sum())} of {bad.numel()} values off, max error {diff.max().item():.3e}"
    return True, ""
