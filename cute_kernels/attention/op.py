"""``flash_attn`` and ``flash_attn_varlen``: the torch-facing ops, their custom ops and autograd.

The public functions validate their inputs (before any kernel runs), allocate O and the LSE,
and call the custom op; the op's body picks the configuration (``config.py``) and launches the
compiled kernel (``fwd_sm90.py``). Arguments and semantics follow ``flash_attn.flash_attn_func``
and ``flash_attn_varlen_func``, so switching is a change of import.
"""

from __future__ import annotations

import functools
import math

import torch

from ..runtime import DTypeError, UnsupportedError, kernel_op
from ..runtime.arch import sm_count
from ..runtime.compile import ScalarSpec, StreamSpec, Sym, TensorSpec, get_kernel
from ..runtime.dtypes import dtype_name
from ..runtime.errors import check_tensor, describe
from .config import (BWD_WIDE_HEAD_DIMS, HEAD_DIM_ALIGN, HEAD_DIMS, attention_bwd_config,
                     attention_fwd_config, bwd_kv_splits, kv_splits_supported)
from .dq_accum import accum_rows

DTYPES = (torch.bfloat16, torch.float16)
ALIGN = 8  # elements: TMA needs every non-unit stride (and the data pointer) on 16 bytes
L2_BYTES = 50 * 1024 * 1024  # for K and V of the (batch, head) pairs that run together
LOG2_E = math.log2(math.e)
INT32_MAX = 2**31 - 1


def _qkv_spec(dtype: str, head_dim: int, varlen: bool) -> TensorSpec:
    rank = 3 if varlen else 4
    return TensorSpec(dtype, (Sym(),) * (rank - 1) + (head_dim,),
                      (Sym(divisibility=ALIGN),) * (rank - 1) + (1,), 16)


def kernel_specs(dtype: str, head_dim: int, varlen: bool) -> tuple:
    """The argument signature of the forward kernel (``FlashAttnFwdSm90.__call__``)."""
    qkv = _qkv_spec(dtype, head_dim, varlen)
    lse_rank = 2 if varlen else 3
    lse = TensorSpec("float32", (Sym(),) * lse_rank, (Sym(),) * (lse_rank - 1) + (1,), 4)
    cu = TensorSpec("int32", (Sym(),), (1,), 4) if varlen else None
    scalars = tuple(ScalarSpec(t) for t in ("float32", "float32", "int32", "int32", "int32", "int32", "int32"))
    return (qkv, qkv, qkv, qkv, lse, cu, cu) + scalars + (StreamSpec(),)


def bwd_kernel_specs(dtype: str, head_dim: int, varlen: bool) -> tuple:
    """The argument signature of the backward kernel (``FlashAttnBwdSm90.__call__``)."""
    qkv = _qkv_spec(dtype, head_dim, varlen)
    rank = 3 if varlen else 4
    # LSE and D rows: read by TMA, so every stride but the rows' on 16 bytes
    rows = TensorSpec("float32", (Sym(),) * (rank - 1), (Sym(divisibility=4),) * (rank - 2) + (1,), 16)
    dq = _accum_spec(head_dim)
    cu = TensorSpec("int32", (Sym(),), (1,), 4) if varlen else None
    # deterministic: (B, Hq + Hkv, blocks), query blocks' then key blocks' semaphores
    semaphores = TensorSpec("int32", (Sym(),) * 3, (Sym(), Sym(), 1), 4)
    scalars = tuple(ScalarSpec(t) for t in ("float32",) * 3 + ("int32",) * 6)
    # dq: the dQ accumulator, then the dK / dV accumulators of a split group (same layout)
    return ((qkv, qkv, qkv, qkv, rows, rows, dq, qkv, qkv, cu, cu, semaphores, dq) + scalars
            + (StreamSpec(),))


def _accum_spec(head_dim: int) -> TensorSpec:
    """The fp32 dQ accumulator: (H, R, D), contiguous (``dq_accum.py``)."""
    return TensorSpec("float32", (Sym(), Sym(), head_dim), (Sym(divisibility=4), head_dim, 1), 16)


def bwd_rows_specs(dtype: str, head_dim: int, varlen: bool = False) -> dict:
    """The argument signatures of the backward's row passes (``preprocess.py``), by class
    name."""
    rows = _qkv_spec(dtype, head_dim, False)  # O, dO, dQ: (B, S, H, D); varlen with B = 1
    stats = TensorSpec("float32", (Sym(),) * 3, (Sym(), Sym(), 1), 4)  # (B, H, S)
    acc = _accum_spec(head_dim)
    cu = TensorSpec("int32", (Sym(),), (1,), 4) if varlen else None
    return {"BwdPrepareSm90": (rows, rows, stats, stats, stats, acc, cu, ScalarSpec("int32"),
                               StreamSpec()),
            "BwdFinishSm90": (acc, rows, ScalarSpec("float32"), cu, ScalarSpec("int32"),
                              StreamSpec())}


