from typing import Tuple

import torch

input_t = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # logits, targets, grad
output_t = Tuple[torch.Tensor, torch.Tensor]  # losses (fp32), dlogits (bf16)
