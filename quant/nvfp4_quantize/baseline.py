import torch

from task import input_t, output_t

MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def custom_kernel(data: input_t) -> output_t:
    # The rule in plain torch operations (eager): block amax, e4m3 scale, codes by bucketing
    # against the midpoints of the e2m1 grid, scales rearranged into 128 x 4 tiles.
    x, global_scale = data
    g = global_scale.float().reshape(())
    m, k = x.shape
    blocks = x.float().reshape(m, k // 16, 16)
    amax = blocks.abs().amax(dim=-1)
    s = (amax / torch.full_like(amax, 6.0) / g).nan_to_num(nan=0.0).clamp(0, 448).to(torch.float8_e4m3fn)
    denominator = s.float() * g
    inverse = torch.where(denominator > 0, 1 / denominator, torch.zeros_like(denominator))
    q = blocks * inverse.unsqueeze(-1)
    mag = q.abs().nan_to_num(nan=0.0)
    mids = torch.tensor(MIDPOINTS, device=x.device)
    index = torch.bucketize(mag, mids)
    odd_tie = (index < 7) & (index % 2 == 1) & (mag == mids[index.clamp(max=6)])
    codes = ((index + odd_tie.long()).to(torch.uint8) | ((q < 0).to(torch.uint8) << 3)).reshape(m, k // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    rows, cols = s.shape
    padded = torch.zeros((-(-rows // 128) * 128, -(-cols // 4) * 4), dtype=torch.uint8, device=x.device)
    padded[:rows, :cols] = s.view(torch.uint8)
    tiles = padded.view(padded.shape[0] // 128, 4, 32, padded.shape[1] // 4, 4)
    return packed, tiles.permute(0, 3, 2, 1, 4).reshape(-1).view(torch.float8_e4m3fn)
