import torch
import torch.nn.functional as F

from task import input_t, output_t


def custom_kernel(data: input_t) -> output_t:
    q, k, v, causal = data
    sq, sk = q.shape[1], k.shape[1]
    mask = None
    if causal:  # bottom-right aligned, as the reference (SDPA's is_causal aligns top-left)
        rows = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        mask = torch.arange(sk, device=q.device)[None, :] <= rows
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)
