import torch

from task import input_t, output_t


def custom_kernel(data: input_t) -> output_t:
    a, w, scale_a, scale_b, bias = data
    acc = torch._int_mm(a, w.t())  # cuBLAS int8 (M > 16, K and N multiples of 8)
    return (acc.float() * scale_a[:, None] * scale_b[None, :] + bias).to(torch.bfloat16)
