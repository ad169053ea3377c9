"""Packed-input forms of :func:`flash_attn` and :func:`flash_attn_varlen`, as FlashAttention's
``flash_attn_qkvpacked_func``, ``flash_attn_kvpacked_func`` and their varlen twins: the same
arguments in the same order, so code written against them switches by its import.

Each splits its packed tensor into views (no copy: the views' strides are multiples of the
head dim, which the kernels read as they are) and runs the unpacked op's validation and
kernels; where a gradient is needed, its own autograd Function lets the backward write dK and
dV (and dQ) straight into the views of one packed gradient.

Constraints: those of :func:`flash_attn` (head dims, dtypes, options); the packed dimension of
size 3 (q, k, v) or 2 (k, v), as FlashAttention's.
"""

from __future__ import annotations

import torch

from ..runtime.errors import UnsupportedError, check_tensor
from .op import DTYPES, _flash_attn, _flash_attn_varlen, _needs_grad, _result, _returns


def _split(packed: torch.Tensor, name: str, dim: int, parts: int, layout: str) -> tuple:
    if not isinstance(packed, torch.Tensor) or packed.dim() <= dim or packed.shape[dim] != parts:
        shape = tuple(packed.shape) if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise UnsupportedError(f"{name} must be {layout}, got {shape}")
    return packed.unbind(dim)


class _PackedAttn(torch.autograd.Function):
    """Attention of a packed tensor (and a separate q, or None): the gradient of the packed
    tensor allocated once, the backward writing into its views."""

    @staticmethod
    def forward(ctx, q, packed, dim, fwd, bwd):
        parts = packed.unbind(dim)
        out, lse = fwd(*(parts if q is None else (q, *parts)))
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, packed, out, lse)
        ctx.dim, ctx.bwd = dim, bwd
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, packed, out, lse = ctx.saved_tensors
        check_tensor("grad of flash_attn's output", dout, DTYPES)
        grad = torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
        parts, views = packed.unbind(ctx.dim), grad.unbind(ctx.dim)
        if q is None:
            ctx.bwd(*parts, out, lse, dout.to(packed.dtype), grads=views)
            return None, grad, None, None, None
        dq = torch.empty_like(q)
        ctx.bwd(q, *parts, out, lse, dout.to(q.dtype), grads=(dq, *views))
        return dq, grad, None, None, None


def _packed_attend(q, packed, dim):
    """The ``attend`` of ``op._flash_attn`` for a packed call: the autograd Function above where
    a gradient is needed."""
    def attend(q_view, k, v, fwd, bwd, returns):
        if _needs_grad(q_view, k, v):
            out, lse = _PackedAttn.apply(q, packed, dim, fwd, bwd)
        else:
            out, lse = fwd(q_view, k, v)
        return _result(out, lse, returns)
    return attend


def flash_attn_qkvpacked(qkv: torch.Tensor, dropout_p: float = 0.0,
                         softmax_scale: float | None = None, causal: bool = False,
                         window_size: tuple = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
                         deterministic: bool = False, return_attn_probs: bool = False, *,
                         return_lse: bool = False):
    """:func:`flash_attn` of ``qkv`` (B, S, 3, H, D): q, k and v side by side (MHA), as
    ``flash_attn_qkvpacked_func``; the gradient is one (B, S, 3, H, D) tensor."""
    q, k, v = _split(qkv, "qkv", 2, 3, "(batch, seqlen, 3, heads, head_dim)")
    return _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                       alibi_slopes, deterministic, _returns(return_lse, return_attn_probs),
                       _packed_attend(None, qkv, 2))


def flash_attn_kvpacked(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = 0.0,
                        softmax_scale: float | None = None, causal: bool = False,
                        window_size: tuple = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
                        deterministic: bool = False, return_attn_probs: bool = False, *,
                        return_lse: bool = False):
    """:func:`flash_attn` of q (B, Sq, Hq, D) over ``kv`` (B, Sk, 2, Hkv, D), as
    ``flash_attn_kvpacked_func`` (Hq a multiple of Hkv)."""
    k, v = _split(kv, "kv", 2, 2, "(batch, seqlen_k, 2, heads_k, head_dim)")
    return _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                       alibi_slopes, deterministic, _returns(return_lse, return_attn_probs),
                       _packed_attend(q, kv, 2))


def flash_attn_varlen_qkvpacked(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                                dropout_p: float = 0.0, softmax_scale: float | None = None,
                                causal: bool = False, window_size: tuple = (-1, -1),
                                softcap: float = 0.0, alibi_slopes=None,
                                deterministic: bool = False, return_attn_probs: bool = False,
                                *, return_lse: bool = False):
    """:func:`flash_attn_varlen` of packed sequences ``qkv`` (total, 3, H, D) with one set of
    offsets for queries and keys, as ``flash_attn_varlen_qkvpacked_func``."""
    q, k, v = _split(qkv, "qkv", 1, 3, "(total_tokens, 3, heads, head_dim)")
    return _flash_attn_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                              softmax_scale, causal, window_size, softcap, alibi_slopes,
                              deterministic, _returns(return_lse, return_attn_probs),
                              _packed_attend(None, qkv, 1))


def flash_attn_varlen_kvpacked(q: torch.Tensor, kv: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                               dropout_p: float = 0.0, softmax_scale: float | None = None,
                               causal: bool = False, window_size: tuple = (-1, -1),
                               softcap: float = 0.0, alibi_slopes=None,
                               deterministic: bool = False, return_attn_probs: bool = False,
                               *, return_lse: bool = False):
    """:func:`flash_attn_varlen` of q (total_q, Hq, D) over ``kv`` (total_k, 2, Hkv, D), as
    ``flash_attn_varlen_kvpacked_func``."""
    k, v = _split(kv, "kv", 1, 2, "(total_tokens_k, 2, heads_k, head_dim)")
    return _flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              dropout_p, softmax_scale, causal, window_size, softcap,
                              alibi_slopes, deterministic, _returns(return_lse, return_attn_probs),
                              _packed_attend(q, kv, 1))
