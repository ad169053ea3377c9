from typing import Tuple

import torch

# a, b1, b2, sfa, sfb1, sfb2, sfa_blocked, sfb1_blocked, sfb2_blocked, c
input_t = Tuple[torch.Tensor, ...]
output_t = torch.Tensor  # c (M, N, L) float16
