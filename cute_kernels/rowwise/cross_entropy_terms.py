"""The cross-entropy's terms computed with torch around the kernels: the whole loss off CUDA
(the modules' path), the z-loss part of a loss from its rows' lse, and torch's weighted label
smoothing (class weights with label smoothing) from the kernels' unsmoothed rows."""

from __future__ import annotations

import torch


def torch_cross_entropy(logits, target, ignore_index=-100, label_smoothing=0.0, reduction="mean",
                        lse_square_scale=0.0, weight=None, softcap=None, return_z_loss=False):
    """What :func:`cross_entropy` computes, with torch (the modules' path off CUDA): class
    dim last, fp32 at least; the logits capped to ``softcap * tanh(x / softcap)`` first; the
    z-loss ``lse_square_scale * lse^2`` per counted row, times the row's class weight (with
    ``return_z_loss``, also that part alone, without gradient)."""
    x = logits.reshape(-1, logits.shape[-1])
    x = x if x.dtype == torch.float64 else x.float()
    if softcap:
        x = softcap * torch.tanh(x / softcap)
    t = target.reshape(-1)
    loss = torch.nn.functional.cross_entropy(x, t, weight=None if weight is None else weight.to(x.dtype),
                                             ignore_index=ignore_index,
                                             label_smoothing=label_smoothing, reduction=reduction)
    if reduction == "none":
        loss = loss.reshape(target.shape)
    if not lse_square_scale and not return_z_loss:
        return loss
    z = z_loss_part(torch.logsumexp(x, -1), target, ignore_index, reduction, lse_square_scale,
                    weight, x.dtype)
    return (loss + z, z.detach()) if return_z_loss else loss + z


def row_weights(target, weight, ignore_index: int, dtype=torch.float32):
    """Each row's class weight (1 without ``weight``), 0 for ignored rows (whatever the weight
    of the class the ignored index would pick), as flat ``dtype`` values."""
    t = target.reshape(-1)
    counted = t != ignore_index
    if weight is None:
        return counted.to(dtype)
    picked = weight.detach().to(dtype)[torch.where(counted, t, 0).clamp(0, weight.shape[0] - 1)]
    return torch.where(counted, picked, 0.0)


def z_loss_part(lse, target, ignore_index: int, reduction: str, z: float, weight=None,
                dtype=torch.float32):
    """The z-loss term of a loss from its rows' lse: ``z * lse^2`` per counted row (times the
    row's class weight), reduced as the loss is ("mean": over the counted rows or their summed
    weights, NaN when there are none)."""
    row_weight = row_weights(target, weight, ignore_index, dtype)
    rows = z * lse.square() * row_weight
    if reduction == "none":
        return rows.view(target.shape)
    return rows.sum() / row_weight.sum() if reduction == "mean" else rows.sum()


def weighted_smoothing_loss(rows, lse, sums, row_weight, counted, w, z: float, eps: float):
    """Per-row losses with class weights ``w`` and torch's weighted label smoothing ``eps``,
    from the kernels' unsmoothed rows (``lse - x_t + z lse^2``), the lse and the rows'
    ``sum_j w_j x_j``: ``(1 - eps) w_t (lse - x_t) + eps / V sum_j w_j (lse - x_j)``, plus
    the z-loss ``z lse^2 w_t``."""
    v = w.shape[0]
    return (1 - eps) * rows * row_weight + eps * (
        z * lse.square() * row_weight + (w.sum() * lse - sums) * counted / v)


def weighted_smoothing_grads(drows, lse, row_weight, counted, w, z: float, eps: float):
    """For per-row incoming gradients ``drows`` of :func:`weighted_smoothing_loss`: the rows'
    scale for the gradient kernel run without smoothing and z-loss (the factor of p_ij,
    ``w_t (1 + 2 z lse) - eps w_t + eps W / V``), the fix at the target column, and the
    rank-one term's row coefficient (times w_j): see :func:`add_smoothing_gradient`."""
    v = w.shape[0]
    rows = drows * (row_weight * (1 + 2 * z * lse) - eps * row_weight + eps * w.sum() / v * counted)
    return rows.contiguous(), rows - (1 - eps) * row_weight * drows, -eps / v * drows * counted


SMOOTHING_CHUNK = 1 << 24  # logits per fp32 chunk of the weighted smoothing's torch passes


def _capped_rows(x2, cap):
    """fp32 rows of the logits, capped as the kernels cap them (-inf stays -inf), and the
    cap's derivative (None without a cap)."""
    x = x2.float()
    if not cap:
        return x, None
    t = torch.tanh(x / cap)
    return torch.where(x == -torch.inf, x, cap * t), 1 - t * t


def smoothing_sums(x2, w, cap):
    """sum_j w_j x_ij per row in fp32 (capped logits; -inf logits count 0), in row chunks."""
    m, v = x2.shape
    out = torch.empty(m, dtype=torch.float32, device=x2.device)
    step = max(1, SMOOTHING_CHUNK // max(v, 1))
    for r in range(0, m, step):
        x, _ = _capped_rows(x2[r: r + step], cap)
        out[r: r + step] = torch.where(x == -torch.inf, 0.0, x) @ w
    return out


def add_smoothing_gradient(grad, x2, t2, counted, target_fix, row_coef, w, cap):
    """grad[i, j] += (row_coef[i] * w[j] + [j == t_i] * target_fix[i]) * cap'(x_ij) for the
    counted rows, in row chunks."""
    m, v = x2.shape
    step = max(1, SMOOTHING_CHUNK // max(v, 1))
    for r in range(0, m, step):
        _, slope = _capped_rows(x2[r: r + step], cap)
        term = row_coef[r: r + step, None] * w[None, :]
        if slope is not None:
            term = term * slope
        grad[r: r + step] = (grad[r: r + step].float() + term).to(grad.dtype)
    rows = torch.arange(m, device=x2.device)
    cols = t2.clamp(0, v - 1)
    fix = torch.where((counted > 0) & (t2 >= 0) & (t2 < v), target_fix, 0.0)
    if cap:
        fix = fix * (1 - torch.tanh(x2[rows, cols].float() / cap).square())
    grad[rows, cols] = (grad[rows, cols].float() + fix).to(grad.dtype)
