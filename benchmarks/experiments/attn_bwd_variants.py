"""Attention backward variants (one shared dQ tile vs one per MMA warpgroup) against cuDNN and
FlashAttention's CuTe kernel, through autograd, in one process (bf16, 16 heads, 16k tokens).

    python benchmarks/experiments/attn_bwd_variants.py
"""
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_attention import peers  # noqa: E402
from harness import autograd_grad, bench_many, make_input_sets, tflops  # noqa: E402

import cute_kernels as ck  # noqa: E402
from cute_kernels.attention import op  # noqa: E402

default_config = op.attention_bwd_config


def variant(per_wg):
    def config(*a, **kw):
        return dataclasses.replace(default_config(*a, **kw), dq_per_warpgroup=per_wg)
    return config


# The two variants agree (same math, dQ added in another order).
q, k, v = (torch.randn(2, 700, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
dout = torch.randn_like(q)
results = []
for per_wg in (False, True):
    op.attention_bwd_config = variant(per_wg)
    results.append(torch.autograd.grad(ck.flash_attn(q, k, v, causal=True), (q, k, v), dout))
print("variants differ by", [(a.float() - b.float()).abs().max().item() for a, b in zip(*results)], flush=True)

peer_fns = {n: f for n, f in peers().items() if n in ("cudnn", "fa_cute")}
for dim, seqlen, causal in [(128, 4096, False), (128, 4096, True), (128, 16384, False), (64, 4096, True), (128, 1024, False)]:
    batch = 16384 // seqlen

    def make():
        q = torch.randn(batch, seqlen, 16, dim, device="cuda", dtype=torch.bfloat16)
        return q, torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)

    sets = make_input_sets(make, 4 * batch * seqlen * 16 * dim * 2)
    flops = 2.5 * 4 * batch * 16 * seqlen * seqlen * dim / (2 if causal else 1)

    def ours(per_wg):
        def fwd(q, k, v):
            op.attention_bwd_config = variant(per_wg)
            return ck.flash_attn(q, k, v, causal=causal)
        run = autograd_grad(fwd)

        def timed(*a):
            op.attention_bwd_config = variant(per_wg)
            return run(*a)
        return timed

    cands = {"shared_tile": ours(False), "tile_per_wg": ours(True)}
    for name, fn in peer_fns.items():
        cands[name] = autograd_grad((lambda f: lambda q, k, v: f(q, k, v, causal))(fn))
    ms = bench_many(cands, sets)
    print(f"d{dim}", seqlen, "causal" if causal else "full",
          "  ".join(f"{n} {tflops(flops, t):.0f}" for n, t in ms.items()), flush=True)
op.attention_bwd_config = default_config
