"""Ours and FlashAttention's CuTe forward once each after a warm-up (a target for ncu).

    ncu -k regex:Flash --launch-skip 4 python benchmarks/experiments/attn_profile_target.py
"""
import sys

import torch

import cute_kernels as ck

fa = __import__("flash_attn.cute", fromlist=["_"])
seqlen = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
causal = len(sys.argv) > 2 and sys.argv[2] == "causal"
q, k, v = (torch.randn(16384 // seqlen, seqlen, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(2):
    ck.flash_attn(q, k, v, causal=causal)
    fa.flash_attn_func(q, k, v, causal=causal)
torch.cuda.synchronize()
ck.flash_attn(q, k, v, causal=causal)
fa.flash_attn_func(q, k, v, causal=causal)
torch.cuda.synchronize()