def _bwd_rows_configurations(dims, dtypes, bwd_configs) -> list:
    from .preprocess import BwdFinishConfig, BwdFinishSm90, BwdPrepareSm90, BwdRowsConfig

    finishes = sorted({(c.head_dim, c.tile_m, c.varlen) for c in bwd_configs if c.head_dim in dims}
                      | {(c.head_dim, c.tile_n, c.varlen) for c in bwd_configs
                         if c.head_dim in dims and kv_splits_supported(c)})
    prepares = [(BwdPrepareSm90, BwdRowsConfig(d, varlen),
                 bwd_rows_specs(dtype, d, varlen)["BwdPrepareSm90"])
                for d in dims for dtype in dtypes for varlen in (False, True)]
    return prepares + [(BwdFinishSm90, BwdFinishConfig(*f),
                        bwd_rows_specs(dtype, f[0], f[2])["BwdFinishSm90"])
                       for f in finishes for dtype in dtypes]


def compile_configurations(quick: bool = False) -> list:
    """(kernel class, config, specs) of every forward kernel the heuristics can launch: each
    head dim, with and without a mask, softcap and varlen, in bf16 and fp16. ``quick`` keeps
    bf16 head dim 128 with and without a causal mask."""
    from .config import all_fwd_configs
    from .fwd_sm90 import FlashAttnFwdSm90

    configs = all_fwd_configs()
    dtypes = ("bfloat16", "float16")
    if quick:
        configs = [c for c in configs if c.head_dim == 128 and not c.softcap and not c.varlen]
        dtypes = ("bfloat16",)
    from .config import all_bwd_configs

    bwd = all_bwd_configs()
    if quick:
        bwd = [c for c in bwd if c.head_dim == 128 and not c.softcap and not c.varlen]
    dims = (128,) if quick else HEAD_DIMS
    return ([(FlashAttnFwdSm90, cfg, kernel_specs(dtype, cfg.head_dim, cfg.varlen))
             for cfg in configs for dtype in dtypes]
            + [(_bwd_class(cfg.head_dim), cfg, bwd_kernel_specs(dtype, cfg.head_dim, cfg.varlen))
               for cfg in bwd for dtype in dtypes]
            + _bwd_rows_configurations(dims, dtypes, bwd))


