import torch

from task import input_t, output_t


def custom_kernel(data: input_t) -> output_t:
    x, w = data
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps=1e-6)
