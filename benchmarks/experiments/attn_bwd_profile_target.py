"""Ours and FlashAttention's CuTe backward (through autograd) after a warm-up: a target for ncu,
and with ``--table`` a torch-profiler table of every kernel each backward launches.

    ncu -k regex:"FlashAttnBwd|Backward" --launch-skip 2 --launch-count 2 \\
        python benchmarks/experiments/attn_bwd_profile_target.py 4096
    python benchmarks/experiments/attn_bwd_profile_target.py 4096 [causal] --table
"""
import sys

import torch

import cute_kernels as ck

fa = __import__("flash_attn.cute", fromlist=["_"])
seqlen = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
causal = "causal" in sys.argv
q, k, v, dout = (torch.randn(16384 // seqlen, seqlen, 16, 128, device="cuda", dtype=torch.bfloat16)
                 for _ in range(4))


def run(attend):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attend(*leaves, causal=causal)
    out = out[0] if isinstance(out, tuple) else out
    torch.autograd.grad(out, leaves, dout)


for _ in range(2):
    run(ck.flash_attn)
    run(fa.flash_attn_func)
torch.cuda.synchronize()
if "--table" in sys.argv:
    for name, attend in (("ours", ck.flash_attn), ("fa_cute", fa.flash_attn_func)):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                run(attend)
            torch.cuda.synchronize()
        print(f"== {name}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
else:
    run(ck.flash_attn)
    run(fa.flash_attn_func)
    torch.cuda.synchronize()
