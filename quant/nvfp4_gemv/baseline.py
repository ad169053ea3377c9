import torch

from nvfp4_utils import decode
from task import input_t, output_t


def custom_kernel(data: input_t) -> output_t:
    # Dequantize to fp16 in torch operations (exact: an e2m1 value times an e4m3 scale; the
    # plain-layout scales), then cuBLAS (fp32 accumulation, fp16 out).
    a, b, sfa, sfb, _, _, c = data
    for i in range(a.shape[2]):
        vector = decode(b[:1, :, i], sfb[:1, :, i], torch.float16)[0]
        c[:, 0, i] = decode(a[:, :, i], sfa[:, :, i], torch.float16) @ vector
    return c
