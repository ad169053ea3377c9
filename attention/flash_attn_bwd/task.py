from typing import Tuple

import torch

input_t = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]  # q, k, v, dout, causal
output_t = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # dq, dk, dv
