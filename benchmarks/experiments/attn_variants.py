"""Attention forward configuration variants against FlashAttention's CuTe kernel and cuDNN in
one process (bf16, 16k tokens, 16 heads).

    python benchmarks/experiments/attn_variants.py
"""
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_attention import sdpa_peer  # noqa: E402
from harness import bench_many, make_input_sets, tflops  # noqa: E402

import cute_kernels as ck  # noqa: E402
from cute_kernels.attention import op  # noqa: E402
from cute_kernels.attention.config import AttentionFwdConfig  # noqa: E402

fa = __import__("flash_attn.cute", fromlist=["_"])
from torch.nn.attention import SDPBackend  # noqa: E402

cudnn = sdpa_peer(SDPBackend.CUDNN_ATTENTION)
default_config = op.attention_fwd_config
VARIANTS = {
    "persistent": lambda c: dataclasses.replace(c, tile_n=128, stages=2, persistent=True)
    if AttentionFwdConfig(c.head_dim, c.tile_m, 128, persistent=True).smem_bytes <= 227 * 1024 else c,
    "one_cta_per_tile": lambda c: dataclasses.replace(c, persistent=False),
    "wide_keys": lambda c: default_config(c.head_dim, local=c.local, softcap=c.softcap, varlen=c.varlen,
                                          max_seqlen_k=1 << 20),
}

for dim, seqlen, causal in [(128, 1024, False), (128, 1024, True), (128, 2048, False), (128, 2048, True),
                            (128, 4096, False), (128, 4096, True), (64, 1024, True), (64, 4096, False)]:
    batch = 16384 // seqlen

    def make():
        return tuple(torch.randn(batch, seqlen, 16, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    sets = make_input_sets(make, 3 * batch * seqlen * 16 * dim * 2)
    flops = 4 * batch * 16 * seqlen * seqlen * dim / (2 if causal else 1)

    def variant(change):
        def run(q, k, v):
            op.attention_fwd_config = lambda *a, **kw: change(default_config(*a, **kw))
            return ck.flash_attn(q, k, v, causal=causal)
        return run

    cands = {"default": lambda q, k, v: ck.flash_attn(q, k, v, causal=causal)}
    cands.update({name: variant(ch) for name, ch in VARIANTS.items()})
    cands["fa_cute"] = lambda q, k, v: fa.flash_attn_func(q, k, v, causal=causal)
    cands["cudnn"] = lambda q, k, v: cudnn(q, k, v, causal)

    def reset(fn):
        def run(*a):
            op.attention_fwd_config = default_config
            return fn(*a)
        return run

    cands["default"] = reset(cands["default"])
    ms = bench_many(cands, sets)
    print(f"d{dim}", seqlen, "causal" if causal else "full",
          "  ".join(f"{k} {tflops(flops, v):.0f}" for k, v in ms.items()), flush=True)
    op.attention_fwd_config = default_config
