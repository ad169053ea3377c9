#!POPCORN leaderboard softmax
import cute_kernels as ck

from task import input_t, output_t


def custom_kernel(data: input_t) -> output_t:
    return ck.softmax(data, dim=-1)
