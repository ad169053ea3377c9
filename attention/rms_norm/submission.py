#!POPCORN leaderboard rms_norm
import cute_kernels as ck

from task import input_t, output_t


def custom_kernel(data: input_t) -> output_t:
    x, w = data
    return ck.rms_norm(x, w, eps=1e-6)