def self_checks():
    """Rows of the ``python -m cute_kernels`` table for attention."""
    from ..reference.attention import attention_ref
    from ..runtime.selfcheck import SelfCheck

    checks = []
    for causal in (False, True):
        q, k, v = (torch.randn(2, 1024, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref, _ = attention_ref(q, k, v, causal=causal)

        def sdpa(q=q, k=k, v=v, causal=causal):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)

        checks.append(SelfCheck("attn_fwd_causal" if causal else "attn_fwd", "2x1024x8x128", "bfloat16",
                                lambda q=q, k=k, v=v, causal=causal: flash_attn(q, k, v, causal=causal),
                                sdpa, ref, 2e-2))
    return checks


def _l2_group(seqlen_k: int, head_dim: int, itemsize: int, local: bool) -> int:
    """How many (batch, head) pairs the grid interleaves (module docstring of fwd_sm90.py).

    Without a mask every tile of a pair costs the same: 1, so the CTAs that run together are
    consecutive query tiles of one pair, reading the same K and V blocks at the same time
    (measured on H100, hdim 128: 3-9% faster than interleaving the pairs that fit in L2).
    Causal / local: the pairs whose K and V fit in L2 together, a power of 2, so the longest
    tiles of all of them start first."""
    if not local:
        return 1
    per_pair = max(1, seqlen_k * head_dim * 2 * itemsize)
    group = max(1, L2_BYTES // per_pair)
    return 1 << (group.bit_length() - 1)


def _bwd_pair_group(seqlen_q: int, key_blocks: int, row_bytes: int, device_index: int) -> int:
    """How many (kv head, sequence) pairs the backward's masked grid interleaves
    (``tile_coords`` in bwd_sm90.py), a power of 2: no more than one wave of CTAs (so a
    group's CTAs run together and share each pair's Q and dO rows, ``row_bytes`` per query
    row over the group's query heads) and no more than have those rows fit in L2 together.
    Measured on H100 (bf16, 16k tokens, causal, against each pair's key blocks in turn): +1-11%
    at S = 2048-8192, +4-8% for the GQA backward (32 / 8 heads), parity at 1024 and 16384;
    groups sized by L2 alone (up to 64 pairs at 1024) ran 18% slower there."""
    by_wave = max(1, sm_count(device_index) // max(1, key_blocks))
    by_l2 = max(1, L2_BYTES // max(1, seqlen_q * row_bytes * 2))
    group = min(by_wave, by_l2)
    return 1 << (group.bit_length() - 1)


@kernel_op("flash_attn_fwd", mutates_args=("out", "lse"))
def flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
                   cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
                   softmax_scale: float, local: bool, window_left: int, window_right: int,
                   softcap: float) -> None:
    """out, lse = attention(q, k, v) for validated inputs (see :func:`flash_attn`): batch
    layout (B, S, H, D) without cu_seqlens, packed (total, H, D) with them. Windows are
    non-negative here (unbounded sides already replaced by Sq + Sk)."""
    kernel, scalars = _forward_launch(q, cu_seqlens_q is not None, max_seqlen_k, softmax_scale,
                                      local, softcap, window_left + window_right + 1)
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    scale_log2, prescale, group, ctas = scalars
    kernel(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, scale_log2, prescale, window_left,
           window_right, max_seqlen_q, group, ctas)


def _forward_launch(q: torch.Tensor, varlen: bool, max_seqlen_k: int, softmax_scale: float,
                    local: bool, softcap: float, window_keys: int):
    """The compiled forward kernel for these options and its scalar arguments
    (scale_log2, softcap_prescale, l2_group, max_ctas); ``window_keys``: the window's width
    (left + right + 1, unbounded sides as Sq + Sk)."""
    head_dim = q.shape[-1]
    config = attention_fwd_config(head_dim, local=local, softcap=softcap > 0, varlen=varlen,
                                  max_seqlen_k=max_seqlen_k,
                                  window_keys=min(window_keys, max_seqlen_k) if local else None)
    kernel = _compiled("fwd", config, q.dtype, q.device.index)
    if softcap > 0:
        scale_log2, prescale = softcap * LOG2_E, softmax_scale / softcap
    else:
        scale_log2, prescale = softmax_scale * LOG2_E, 1.0
    group = _l2_group(max_seqlen_k, head_dim, q.element_size(), local)
    # Persistent: one CTA per SM; otherwise one per tile (each CTA then stages O over Q).
    ctas = sm_count(q.device.index) if config.persistent else INT32_MAX
    return kernel, (scale_log2, prescale, group, ctas)


@kernel_op("flash_attn_bwd", mutates_args=("dq", "dk", "dv"))
def flash_attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                   dv: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
                   cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
                   softmax_scale: float, local: bool, window_left: int, window_right: int,
                   softcap: float, deterministic: bool) -> None:
    """dq, dk, dv of :func:`flash_attn_fwd` for validated inputs (its layouts and options).

    Three launches: a row pass (``preprocess.py``) writes D = rowsum(dO * O) and the LSE in
    log2 units (+inf for rows that saw no key) where the main kernel reads them and zeroes an
    fp32 dQ accumulator (``dq_accum.py``); the main kernel adds dQ into it; a finish pass
    scales it into ``dq``. Where a kv head's group of query heads is split over CTAs
    (``config.bwd_kv_splits``), dK and dV go the same way: a zeroed fp32 accumulator, and two
    more finish passes.
    ``deterministic``: the adds go in a fixed order, through zeroed int32 semaphores: one per
    (sequence, query head, query block), then one per (sequence, kv head, key block) for the
    runs of a split group."""
    varlen = cu_seqlens_q is not None
    head_dim = q.shape[-1]
    config = attention_bwd_config(head_dim, local=local, softcap=softcap > 0, varlen=varlen,
                                  deterministic=deterministic)
    kernel = _compiled("bwd", config, q.dtype, q.device.index)
    if softcap > 0:
        scale_log2, prescale = softcap * LOG2_E, softmax_scale / softcap
    else:
        scale_log2, prescale = softmax_scale * LOG2_E, 1.0
    batches = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    heads = q.shape[-2]
    dq_accum = torch.empty(heads, accum_rows(batches, q.shape[-3], config.tile_m, varlen),
                           head_dim, dtype=torch.float32, device=q.device)
    rows = (lambda t: t.unsqueeze(0)) if varlen else (lambda t: t)  # (B, S, H, D)
    out_rows, dout_rows = _aligned(rows(out)), _aligned(rows(dout))
    prepare = _compiled("bwd_prepare", (head_dim, varlen), q.dtype, q.device.index)
    if varlen:
        lse_log2, dsum = _varlen_rows(lse, batches), _varlen_rows(lse, batches)
        prepare(out_rows, dout_rows, lse.unsqueeze(0), lse_log2, dsum, dq_accum, cu_seqlens_q,
                max_seqlen_q)
        lse_log2, dsum = lse_log2[0], dsum[0]
    else:
        lse_log2, dsum = _padded_rows(lse), _padded_rows(lse)
        prepare(out_rows, dout_rows, lse, lse_log2, dsum, dq_accum, None, q.shape[1])
    if deterministic:
        blocks = max(-(-max_seqlen_q // config.tile_m), -(-max_seqlen_k // config.tile_n))
        semaphores = torch.zeros(batches, heads + k.shape[-2], blocks, dtype=torch.int32,
                                 device=q.device)
    else:
        semaphores = torch.empty(1, 1, 1, dtype=torch.int32, device=q.device)
    heads_kv = k.shape[-2]
    group = heads // heads_kv
    splits = bwd_kv_splits(config, group, window_left + window_right >= max_seqlen_q)
    dkv_accum = dq_accum  # read only where the group is split
    if splits > 1:
        rows_k = accum_rows(batches, k.shape[-3], config.tile_n, varlen)
        dkv_accum = torch.zeros(2 * heads_kv, rows_k, head_dim, dtype=torch.float32,
                                device=q.device)
    kernel(_aligned(q), _aligned(k), _aligned(v), _aligned(dout), lse_log2, dsum,
           dq_accum, dk, dv, cu_seqlens_q, cu_seqlens_k, semaphores, dkv_accum, scale_log2,
           prescale, softmax_scale, window_left, window_right, max_seqlen_k,
           _bwd_pair_group(max_seqlen_q, -(-max_seqlen_k // config.tile_n),
                           head_dim * -(-group // splits) * q.element_size(), q.device.index),
           sm_count(q.device.index) if config.persistent else INT32_MAX, splits)
    finish = functools.partial(_finish, q.dtype, q.device.index, head_dim, varlen)
    finish(config.tile_m, dq_accum, rows, dq, softmax_scale, cu_seqlens_q, max_seqlen_q)
    if splits > 1:  # dK (scaled in the kernel) and dV from their accumulators
        for accum, grad in ((dkv_accum[:heads_kv], dk), (dkv_accum[heads_kv:], dv)):
            finish(config.tile_n, accum, rows, grad, 1.0, cu_seqlens_k, max_seqlen_k)


def _finish(dtype, device_index, head_dim, varlen, tile, accum, rows, grad, scale, cu_seqlens,
            max_seqlen) -> None:
    """``grad`` = ``scale`` * an fp32 accumulator of blocks of ``tile`` rows (``dq_accum.py``)."""
    grad_rows = _aligned(rows(grad))
    _compiled("bwd_finish", (head_dim, tile, varlen), dtype, device_index)(
        accum, grad_rows, scale, cu_seqlens, max_seqlen)
    if grad_rows.data_ptr() != grad.data_ptr():  # the gradient's own strides were not on 16 bytes
        grad.copy_(grad_rows.view(grad.shape))


@functools.lru_cache(maxsize=None)
def _compiled(kind: str, config, dtype: torch.dtype, device_index: int):
    """The compiled kernel of ``kind`` ("fwd", "bwd"; "bwd_prepare": then ``config`` is (head
    dim, varlen); "bwd_finish": (head dim, tile_m, varlen)) for a configuration and dtype on a
    device: the compile cache's lookup, which builds and hashes the argument specs (tens of
    microseconds of host time), once per process."""
    name = dtype_name(dtype)
    if kind == "fwd":
        from .fwd_sm90 import FlashAttnFwdSm90  # the kernel modules: imported at the first compile

        return get_kernel(FlashAttnFwdSm90, config, kernel_specs(name, config.head_dim, config.varlen))
    if kind == "bwd":
        return get_kernel(_bwd_class(config.head_dim), config,
                          bwd_kernel_specs(name, config.head_dim, config.varlen))
    from . import preprocess

    if kind == "bwd_prepare":
        head_dim, varlen = config
        return get_kernel(preprocess.BwdPrepareSm90, preprocess.BwdRowsConfig(head_dim, varlen),
                          bwd_rows_specs(name, head_dim, varlen)["BwdPrepareSm90"])
    head_dim, tile_m, varlen = config
    return get_kernel(preprocess.BwdFinishSm90,
                      preprocess.BwdFinishConfig(head_dim, tile_m, varlen),
                      bwd_rows_specs(name, head_dim, varlen)["BwdFinishSm90"])


def _bwd_class(head_dim: int):
    """The backward kernel's class for a head dim (the kernel modules: imported when needed)."""
    if head_dim in BWD_WIDE_HEAD_DIMS:
        from .bwd_wide_sm90 import FlashAttnBwdWideSm90

        return FlashAttnBwdWideSm90
    from .bwd_sm90 import FlashAttnBwdSm90

    return FlashAttnBwdSm90


def _varlen_rows(lse: torch.Tensor, batches: int) -> torch.Tensor:
    """An fp32 (1, Hq, rows) tensor for the LSE's log2 copy or D of packed sequences, as the
    backward kernel reads them: sequence b's rows from 4 * (cu_seqlens_q[b] // 4 + b)
    (``bwd_sm90.padded_row_offset``), rows on 16 bytes for TMA. The prepare pass fills it, the
    rows between sequences with zeros (read only as masked rows past a sequence)."""
    total = lse.shape[1]
    width = total + 4 * batches + (-total % 4)
    return torch.empty(1, lse.shape[0], width, dtype=torch.float32, device=lse.device)


def _padded_rows(like: torch.Tensor) -> torch.Tensor:
    """An fp32 tensor shaped as ``like`` (the LSE's (..., rows)) whose row stride is a multiple
    of 4 elements (16 bytes: the backward kernel reads it with TMA)."""
    rows = like.shape[-1]
    return torch.empty(*like.shape[:-1], rows + (-rows % 4), dtype=torch.float32,
                       device=like.device)[..., :rows]


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when TMA can read it, else a view or copy that it can (the last dim is
    already unit-stride). Size-1 dims first get the stride a contiguous tensor would have:
    they never address anything."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0 and all(
            s > 0 and s % ALIGN == 0 for s in t.stride()[:-1]):
        return t  # the common case (a size-1 dim's stride is free in a contiguous tensor)
    strides = list(t.stride())
    for i in range(t.dim() - 2, -1, -1):
        if t.shape[i] == 1:
            strides[i] = strides[i + 1] * t.shape[i + 1]
    if strides != list(t.stride()):
        t = t.as_strided(t.shape, strides)
    if (any(s % ALIGN or (s == 0 and n > 1) for s, n in zip(strides[:-1], t.shape))
            or t.data_ptr() % 16):
        t = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
    return t


def _check_qkv(q, k, v, rank: int, layout: str):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, DTYPES, like=q if name != "q" else None)
        if t.dtype != q.dtype:
            raise DTypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}: they must match")
        if t.dim() != rank:
            raise UnsupportedError(f"{name} has shape {tuple(t.shape)}; expected {rank} dims {layout}")
        if t.shape[-1] and t.stride(-1) != 1:
            raise UnsupportedError(f"{name} has stride {t.stride()}: its last dim (the head dim) "
                                   f"must be contiguous (stride 1)")
    head_dim = q.shape[-1]
    for name, dim in (("q", head_dim), ("v", v.shape[-1])):
        if not (0 < dim <= HEAD_DIMS[-1] and dim % HEAD_DIM_ALIGN == 0):
            raise UnsupportedError(
                f"head dim {dim} ({name}.shape[-1]) is not supported; supported: multiples of "
                f"{HEAD_DIM_ALIGN} up to {HEAD_DIMS[-1]} ({', '.join(map(str, HEAD_DIMS))} run as "
                f"they are, others zero-padded to the next of those)")
    if k.shape[-1] != head_dim:
        raise UnsupportedError(f"head dims differ: q {head_dim}, k {k.shape[-1]}; k must have "
                               f"q's head dim (v may have its own)")
    if k.shape[:-1] != v.shape[:-1]:
        raise UnsupportedError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same "
                               f"shape but for the head dim")
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    if heads_kv == 0 or heads_q % heads_kv:
        raise UnsupportedError(f"q has {heads_q} heads and k / v {heads_kv}: the number of query "
                               f"heads must be a positive multiple of the key / value heads")


def _kernel_head_dim(dim_qk: int, dim_v: int) -> int:
    """The head dim the kernels run for these head dims of q / k and of v: the smallest of
    ``HEAD_DIMS`` that holds both."""
    return next(d for d in HEAD_DIMS if d >= max(dim_qk, dim_v))


def _padded(q, k, v):
    """q, k and v zero-padded along the head dim to ``_kernel_head_dim`` (padding adds nothing
    to q . k, and V's zero columns give zero output columns), or None where they run as they
    are."""
    dim = _kernel_head_dim(q.shape[-1], v.shape[-1])
    if q.shape[-1] == dim and v.shape[-1] == dim:
        return None
    return tuple(torch.nn.functional.pad(t, (0, dim - t.shape[-1])) for t in (q, k, v))


def _unpadded(result, dim_v: int, returns: str):
    """A padded call's result with out cut back to v's head dim (contiguous, as an unpadded
    call's)."""
    if returns == "out":
        return result[..., :dim_v].contiguous()
    return (result[0][..., :dim_v].contiguous(), *result[1:])


def _check_options(softmax_scale, window_size, softcap, dropout_p, alibi_slopes, head_dim):
    if dropout_p != 0.0:
        raise UnsupportedError(f"dropout_p={dropout_p!r} is not supported (only 0.0)")
    if alibi_slopes is not None:
        raise UnsupportedError("alibi_slopes is not supported (only None)")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and w >= -1 for w in window_size)):
        raise UnsupportedError(f"window_size={window_size!r}: expected (left, right), ints >= -1 "
                               f"(-1: unbounded)")
    if not isinstance(softcap, (int, float)) or not 0 <= softcap < math.inf:
        raise UnsupportedError(f"softcap={softcap!r}: expected a finite float >= 0 (0: off)")
    if softmax_scale is None:
        return 1.0 / math.sqrt(int(head_dim))
    if not isinstance(softmax_scale, (int, float)) or not -math.inf < softmax_scale < math.inf:
        raise UnsupportedError(f"softmax_scale={softmax_scale!r}: expected a finite float or None")
    return float(softmax_scale)


def _window(causal: bool, window_size, unbounded: int) -> tuple[bool, int, int]:
    """(local, left, right) for the kernel: unbounded sides, and sides wider than
    ``unbounded`` (past every key), as ``unbounded``, so that the kernels' 32-bit window
    arithmetic never overflows."""
    left, right = window_size
    if causal:
        right = 0
    local = left >= 0 or right >= 0
    return local, *(min(side, unbounded) if side >= 0 else unbounded for side in (left, right))


class _FlashAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, fwd, bwd):
        out, lse = fwd(q, k, v)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.bwd = bwd
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        check_tensor("grad of flash_attn's output", dout, DTYPES)
        dq, dk, dv = ctx.bwd(q, k, v, out, lse, dout.to(q.dtype))
        return dq, dk, dv, None, None


