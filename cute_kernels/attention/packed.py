"""Packed-input forms of :func:`flash_attn` and :func:`flash_attn_varlen`, as FlashAttention's
``flash_attn_qkvpacked_func``, ``flash_attn_kvpacked_func`` and their varlen twins: the same
arguments in the same order, so code written against them switches by its import.

Each splits its packed tensor into views (no copy: the views' strides are multiples of the
head dim, which the kernels read as they are) and calls the unpacked op; autograd gathers the
gradients of the views into one gradient of the packed tensor (a copy of dQ, dK and dV into it).

Constraints: those of :func:`flash_attn` (head dims, dtypes, options); the packed dimension of
size 3 (q, k, v) or 2 (k, v), as FlashAttention's.
"""

from __future__ import annotations

import torch

from ..runtime.errors import UnsupportedError
from .op import flash_attn, flash_attn_varlen


def _split(packed: torch.Tensor, name: str, dim: int, parts: int, layout: str) -> tuple:
    if not isinstance(packed, torch.Tensor) or packed.dim() <= dim or packed.shape[dim] != parts:
        shape = tuple(packed.shape) if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise UnsupportedError(f"{name} must be {layout}, got {shape}")
    return packed.unbind(dim)


def flash_attn_qkvpacked(qkv: torch.Tensor, dropout_p: float = 0.0,
                         softmax_scale: float | None = None, causal: bool = False,
                         window_size: tuple = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
                         deterministic: bool = False, return_attn_probs: bool = False, *,
                         return_lse: bool = False):
    """:func:`flash_attn` of ``qkv`` (B, S, 3, H, D): q, k and v side by side (MHA), as
    ``flash_attn_qkvpacked_func``; the gradient is one (B, S, 3, H, D) tensor."""
    q, k, v = _split(qkv, "qkv", 2, 3, "(batch, seqlen, 3, heads, head_dim)")
    return flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, return_lse=return_lse)


def flash_attn_kvpacked(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = 0.0,
                        softmax_scale: float | None = None, causal: bool = False,
                        window_size: tuple = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
                        deterministic: bool = False, return_attn_probs: bool = False, *,
                        return_lse: bool = False):
    """:func:`flash_attn` of q (B, Sq, Hq, D) over ``kv`` (B, Sk, 2, Hkv, D), as
    ``flash_attn_kvpacked_func`` (Hq a multiple of Hkv)."""
    k, v = _split(kv, "kv", 2, 2, "(batch, seqlen_k, 2, heads_k, head_dim)")
    return flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, return_lse=return_lse)


def flash_attn_varlen_qkvpacked(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                                dropout_p: float = 0.0, softmax_scale: float | None = None,
                                causal: bool = False, window_size: tuple = (-1, -1),
                                softcap: float = 0.0, alibi_slopes=None,
                                deterministic: bool = False, return_attn_probs: bool = False,
                                *, return_lse: bool = False):
    """:func:`flash_attn_varlen` of packed sequences ``qkv`` (total, 3, H, D) with one set of
    offsets for queries and keys, as ``flash_attn_varlen_qkvpacked_func``."""
    q, k, v = _split(qkv, "qkv", 1, 3, "(total_tokens, 3, heads, head_dim)")
    return flash_attn_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                             softmax_scale, causal, window_size, softcap, alibi_slopes,
                             deterministic, return_attn_probs, return_lse=return_lse)


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
    return flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             dropout_p, softmax_scale, causal, window_size, softcap,
                             alibi_slopes, deterministic, return_attn_probs,
                             return_lse=return_lse)
