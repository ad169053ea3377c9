import torch.nn.functional as F

from task import input_t, output_t


def custom_kernel(data: input_t) -> output_t:
    x, w, bias = data
    return F.gelu(x @ w + bias, approximate="tanh")
