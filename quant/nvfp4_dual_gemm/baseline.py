import torch

from nvfp4_utils import decode
from task import input_t, output_t


def custom_kernel(data: input_t) -> output_t:
    # Dequantize to fp32 in torch operations (the plain-layout scales), both products in cuBLAS
    # fp32, SiLU and the product in torch.
    a, b1, b2, sfa, sfb1, sfb2, _, _, _, c = data
    for i in range(a.shape[2]):
        x = decode(a[:, :, i], sfa[:, :, i], torch.float32)
        gate = x @ decode(b1[:, :, i], sfb1[:, :, i], torch.float32).t()
        up = x @ decode(b2[:, :, i], sfb2[:, :, i], torch.float32).t()
        c[:, :, i] = (torch.nn.functional.silu(gate) * up).to(torch.float16)
    return c
