#!POPCORN leaderboard gemm_bias_gelu
import cute_kernels as ck

from task import input_t, output_t


def custom_kernel(data: input_t) -> output_t:
    x, w, bias = data
    return ck.gemm(x, w, bias=bias, activation="gelu_tanh")
