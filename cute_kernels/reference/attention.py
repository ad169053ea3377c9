"""Attention references computed in float64 (differentiable), with FlashAttention's semantics.

Layouts as ``flash_attn_func``: q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D) with Hq a multiple of
Hkv (query head h reads key / value head h // (Hq / Hkv)); varlen packs sequences as
(total_tokens, H, D) with int32 ``cu_seqlens`` offsets.

Masks are aligned bottom-right, as FlashAttention does when Sq != Sk: query row i sits at key
position i + Sk - Sq. With ``window_size = (left, right)`` (-1: unbounded) it sees keys j with
``i + Sk - Sq - left <= j <= i + Sk - Sq + right``; ``causal`` is ``right = 0``. Scores are
``q . k * softmax_scale`` (default 1 / sqrt(D)), then ``softcap * tanh(s / softcap)`` when
``softcap > 0``. A row that sees no key gets output 0 and LSE -inf.
"""

from __future__ import annotations

import math

import torch


def attention_mask(seqlen_q: int, seqlen_k: int, causal: bool = False,
                   window_size: tuple = (-1, -1), device=None) -> torch.Tensor:
    """(Sq, Sk) bool: True where query row i may attend key j (bottom-right aligned)."""
    left, right = window_size
    if causal:
        right = 0
    row = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    col = torch.arange(seqlen_k, device=device)[None, :]
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        allowed &= col <= row + right
    if left >= 0:
        allowed &= col >= row - left
    return allowed


def attention_ref(q, k, v, causal: bool = False, softmax_scale: float | None = None,
                  window_size: tuple = (-1, -1), softcap: float = 0.0):
    """(out in float64 (B, Sq, Hq, Dv), lse float64 (B, Hq, Sq)) for one padded batch (q and k
    of head dim D, v of Dv)."""
    batch, seqlen_q, heads_q, dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    if heads_q % heads_kv:
        raise ValueError(f"Hq = {heads_q} is not a multiple of Hkv = {heads_kv}")
    scale = 1.0 / math.sqrt(dim) if softmax_scale is None else softmax_scale
    group = heads_q // heads_kv
    q64 = q.double()
    k64 = k.double().repeat_interleave(group, dim=2)
    v64 = v.double().repeat_interleave(group, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q64, k64) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    allowed = attention_mask(seqlen_q, seqlen_k, causal, window_size, q.device)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf for rows that see nothing
    probs = torch.exp(scores - lse.unsqueeze(-1).masked_fill(torch.isinf(lse).unsqueeze(-1), 0.0))
    probs = probs.masked_fill(~allowed, 0.0)
    out = torch.einsum("bhij,bjhd->bihd", probs, v64)
    return out, lse


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool = False,
                         softmax_scale: float | None = None, window_size: tuple = (-1, -1),
                         softcap: float = 0.0):
    """(out float64 (total_q, Hq, Dv), lse float64 (Hq, total_q)) for packed sequences: each
    sequence b is rows cu_seqlens[b]:cu_seqlens[b + 1], attended on its own."""
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64, device=q.device)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[b], bounds_q[b + 1], bounds_k[b], bounds_k[b + 1]
        if q1 == q0:
            continue
        o, s = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal,
                             softmax_scale, window_size, softcap)
        out[q0:q1] = o[0]
        lse[:, q0:q1] = s[0]
    return out, lse
