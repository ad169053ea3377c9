from typing import Tuple

import torch

input_t = Tuple[torch.Tensor, torch.Tensor]  # x (M, K) bf16, global scale (1,) fp32
output_t = Tuple[torch.Tensor, torch.Tensor]  # packed codes (M, K / 2) uint8, blocked scales (flat) e4m3
