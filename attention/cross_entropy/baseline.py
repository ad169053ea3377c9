import torch
import torch.nn.functional as F

from task import input_t, output_t


def custom_kernel(data: input_t) -> output_t:
    logits, targets, grad = data
    leaf = logits.detach().requires_grad_()
    losses = F.cross_entropy(leaf.float(), targets, reduction="none")
    (dlogits,) = torch.autograd.grad(losses, leaf, grad)
    return losses.detach(), dlogits
