#!POPCORN leaderboard flash_attn_fwd
import cute_kernels as ck

from task import input_t, output_t


def custom_kernel(data: input_t) -> output_t:
    q, k, v, causal = data
    return ck.flash_attn(q, k, v, causal=bool(causal))
