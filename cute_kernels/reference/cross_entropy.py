"""Cross-entropy reference computed in float64 (differentiable)."""

import torch
import torch.nn.functional as F


def cross_entropy_ref(logits, target, ignore_index=-100, smoothing=0.0, reduction="mean", z=0.0,
                      weight=None):
    """``F.cross_entropy`` on (rows, V) logits in float64, plus the z-loss ``z * lse^2`` per
    counted row (times the row's class weight when ``weight`` is given). With a per-class
    ``weight`` the mean divides by the summed weights of the counted targets, as torch does."""
    x = logits.double()
    w = None if weight is None else weight.double()
    loss = F.cross_entropy(x, target, weight=w, ignore_index=ignore_index,
                           label_smoothing=smoothing, reduction="none")
    valid = target != ignore_index
    row_weight = valid.double()
    if w is not None:
        row_weight = row_weight * w[target.clamp(0, x.shape[-1] - 1)]
    if z:
        loss = loss + z * torch.logsumexp(x, -1).pow(2) * row_weight
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.sum() / row_weight.sum()
