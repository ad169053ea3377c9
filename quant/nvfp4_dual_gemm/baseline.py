import torch

from task import input_t, output_t

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(packed, scales):
    raw = packed.view(torch.uint8)
    codes = torch.stack((raw & 15, raw >> 4), dim=-1).reshape(raw.shape[0], -1)
    table = torch.tensor(E2M1, device=raw.device)
    return table[codes.long()] * scales.to(raw.device, torch.float32).repeat_interleave(16, dim=1)


def custom_kernel(data: input_t) -> output_t:
    # Dequantize to fp32 in torch operations (the plain-layout scales), both products in cuBLAS
    # fp32, SiLU and the product in torch.
    a, b1, b2, sfa, sfb1, sfb2, _, _, _, c = data
    for i in range(a.shape[2]):
        x = dequantize(a[:, :, i], sfa[:, :, i])
        gate = x @ dequantize(b1[:, :, i], sfb1[:, :, i]).t()
        up = x @ dequantize(b2[:, :, i], sfb2[:, :, i]).t()
        c[:, :, i] = (torch.nn.functional.silu(gate) * up).to(torch.float16)
    return c