def _needs_grad(q, k, v) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _returns(return_lse, return_attn_probs) -> str:
    """What a call returns: "out", "lse" (out, lse) or "probs" (out, lse, None), FlashAttention's
    ``return_attn_probs`` form (its third value, the dropout mask's probabilities, is None
    without dropout)."""
    if return_lse and return_attn_probs:
        raise UnsupportedError("return_lse=True and return_attn_probs=True: pass one of them "
                               "(return_attn_probs returns (out, lse, None), return_lse (out, lse))")
    return "probs" if return_attn_probs else "lse" if return_lse else "out"


def _result(out, lse, returns: str):
    return out if returns == "out" else (out, lse) if returns == "lse" else (out, lse, None)


def _attend(q, k, v, fwd, bwd, returns):
    """``fwd(q, k, v)``, through the autograd Function (with ``bwd``) when a gradient is needed;
    the outputs as ``returns`` says (``_returns``)."""
    if _needs_grad(q, k, v):
        out, lse = _FlashAttn.apply(q, k, v, fwd, bwd)
    else:
        out, lse = fwd(q, k, v)
    return _result(out, lse, returns)


def _gradients(q, k, v, grads):
    """dQ, dK, dV buffers: ``grads`` where given (views of a packed gradient), else new."""
    return grads if grads is not None else (torch.empty_like(q), torch.empty_like(k),
                                            torch.empty_like(v))


