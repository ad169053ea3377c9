from typing import Tuple

import torch

input_t = Tuple[torch.Tensor, torch.Tensor]
output_t = torch.Tensor
