"""Reference: the gradients of attention computed by autograd in float32 (torch's SDPA).
Correct when each gradient is within atol 2e-2 * max|ref| + rtol 5e-2 of it (bf16 inputs and
outputs, bf16 probabilities inside the kernel)."""

import torch

from task import input_t, output_t


def generate_input(batch, seqlen, heads, heads_kv, dim, causal, seed, varlen=0) -> input_t:
    """Padded (batch, seqlen, heads, dim) tensors, or with ``varlen`` ``batch`` packed sequences
    of random lengths 1..seqlen (queries and keys of equal length), (total, heads, dim)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    cu_seqlens = max_seqlen = None
    if varlen:
        lengths = torch.randint(1, seqlen + 1, (batch,), device="cuda", generator=g)
        cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()
        max_seqlen = int(lengths.max())
        shape_q, shape_kv = (int(lengths.sum()), heads, dim), (int(lengths.sum()), heads_kv, dim)
    else:
        shape_q, shape_kv = (batch, seqlen, heads, dim), (batch, seqlen, heads_kv, dim)
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, generator=g)
    dout = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, dout, int(causal), cu_seqlens, max_seqlen


def _attention(q, k, v, causal):
    """fp32 attention, (B, S, H, D) in and out (queries and keys of equal length, so the causal
    mask is the same aligned either way); torch picks its fp32 memory-efficient kernel on the
    GPU, which keeps the recheck of every leaderboard repeat affordable."""
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), is_causal=bool(causal), enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def ref_kernel(data: input_t) -> output_t:
    q, k, v, dout, causal, cu_seqlens, _ = data
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    if cu_seqlens is None:
        out = _attention(*leaves, causal)
    else:  # each packed sequence on its own
        bounds = cu_seqlens.tolist()
        out = torch.cat([_attention(*(t[a:b].unsqueeze(0) for t in leaves), causal).squeeze(0)
                         for a, b in zip(bounds[:-1], bounds[1:])])
    grads = torch.autograd.grad(out, leaves, dout.float())
    return tuple(g.to(torch.bfloat16) for g in grads)


def check_implementation(data: input_t, output: output_t):
    expected = ref_kernel(data)
    if not isinstance(output, (tuple, list)) or len(output) != 3:
        return False, "expected a tuple (dq, dk, dv)"
    for name, got, ref in zip(("dq", "dk", "dv"), output, expected):
        if not isinstance(got, torch.Tensor) or got.shape != ref.shape or got.dtype != ref.dtype:
            return False, f"{name}: expected {tuple(ref.shape)} {ref.dtype}"
        diff = (got.float() - ref.float()).abs()
        bound = 2e-2 * ref.float().abs().max() + 5e-2 * ref.float().abs()
        if not (diff <= bound).all():
            return False, f"{name}: max error {diff.max().item():.3e} (max |ref| {ref.float().abs().max().item():.3e})"
    return True, ""
