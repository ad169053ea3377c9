from typing import Tuple

import torch

input_t = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # a (M, K), b (K, N), c (M, N) for the result
output_t = torch.Tensor
