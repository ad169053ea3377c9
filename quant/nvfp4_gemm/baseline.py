import torch

from task import input_t, output_t

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(packed, scales):
    raw = packed.view(torch.uint8)
    codes = torch.stack((raw & 15, raw >> 4), dim=-1).reshape(raw.shape[0], -1)
    table = torch.tensor(E2M1, dtype=torch.float16, device=raw.device)
    return table[codes.long()] * scales.to(raw.device, torch.float16).repeat_interleave(16, dim=1)


def custom_kernel(data: input_t) -> output_t:
    # Dequantize to fp16 in torch operations (exact: an e2m1 value times an e4m3 scale; the
    # plain-layout scales), then cuBLAS (fp32 accumulation, fp16 out).
    a, b, sfa, sfb, _, _, c = data
    for i in range(a.shape[2]):
        c[:, :, i] = dequantize(a[:, :, i], sfa[:, :, i]) @ dequantize(b[:, :, i], sfb[:, :, i]).t()
    return c
