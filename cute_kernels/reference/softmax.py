"""Softmax references computed in float64."""

import torch


def softmax_ref(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.softmax(x.double(), dim=dim)


def softmax_backward_ref(y: torch.Tensor, dy: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Gradient of softmax given its output y and the output gradient dy, in float64."""
    y, dy = y.double(), dy.double()
    return y * (dy - (dy * y).sum(dim=dim, keepdim=True))