def _batch_backward(q, k, v, out, lse, dout, scale, causal, window_size, softcap, deterministic,
                    grads=None):
    dq, dk, dv = _gradients(q, k, v, grads)
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k = k.shape[1]
    if batch == 0 or seqlen_q == 0 or seqlen_k == 0 or heads_q == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    local, left, right = _window(causal, window_size, seqlen_q + seqlen_k)
    flash_attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, None, None, seqlen_q, seqlen_k, scale,
                   local, left, right, float(softcap), deterministic)
    return dq, dk, dv


def _batch_forward(q, k, v, scale, causal, window_size, softcap):
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k = k.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
    if batch == 0 or seqlen_q == 0 or heads_q == 0:
        return out, lse
    if seqlen_k == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    local, left, right = _window(causal, window_size, seqlen_q + seqlen_k)
    flash_attn_fwd(q, k, v, out, lse, None, None, seqlen_q,
                   seqlen_k, scale, local, left, right, float(softcap))
    return out, lse


_plans: dict = {}  # eager launch plans of ``flash_attn`` forward calls (see ``_forward_plan``)
PLAN_LIMIT = 1024


def _plan_key(q, k, v, softmax_scale, causal, window_size, softcap, dropout_p, alibi_slopes,
              returns):
    """What a launch plan of an eager ``flash_attn`` call depends on, or None where no plan
    applies (torch.compile, arguments that are not plain tensors and numbers)."""
    if (torch.compiler.is_compiling() or not all(type(t) is torch.Tensor for t in (q, k, v))
            or alibi_slopes is not None or dropout_p != 0.0 or not isinstance(window_size, tuple)):
        return None
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
            v.dtype, q.device, k.device, v.device, softmax_scale, bool(causal), window_size,
            softcap, returns)


