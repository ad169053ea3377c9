from typing import Tuple

import torch

input_t = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]  # q, k, v, causal
output_t = torch.Tensor
