#!POPCORN leaderboard cross_entropy
import torch

import cute_kernels as ck

from task import input_t, output_t


def custom_kernel(data: input_t) -> output_t:
    logits, targets, grad = data
    leaf = logits.detach().requires_grad_()
    losses = ck.cross_entropy(leaf, targets, reduction="none")
    (dlogits,) = torch.autograd.grad(losses, leaf, grad)
    return losses.detach(), dlogits