def _forward_plan(q, k, v, scale, causal, window_size, softcap, returns):
    """A launch plan for later calls like this one (validated; no gradient): the compiled kernel
    and its scalars, so that a call allocates its outputs and launches, without the checks and
    the custom op's dispatch. None where the call needs more than one launch (an empty
    problem, a copy of an input TMA cannot read)."""
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k = k.shape[1]
    if batch == 0 or seqlen_q == 0 or heads_q == 0 or seqlen_k == 0:
        return None
    if any(_aligned(t) is not t for t in (q, k, v)):
        return None
    local, left, right = _window(causal, window_size, seqlen_q + seqlen_k)
    kernel, (scale_log2, prescale, group, ctas) = _forward_launch(q, False, seqlen_k, scale,
                                                                  local, float(softcap),
                                                                  left + right + 1)
    out_shape, lse_shape = q.shape, (batch, heads_q, seqlen_q)
    dtype, device = q.dtype, q.device

    def run(q, k, v):
        out = torch.empty(out_shape, dtype=dtype, device=device)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=device)
        kernel(q, k, v, out, lse, None, None, scale_log2, prescale, left, right, seqlen_q, group, ctas)
        return _result(out, lse, returns)

    return run


def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
               softmax_scale: float | None = None, causal: bool = False,
               window_size: tuple = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
               deterministic: bool = False, return_attn_probs: bool = False, *,
               return_lse: bool = False):
    """Attention of q over k, v (FlashAttention-2 on Hopper), as ``flash_attn_func``: the same
    arguments in the same order (positional or by name).

    Args:
        q: (B, Sq, Hq, D), bf16 or fp16. k: (B, Sk, Hkv, D), v: (B, Sk, Hkv, Dv), q's dtype;
            Hq a multiple of Hkv (MHA, GQA, MQA: query head h reads key / value head
            h // (Hq / Hkv)).
        softmax_scale: multiplies q . k (default 1 / sqrt(D)).
        causal: query row i sees keys j <= i + Sk - Sq (aligned bottom-right, as FlashAttention).
        window_size: (left, right) sliding window: keys i + Sk - Sq - left .. i + Sk - Sq + right;
            -1 leaves a side unbounded. With ``causal`` the right side is 0.
        softcap: > 0 caps the scores: softcap * tanh(score / softcap) (after the scale).
        dropout_p, alibi_slopes: accepted for compatibility; only 0.0 and None.
        deterministic: the backward sums dQ over key blocks in one fixed order (semaphores
            between the CTAs of a head), so gradients are bit-identical from run to run; the
            forward always is. Measured cost on an H100: 11-15% of the backward at hdim 128,
            S = 4096 (less causal than full), ~0 at hdim 64 (benchmarks/NOTES.md).
        return_attn_probs: return ``(out, lse, None)`` as ``flash_attn_func`` does without
            dropout (its third value holds dropout's probabilities): the log-sum-exp of each
            row's scores, fp32 (B, Hq, Sq), as the second.
        return_lse (keyword only): return ``(out, lse)``.

    Returns ``out`` (B, Sq, Hq, Dv) in q's dtype, or ``(out, lse)``, or ``(out, lse, None)``.
    The LSE is not differentiable (its gradient is taken as 0). A row that sees no key
    (an empty window, Sk = 0) gets out 0 and LSE -inf. Repeated eager calls without gradients
    with the same shapes, strides and options take a launch plan made on the first one (no
    checks or custom-op dispatch: an allocation of the outputs and one launch).

    Constraints:
      - head dims D (q, k) and Dv (v): multiples of 8 up to 256. The kernels run 64, 96,
        128, 192 and 256; other head dims (and Dv != D) run zero-padded to the next of those
        that holds both (a copy of q, k and v, and the padded columns' work); fp32 accumulation
      - the head dim contiguous; other strides that are not multiples of 8 elements (or a data
        pointer not on 16 bytes) cost a copy of that tensor
      - differentiable at every head dim (with or without softcap). dQ is summed with atomic
        adds (and dK / dV too where more than 4 query heads per kv head under a causal mask
        are split over CTAs, at head dims 96 / 128), so gradients are bit-identical from run
        to run only with ``deterministic=True``
    """
    return _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                       alibi_slopes, deterministic, _returns(return_lse, return_attn_probs), _attend)


