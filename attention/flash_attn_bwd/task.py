from typing import Optional, Tuple

import torch

# q, k, v, dout, causal, cu_seqlens, max_seqlen: cu_seqlens (int32, B + 1 offsets) and
# max_seqlen are None for padded batches; with them, q / k / v / dout hold packed sequences.
input_t = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, Optional[torch.Tensor], Optional[int]]
output_t = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # dq, dk, dv
