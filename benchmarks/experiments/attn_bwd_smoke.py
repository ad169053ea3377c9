"""One attention backward against the float64 reference (a quick check before the suite).

    python benchmarks/experiments/attn_bwd_smoke.py
"""
import torch

import cute_kernels as ck
from cute_kernels.reference.attention import attention_ref

for dim, causal in [(128, False), (128, True), (64, True)]:
    q, k, v = (torch.randn(2, 300, 4, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 300, 4, dim, device="cuda", dtype=torch.bfloat16)
    grads = torch.autograd.grad(ck.flash_attn(q, k, v, causal=causal), (q, k, v), dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(attention_ref(*leaves, causal=causal)[0], leaves, dout.double())
    print(dim, causal, ["%.3e / %.3e" % ((g.double() - r).abs().max().item(), r.abs().max().item())
                        for g, r in zip(grads, ref)], flush=True)