def _flash_attn(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, returns, attend):
    """:func:`flash_attn`'s body; ``attend`` runs the validated call (``_attend``, or the packed
    forms' own, ``packed.py``)."""
    key = _plan_key(q, k, v, softmax_scale, causal, window_size, softcap, dropout_p, alibi_slopes,
                    returns)
    if key is not None:
        plan = _plans.get(key)
        if plan is not None and not _needs_grad(q, k, v) and not (
                q.data_ptr() % 16 or k.data_ptr() % 16 or v.data_ptr() % 16):
            return plan(q, k, v)
    _check_qkv(q, k, v, 4, "(batch, seqlen, heads, head_dim)")
    if k.shape[0] != q.shape[0]:
        raise UnsupportedError(f"q has batch {q.shape[0]} and k / v {k.shape[0]}: they must match")
    scale = _check_options(softmax_scale, window_size, softcap, dropout_p, alibi_slopes, q.shape[-1])
    padded = _padded(q, k, v)
    if padded is not None:
        return _unpadded(_flash_attn(*padded, dropout_p, scale, causal, window_size, softcap,
                                     alibi_slopes, deterministic, returns, _attend),
                         v.shape[-1], returns)
    if key is not None and key not in _plans and not _needs_grad(q, k, v):
        if len(_plans) >= PLAN_LIMIT:  # many shapes (growing sequences): start over
            _plans.clear()
        _plans[key] = _forward_plan(q, k, v, scale, causal, window_size, softcap, returns)

    def fwd(q, k, v):
        return _batch_forward(q, k, v, scale, causal, window_size, softcap)

    def bwd(q, k, v, out, lse, dout, grads=None):
        return _batch_backward(q, k, v, out, lse, dout, scale, causal, window_size, softcap,
                               bool(deterministic), grads)

    return attend(q, k, v, fwd, bwd, returns)


