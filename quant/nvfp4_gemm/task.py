from typing import Tuple

import torch

# a, b, sfa, sfb, sfa_blocked, sfb_blocked, c
input_t = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
output_t = torch.Tensor  # c (M, 1, L) float16
