from typing import Tuple

import torch

input_t = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # a, w, scale_a, scale_b, bias
output_t = torch.Tensor