def _check_cu_seqlens(name: str, cu: torch.Tensor, device, batch: int | None):
    if not isinstance(cu, torch.Tensor):
        raise UnsupportedError(f"{name} must be a torch.Tensor of int32 offsets, got {describe(cu)}")
    if cu.dtype != torch.int32:
        raise DTypeError(f"{name} has dtype {cu.dtype}; expected torch.int32")
    if cu.device != device:
        raise UnsupportedError(f"{name} is on {cu.device}; expected q's device {device}")
    if cu.dim() != 1 or cu.shape[0] < 1 or (batch is not None and cu.shape[0] != batch + 1):
        want = "batch + 1 offsets" if batch is None else f"{batch + 1} offsets (like cu_seqlens_q)"
        raise UnsupportedError(f"{name} has shape {tuple(cu.shape)}; expected 1-D with {want}")
    return cu.contiguous()


def flash_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                      max_seqlen_k: int, dropout_p: float = 0.0,
                      softmax_scale: float | None = None, causal: bool = False,
                      window_size: tuple = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
                      deterministic: bool = False, return_attn_probs: bool = False,
                      block_table=None, *, return_lse: bool = False):
    """Attention over packed sequences, as ``flash_attn_varlen_func`` (the same arguments in
    the same order; ``block_table``, a paged KV cache, only None).

    Args:
        q: (total_q, Hq, D); k: (total_k, Hkv, D), v: (total_k, Hkv, Dv): sequence b is rows
            ``cu_seqlens[b]:cu_seqlens[b + 1]`` (int32, B + 1 non-decreasing offsets from 0).
        max_seqlen_q, max_seqlen_k: the longest sequence lengths (they size the grid; a smaller
            value than a real length leaves that sequence's tail rows unwritten).
        The options are :func:`flash_attn`'s, applied to each sequence on its own (masks
        aligned bottom-right per sequence).

    Returns ``out`` (total_q, Hq, Dv), or with ``return_lse`` ``(out, lse)``, lse fp32 (Hq,
    total_q), or with ``return_attn_probs`` ``(out, lse, None)``. Rows of a zero-length key
    sequence get out 0 and LSE -inf.

    Constraints: :func:`flash_attn`'s; the offsets are read by the kernel, never synchronized
    on, so they are not checked against the tensors' lengths.
    """
    if block_table is not None:
        raise UnsupportedError("block_table (a paged KV cache) is not supported: pass None, with "
                               "k and v as packed (total_k, heads, head_dim) tensors")
    return _flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              dropout_p, softmax_scale, causal, window_size, softcap,
                              alibi_slopes, deterministic,
                              _returns(return_lse, return_attn_probs), _attend)


def _flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                       softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                       returns, attend):
    """:func:`flash_attn_varlen`'s body; ``attend`` as :func:`_flash_attn`'s."""
    _check_qkv(q, k, v, 3, "(total_tokens, heads, head_dim)")
    cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device, None)
    cu_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device, cu_q.shape[0] - 1)
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(value, int) or value < 0:
            raise UnsupportedError(f"{name}={value!r}: expected an int >= 0")
    scale = _check_options(softmax_scale, window_size, softcap, dropout_p, alibi_slopes, q.shape[-1])
    padded = _padded(q, k, v)
    if padded is not None:
        return _unpadded(_flash_attn_varlen(*padded, cu_q, cu_k, max_seqlen_q, max_seqlen_k,
                                            dropout_p, scale, causal, window_size, softcap,
                                            alibi_slopes, deterministic, returns, _attend),
                         v.shape[-1], returns)

    def fwd(q, k, v):
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
        if q.shape[0] == 0 or q.shape[1] == 0 or max_seqlen_q == 0 or cu_q.shape[0] == 1:
            return out, lse
        if k.shape[0] == 0 or max_seqlen_k == 0:
            return out.zero_(), lse.fill_(float("-inf"))
        local, left, right = _window(causal, window_size, max_seqlen_q + max_seqlen_k)
        flash_attn_fwd(q, k, v, out, lse, cu_q, cu_k, max_seqlen_q,
                       max_seqlen_k, scale, local, left, right, float(softcap))
        return out, lse

    def bwd(q, k, v, out, lse, dout, grads=None):
        dq, dk, dv = _gradients(q, k, v, grads)
        if (q.shape[0] == 0 or q.shape[1] == 0 or max_seqlen_q == 0 or cu_q.shape[0] == 1
                or k.shape[0] == 0 or max_seqlen_k == 0):
            return dq.zero_(), dk.zero_(), dv.zero_()
        local, left, right = _window(causal, window_size, max_seqlen_q + max_seqlen_k)
        flash_attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_seqlen_q, max_seqlen_k,
                       scale, local, left, right, float(softcap), bool(deterministic))
        return dq, dk, dv

    return attend(q, k, v, fwd, bwd, returns)
