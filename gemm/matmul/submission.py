#!POPCORN leaderboard matmul
import cute_kernels as ck

from task import input_t, output_t


def custom_kernel(data: input_t) -> output_t:
    a, b, c = data
    return ck.gemm(a, b, out=c)
