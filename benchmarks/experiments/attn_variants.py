"""Attention forward tile variants against FlashAttention's CuTe kernel in one process
(d128, bf16, 16k tokens, 16 heads).

    python benchmarks/experiments/attn_variants.py
"""
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import bench_many, make_input_sets, tflops  # noqa: E402

import cute_kernels as ck  # noqa: E402
from cute_kernels.attention import op  # noqa: E402

fa = __import__("flash_attn.cute", fromlist=["_"])
default_config = op.attention_fwd_config
VARIANTS = {"base": {}, "n176": {"tile_n": 176}, "n192": {"tile_n": 192}, "stages3": {"stages": 3}}

for seqlen, causal in [(1024, False), (4096, False), (16384, False), (4096, True)]:
    batch = 16384 // seqlen

    def make():
        return tuple(torch.randn(batch, seqlen, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    sets = make_input_sets(make, 3 * batch * seqlen * 16 * 128 * 2)
    flops = 4 * batch * 16 * seqlen * seqlen * 128 / (2 if causal else 1)

    def variant(changes):
        def config(*args, **kw):
            return dataclasses.replace(default_config(*args, **kw), **changes)

        def run(q, k, v):
            op.attention_fwd_config = config
            return ck.flash_attn(q, k, v, causal=causal)
        return run

    cands = {name: variant(ch) for name, ch in VARIANTS.items()}
    cands["fa_cute"] = lambda q, k, v: fa.flash_attn_func(q, k, v, causal=causal)
    ms = bench_many(cands, sets)
    print(seqlen, "causal" if causal else "full", "  ".join(f"{k} {tflops(flops, v):.1f}" for k, v in ms.items()), flush=True)
    op.attention_fwd_config = default_config
