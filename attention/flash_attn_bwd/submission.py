#!POPCORN leaderboard flash_attn_bwd
import torch

import cute_kernels as ck

from task import input_t, output_t


def custom_kernel(data: input_t) -> output_t:
    q, k, v, dout, causal, cu_seqlens, max_seqlen = data
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if cu_seqlens is None:
        out = ck.flash_attn(*leaves, causal=bool(causal))
    else:
        out = ck.flash_attn_varlen(*leaves, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                   causal=bool(causal))
    return torch.autograd.grad(out, leaves, dout)
