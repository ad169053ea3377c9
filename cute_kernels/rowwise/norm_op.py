"""``rms_norm`` and ``layer_norm``: torch-facing ops, custom ops and autograd."""

from __future__ import annotations

import dataclasses
import math

import torch

from ..runtime import (DTypeError, ScalarSpec, StreamSpec, Sym, TensorSpec, UnsupportedError, get_kernel,
                       kernel_op)
from ..runtime.arch import max_active_clusters
from ..runtime.dtypes import dtype_name
from ..runtime.errors import check_tensor
from .config import CLUSTER_SIZES, RowConfig, row_config
from .dispatch import ITEMSIZE, RowKernels, row_specs, vector_width, widest_itemsize

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BACKWARD_HELD = 4  # x, dy, weight and the dw accumulator per thread (config.row_config)
BACKWARD_CTAS_PER_SM = 3  # for 128-thread backward CTAs, when their shared memory allows


def _vector_spec(dtype, n, vec, heads=0):
    """A weight or bias: (n,), or (heads, n) row-major with per-head vectors."""
    if dtype is None:
        return None
    if heads:
        return TensorSpec(dtype_name(dtype), (heads, n), (n, 1), vec * ITEMSIZE[dtype])
    return TensorSpec(dtype_name(dtype), (n,), (1,), vec * ITEMSIZE[dtype])


_STAT = TensorSpec("float32", (Sym("m"),), (1,), 4)
_PARTIAL = TensorSpec("float32", (Sym("ctas"), Sym("n_partial")), (Sym(), 1), 4)


def _build_forward(key, vec):
    from .norm import NormConfig, NormFwdSm90  # the kernel module: imported at the first compile

    x_t, r_t, w_t, b_t, y_t, h_t, layer_norm, heads, offset, n = key
    widest = widest_itemsize((x_t, r_t, y_t, h_t, w_t, b_t))
    # RMSNorm rows that would take 8 CTAs take 16 (32 values per thread; measured on H100 at
    # 4096 x 131072 bf16: 2988 -> 3033 GB/s, benchmarks/NOTES.md). LayerNorm keeps 8: its two
    # reductions (or the staged x below) lose with the wider split.
    wide = not layer_norm
    rows_widest = widest_itemsize((x_t, r_t, y_t, h_t))
    # An fp32 weight or bias next to 16-bit rows: the rows' own split (the weight's width does
    # not change how much of a row a CTA holds).
    wide_params = widest > rows_widest and r_t is None
    rows = row_config(n, vec, rows_widest if wide_params else widest, tensors_held=1, wide_clusters=wide)
    # The residual, weight and bias slices stay in registers next to x: with 32-bit rows, or
    # more than 256 values per thread in all, the row is split further to keep them out of
    # local memory (the compile tests check every combination for spills). An fp32 weight or
    # bias next to 16-bit rows (no residual) keeps the one-tensor split and its shared-memory
    # staging: up to 192 values per thread in all with the weight loaded before the reduction,
    # beyond that loaded after it (measured on H100, bf16 x, fp32 weight, against the split
    # for held tensors: 32768 x 4096 2393 -> 2950 GB/s; 16384^2 late load, NOTES.md).
    held = 1 + sum(t is not None for t in (r_t, w_t, b_t))
    late_one_cta = False
    if (rows_widest >= 4 and held > 1) or rows.elems_per_thread * held > (192 if wide_params else 256):
        if wide_params and rows.cluster_n == 1:
            late_one_cta = True
        else:
            rows = row_config(n, vec, widest, tensors_held=held, wide_clusters=wide)
    # A row split over a cluster holds one CTA per SM when the weight and bias stay in
    # registers across the reduction (over 128 values per thread): load them after it instead,
    # so two CTAs fit (LayerNorm at 4096 x 131072: 1841 -> 2423 GB/s, benchmarks/NOTES.md).
    late = (rows.cluster_n > 1 and held > 1 and rows.elems_per_thread * held > 128) or late_one_cta
    # Better still without a residual and with 16-bit x, weight and bias: x through shared
    # memory, read again after the one reduction and for the output, and the 16-bit weight and
    # bias loaded up front (LayerNorm at 4096 x 131072: 2427 -> 2714 GB/s, benchmarks/NOTES.md).
    stage_x = (late and r_t is None and vec * ITEMSIZE[x_t] >= 4
               and all(t is None or ITEMSIZE[t] == 2 for t in (x_t, w_t, b_t)))
    # LayerNorm rows split over a cluster, without a residual, 16-bit, with 16-byte vectors, when
    # the row splits evenly: x in registers (32 values per thread where that takes at most 8
    # CTAs, else 64), the moments reduced in one exchange, the weight and bias (any of them)
    # bulk-copied to shared memory at the start (measured on H100, bf16, weight and bias,
    # against the staged path: 4096 x 131072 2728 -> 2843 GB/s, 4096 x 65536 2733 -> 2927,
    # 8192 x 32768 2772 -> 2952; benchmarks/NOTES.md).
    one_exchange = False
    split = row_config(n, vec, widest, tensors_held=1)
    if (layer_norm and not heads and r_t is None and vec * ITEMSIZE[x_t] == 16 and split.cluster_n > 1
            and all(t is None or ITEMSIZE[t] == 2 for t in (x_t, w_t, b_t))):
        if split.cluster_n < 8:
            split = row_config(n, vec, widest, tensors_held=3)
        if split.even_n and split.elems_per_thread <= 64:
            rows, stage_x, one_exchange = split, False, True
    affine = w_t is not None or b_t is not None
    config = NormConfig(rows, layer_norm, w_t is not None, b_t is not None, r_t is not None,
                        late_affine=late and not (stage_x or one_exchange), stage_x=stage_x,
                        one_exchange=one_exchange, stage_affine=one_exchange and affine,
                        weight_offset=offset, heads=heads)
    x, r, y, h = (None if d is None else row_specs((d,), n, vec)[0] for d in (x_t, r_t, y_t, h_t))
    specs = (x, r, _vector_spec(w_t, n, vec, heads), _vector_spec(b_t, n, vec, heads), y, h, _STAT,
             _STAT if layer_norm else None, ScalarSpec("float32"), row_specs((), n, vec)[-1])
    return NormFwdSm90, config, specs


# The longest rows of the backward: on 16 CTAs of 256 threads (32 values each, dw and db in
# registers), and on 16 CTAs of 512 threads (``long_rows``).
BACKWARD_REGISTER_ROW = 16 * 256 * (128 // BACKWARD_HELD)
BACKWARD_MAX_ROW = 16 * 512 * 32
# Shared memory for a long-row backward's stages and accumulators (the rest of 227 KB holds
# the reduction's exchange buffers).
LONG_ROW_SMEM = 220 << 10


def backward_rows(n: int, vec: int, widest: int) -> RowConfig:
    """Launch shape of the backward. Rows of more than 2048 elements (up to 65536) go to CTAs
    of 128 threads, 32 elements each, a cluster of them when longer than 4096, several CTAs per
    SM (``backward_ctas_per_sm``): one CTA's reduction overlaps the others' loads (measured on
    H100 against one 256-thread CTA per SM: RMSNorm 32768 x 4096 2708 -> 2805 GB/s, 16384 x
    16384 2413 -> 2649; LayerNorm 32768 x 4096 2558 -> 2817). Longer rows take 16 CTAs of 256
    threads, one per SM, up to 131072; beyond, 16 CTAs of 512 threads (``long_rows``, up to
    ``BACKWARD_MAX_ROW``), 32 values per thread either way."""
    if n > BACKWARD_REGISTER_ROW:
        if n > BACKWARD_MAX_ROW:
            raise UnsupportedError(
                f"row length {n} is longer than the {BACKWARD_MAX_ROW} elements the norm backward "
                f"supports (16 CTAs x 512 threads x 32 elements)")
        return RowConfig(n, vec, 512, 512, 16)
    rows = row_config(n, vec, widest, tensors_held=BACKWARD_HELD)
    per_cta = 128 * (128 // BACKWARD_HELD)
    cluster = next((c for c in CLUSTER_SIZES if n <= per_cta * c), None)
    if rows.threads_per_row >= 128 and cluster is not None:
        rows = RowConfig(n, vec, 128, 128, cluster)
    return rows


def long_row_stages(rows: RowConfig, x_size: int, dy_size: int, weight_grad: bool,
                    bias: bool) -> int:
    """Shared-memory stages of x and dy for a long-row backward: 2 where they fit beside the
    fp32 dw / db accumulators, else 1. Raises where not even one does (fp32 rows with both a
    weight and a bias gradient), since loading x and dy into registers instead spills."""
    tile = rows.rows_per_cta * rows.cols_per_cta
    acc = tile * 4 * (weight_grad + bias)
    stage = tile * (x_size + dy_size)
    for stages in (2, 1):
        if acc + stages * stage <= LONG_ROW_SMEM:
            return stages
    raise UnsupportedError(
        f"the backward of rows of {rows.n} elements with {x_size * 8}-bit x and a weight and bias "
        f"gradient is not supported (up to {BACKWARD_REGISTER_ROW}; 16-bit rows up "
        f"to {BACKWARD_MAX_ROW})")


def backward_ctas_per_sm(rows: RowConfig, x_size: int, dy_size: int, residual: bool) -> int:
    """CTAs of the backward per SM: one with 256 threads (over 128 registers each); with 128
    threads, ``BACKWARD_CTAS_PER_SM`` for rows split over a cluster, two for rows of one CTA
    (measured on H100 at 32768 x 4096, kernel alone: RMSNorm 2812 -> 2841 GB/s, LayerNorm
    2788 -> 2963; clusters of four at 16384 x 16384 fall from 2705 to 1995) and with a residual
    gradient to add (its registers do not fit three), fewer where their shared memory (two
    stages of x and dy, the fp32 dw and db partials, the exchange) does not fit."""
    if rows.num_threads > 128:
        return 1
    most = 2 if residual or rows.cluster_n == 1 else BACKWARD_CTAS_PER_SM
    tile = rows.rows_per_cta * rows.cols_per_cta
    smem = tile * (2 * (x_size + dy_size) + 2 * 4) + 2048
    return max(1, min(most, (228 << 10) // (smem + 1024)))


def _build_backward(key, vec):
    from .norm import NormBwdSm90, NormConfig

    x_t, w_t, dy_t, dh_t, dx_t, layer_norm, weight_grad, bias, heads, offset, n = key
    widest = widest_itemsize((x_t, w_t, dy_t, dh_t, dx_t))
    rows = backward_rows(n, vec, widest)
    ctas_per_sm = backward_ctas_per_sm(rows, ITEMSIZE[x_t], ITEMSIZE[dy_t], dh_t is not None)
    long_rows = rows.num_threads > 256
    if long_rows and bias and dh_t is not None and not layer_norm:
        # 512 threads leave 128 registers each: RMSNorm with a bias and a residual gradient
        # spills with 16-byte vectors and fits with 8-byte ones (compile tests).
        rows = dataclasses.replace(rows, vec=min(vec, 8 // ITEMSIZE[x_t]) or 1)
    stages = long_row_stages(rows, ITEMSIZE[x_t], ITEMSIZE[dy_t], weight_grad, bias) if long_rows else 2
    config = NormConfig(rows, layer_norm, w_t is not None, bias, dh_t is not None, weight_grad,
                        ctas_per_sm=ctas_per_sm if ctas_per_sm > 1 else 0, weight_offset=offset,
                        heads=heads, long_rows=long_rows, stages=stages)
    x, dy, dh, dx = (None if d is None else row_specs((d,), n, vec)[0] for d in (x_t, dy_t, dh_t, dx_t))
    specs = (x, _vector_spec(w_t, n, vec, heads), dy, _STAT, _STAT if layer_norm else None, dh, dx,
             _PARTIAL if weight_grad else None, _PARTIAL if bias else None,
             ScalarSpec("int32"), row_specs((), n, vec)[-1])
    return NormBwdSm90, config, specs


_forward_kernels = RowKernels(_build_forward)
_backward_kernels = RowKernels(_build_backward)


def _dtype(t):
    return None if t is None else t.dtype


@kernel_op(
    "norm_fwd",
    mutates_args=("y", "h", "rstd", "mean"),
    schema="(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, Tensor(a!) y, "
    "Tensor(b!)? h, Tensor(c!) rstd, Tensor(d!)? mean, float eps, bool layer_norm, "
    "int heads=0, float weight_offset=0.0) -> ()",
)
def norm_fwd(x, residual, weight, bias, y, h, rstd, mean, eps: float, layer_norm: bool,
             heads: int = 0, weight_offset: float = 0.0) -> None:
    """y, h (= x + residual), rstd, mean of (M, N) rows. Last dims contiguous; M >= 1. With
    ``heads``, weight and bias are (heads, N) and row r uses row r % heads."""
    key = (x.dtype, _dtype(residual), _dtype(weight), _dtype(bias), y.dtype, _dtype(h),
           layer_norm, heads, weight_offset, x.shape[1])
    tensors = tuple(t for t in (x, residual, weight, bias, y, h) if t is not None)
    _forward_kernels(key, tensors, x, residual, weight, bias, y, h, rstd, mean, eps)


def _launch_backward(x, weight, dy, rstd, mean, dh, dx, dw_partial, db_partial, layer_norm,
                     num_ctas, heads, weight_offset):
    """dx and per-CTA dw / db partials (num_ctas, N) fp32 for (M, N) rows, M >= 1, over a
    persistent grid of ``num_ctas`` row tiles at a time (``backward_grid``); with ``heads``,
    per-row partials (num_ctas * rows_per_cta, N)."""
    key = (x.dtype, _dtype(weight), dy.dtype, _dtype(dh), dx.dtype, layer_norm,
           dw_partial is not None, db_partial is not None, heads, weight_offset, x.shape[1])
    tensors = tuple(t for t in (x, weight, dy, dh, dx) if t is not None)
    _backward_kernels(key, tensors, x, weight, dy, rstd, mean, dh, dx, dw_partial, db_partial,
                      num_ctas)


@kernel_op(
    "norm_bwd",
    mutates_args=("dx", "sums"),
    schema="(Tensor x, Tensor? weight, Tensor dy, Tensor rstd, Tensor? mean, Tensor? dh, "
    "Tensor(a!) dx, Tensor(b!)? sums, bool layer_norm, bool weight_grad, bool bias_grad, "
    "int heads=0, float weight_offset=0.0) -> ()",
)
def norm_bwd(x, weight, dy, rstd, mean, dh, dx, sums, layer_norm: bool, weight_grad: bool,
             bias_grad: bool, heads: int = 0, weight_offset: float = 0.0) -> None:
    """dx of (M, N) rows, M >= 1, and into ``sums`` (fp32 (G, N4) or per head (G, heads, N4),
    N4 = N rounded up to 4; G = weight_grad + bias_grad, dw first) the weight and bias
    gradients. The persistent grid and its partials are planned here, where the sizes are
    numbers also under torch.compile."""
    m, n = x.shape
    ctas = backward_grid(m, n, x.device, x.element_size(), dy.element_size(), dh is not None, heads)
    # Partial rows: one per CTA, or with per-head vectors one per thread row (their heads
    # differ within a CTA), the row q holding head q % heads.
    part_rows = ctas * backward_rows(n, 1, 4).rows_per_cta if heads else ctas
    padded = -(-n // 4) * 4  # 16-byte partial rows for the column sums
    groups = weight_grad + bias_grad
    parts = torch.empty((groups, part_rows, padded), dtype=torch.float32, device=x.device)
    dw_part = parts[0, :, :n] if weight_grad else None
    db_part = parts[int(weight_grad), :, :n] if bias_grad else None
    _launch_backward(x, weight, dy, rstd, mean, dh, dx, dw_part, db_part, layer_norm, ctas, heads,
                     weight_offset)
    if not groups:
        return
    if heads:
        for i in range(groups):  # (rows / heads, heads, N) summed over its first dim
            column_sum(parts[i].view(part_rows // heads, heads, padded).transpose(0, 1), sums[i])
    else:
        column_sum(parts, sums)


def backward_grid(m: int, n: int, device: torch.device, x_size: int, dy_size: int,
                  residual: bool, heads: int = 0) -> int:
    """Clusters along M for the persistent backward: as many as run at once (for 16 CTAs of one
    per SM, 7 on an H100, not 132 // 16), never more than there are row tiles. With per-head
    vectors, a multiple of heads / gcd(heads, rows_per_cta), so that every row a thread visits
    (tile, tile + grid, ...) has the same head."""
    rows = backward_rows(n, 1, 4)
    index = device.index if device.index is not None else torch.cuda.current_device()
    tiles = -(-m // rows.rows_per_cta)
    ctas_per_sm = backward_ctas_per_sm(rows, x_size, dy_size, residual)
    ctas = max(1, min(tiles, max_active_clusters(index, rows.cluster_n, ctas_per_sm)))
    if heads:
        step = heads // math.gcd(heads, rows.rows_per_cta)
        ctas = max(step, ctas // step * step)
    return ctas


# ----------------------------------------------------------------------------- validation


def _check_tensor(name, t, x=None, shape=None):
    check_tensor(name, t, FLOAT_DTYPES, x)
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise UnsupportedError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _validate(x, weight, bias, residual, eps, out_dtype, per_head=False, weight_offset=0.0,
              residual_out_dtype=None) -> int:
    """Check the arguments; return N, the number of normalized elements per row."""
    _check_tensor("x", x)
    if x.dim() == 0:
        raise UnsupportedError("x must have at least one dim (the normalized one)")
    affine = weight if weight is not None else bias
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        _check_tensor(name, t, x)
        if per_head:
            if t.dim() != 2 or x.dim() < 2 or tuple(x.shape[-2:]) != tuple(t.shape):
                raise UnsupportedError(
                    f"per-head {name} of shape {tuple(t.shape)} must be (H, D) with x (..., H, D); "
                    f"x is {tuple(x.shape)}")
        elif t.dim() == 0 or t.dim() > x.dim() or tuple(x.shape[x.dim() - t.dim():]) != tuple(t.shape):
            raise UnsupportedError(
                f"{name} of shape {tuple(t.shape)} must match the trailing dims of x {tuple(x.shape)}"
            )
    if weight is not None and bias is not None and weight.shape != bias.shape:
        raise UnsupportedError(f"weight {tuple(weight.shape)} and bias {tuple(bias.shape)} differ")
    if residual is not None:
        _check_tensor("residual", residual, x, x.shape)
    for name, dtype in (("out_dtype", out_dtype), ("residual_out_dtype", residual_out_dtype)):
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise DTypeError(f"{name}={dtype} is not supported; use float32, float16 or bfloat16")
    if residual_out_dtype is not None and residual is None:
        raise UnsupportedError("residual_out_dtype needs a residual")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise UnsupportedError(f"eps must be a float >= 0, got {eps!r}")
    if isinstance(weight_offset, bool) or not isinstance(weight_offset, (int, float)) \
            or not -math.inf < weight_offset < math.inf:  # (not math.isfinite: symbolic under compile)
        raise UnsupportedError(f"weight_offset must be a finite float, got {weight_offset!r}")
    if weight_offset and weight is None:
        raise UnsupportedError(f"weight_offset={weight_offset} needs a weight")
    if per_head:
        return x.shape[-1]
    return x.shape[-1] if affine is None else affine.numel()


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as (M, n) rows with a contiguous last dim (a view when possible)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, n)


def _vector(t, n: int, heads: int):
    """A weight or bias as the kernel takes it: (n,), or (heads, n) contiguous."""
    if t is None:
        return None
    return t.reshape(heads, n).contiguous() if heads else t.reshape(n)


def _heads(weight, bias, per_head: bool):
    return (weight if weight is not None else bias).shape[0] if per_head else 0


class _Norm(torch.autograd.Function):
    # Takes and returns (M, N) rows (the caller reshapes, so that the ranks here never change
    # between calls), and keeps tensors and constants only in ctx: the sizes are read back from
    # the saved tensors (under torch.compile with changing shapes they are symbolic).
    @staticmethod
    def forward(ctx, x2, weight, bias, r2, eps, layer_norm, out_dtype, per_head, weight_offset,
                residual_out_dtype):
        m, n = x2.shape
        heads = _heads(weight, bias, per_head)
        w, b = _vector(weight, n, heads), _vector(bias, n, heads)
        y = torch.empty((m, n), dtype=out_dtype or x2.dtype, device=x2.device)
        h = None if r2 is None else torch.empty(
            (m, n), dtype=residual_out_dtype or r2.dtype, device=x2.device)
        rstd = torch.empty(m, dtype=torch.float32, device=x2.device)
        mean = torch.empty(m, dtype=torch.float32, device=x2.device) if layer_norm else None
        if m:
            norm_fwd(x2, r2, w, b, y, h, rstd, mean, float(eps), layer_norm, heads,
                     float(weight_offset))
        ctx.save_for_backward(x2 if h is None else h, weight, bias, rstd, mean)
        ctx.layer_norm, ctx.per_head, ctx.weight_offset = layer_norm, per_head, float(weight_offset)
        ctx.dtypes = (x2.dtype, None if r2 is None else r2.dtype)
        return y if h is None else (y, h)

    @staticmethod
    def backward(ctx, dy, dh=None):
        x2, weight, bias, rstd, mean = ctx.saved_tensors
        x_dtype, r_dtype = ctx.dtypes
        n = x2.shape[1]
        heads = _heads(weight, bias, ctx.per_head)
        dh2 = None if dh is None or r_dtype is None else _rows(dh, n)
        need_dw = weight is not None and ctx.needs_input_grad[1]
        need_db = bias is not None and ctx.needs_input_grad[2]
        dx, dw, db = norm_backward(x2, _vector(weight, n, heads), _rows(dy, n), rstd, mean, dh2,
                                   ctx.layer_norm, need_dw, need_db, x_dtype, heads,
                                   ctx.weight_offset)
        dweight = None if dw is None else dw.to(weight.dtype).view(weight.shape)
        dbias = None if db is None else db.to(bias.dtype).view(bias.shape)
        dresidual = None
        if r_dtype is not None and ctx.needs_input_grad[3]:
            dresidual = dx if r_dtype == x_dtype else dx.to(r_dtype)
        return dx, dweight, dbias, dresidual, None, None, None, None, None, None


def norm_backward(x, weight, dy, rstd, mean, dh, layer_norm, need_dw, need_db, dx_dtype=None,
                  heads=0, weight_offset=0.0):
    """Backward of the (M, N) row norm: (dx, dw fp32 or None, db fp32 or None).
    ``x`` is the normalized input (``x + residual`` when there was one). With ``heads``, the
    weight is (heads, N) and dw / db are (heads, N)."""
    m, n = x.shape
    dx = torch.empty((m, n), dtype=dx_dtype or x.dtype, device=x.device)
    shape = (heads, n) if heads else (n,)
    if not m:
        zeros = torch.zeros(shape, dtype=torch.float32, device=x.device)
        return dx, zeros if need_dw else None, zeros.clone() if need_db else None
    padded = -(-n // 4) * 4
    groups = need_dw + need_db
    sums = torch.empty((groups, heads, padded) if heads else (groups, padded), dtype=torch.float32,
                       device=x.device) if groups else None
    norm_bwd(x, weight, dy, rstd, mean, dh, dx, sums, layer_norm, need_dw, need_db, heads,
             weight_offset)
    dw = sums[0, ..., :n] if need_dw else None
    db = sums[int(need_dw), ..., :n] if need_db else None
    return dx, dw, db


_COLUMN_SUM_SPECS = (
    TensorSpec("float32", (Sym("b"), Sym("rows"), Sym("n", divisibility=4)),
               (Sym(divisibility=4), Sym(divisibility=4), 1), 16),
    TensorSpec("float32", (Sym("b"), Sym("n", divisibility=4)), (Sym(divisibility=4), 1), 16),
    StreamSpec(),
)
_column_sum_kernels: dict = {}


def column_sum_width(n: int) -> int:
    """Columns per CTA of the column sum: 32 spread rows of up to 16384 columns over every SM;
    wider rows take 128, so each CTA still reads tens of KB."""
    return 32 if n <= 16384 else 128


@kernel_op("column_sum", mutates_args=("out",))
def column_sum(part: torch.Tensor, out: torch.Tensor) -> None:
    """out = part.sum(1) for fp32 (B, R, N) ``part`` (R >= 1, N % 4 == 0, 16-byte rows), adding
    the rows in a fixed order (deterministic)."""
    width = column_sum_width(part.shape[2])
    if width not in _column_sum_kernels:
        from .norm import ColumnSumSm90

        _column_sum_kernels[width] = get_kernel(ColumnSumSm90, width, _COLUMN_SUM_SPECS)
    _column_sum_kernels[width](part, out)


def _norm(x, weight, bias, residual, eps, layer_norm, out_dtype, per_head=False, weight_offset=0.0,
          residual_out_dtype=None):
    n = _validate(x, weight, bias, residual, eps, out_dtype, per_head, weight_offset,
                  residual_out_dtype)
    if x.numel():  # refuse a row too long before running anything
        if _needs_grad(x, weight, bias, residual):
            rows = backward_rows(n, 1, 4)
            if rows.num_threads > 256:
                saved = x.dtype if residual is None else residual_out_dtype or residual.dtype
                long_row_stages(rows, saved.itemsize, (out_dtype or x.dtype).itemsize,
                                weight is not None and weight.requires_grad,
                                bias is not None and bias.requires_grad)
        row_config(n, 1, 4, tensors_held=1)
    r2 = None if residual is None else _rows(residual, n)
    out = _Norm.apply(_rows(x, n), weight, bias, r2, eps, layer_norm, out_dtype, per_head,
                      weight_offset, residual_out_dtype)
    if residual is None:
        return out.view(x.shape)
    return out[0].view(x.shape), out[1].view(x.shape)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def rms_norm(x, weight=None, eps: float = 1e-6, residual=None, out_dtype=None, *, bias=None,
             weight_offset: float = 0.0, residual_out_dtype=None):
    """RMSNorm over the last dim of ``x``.

    ``y = h / sqrt(mean(h^2) + eps) * (weight + weight_offset) + bias`` with
    ``h = x + residual`` (or ``x``).

    Args:
        x: CUDA tensor, float32 / float16 / bfloat16.
        weight: optional (D,) for x (..., D); or (H, D) for x (..., H, D): a per-head weight,
            each head normalized on its own (QK-norm). Any float dtype (fp32 parameters of
            mixed precision included).
        eps: added to the mean square.
        residual: optional, x's shape; when given the result is ``(y, h)``, and gradients flow
            through both.
        out_dtype: dtype of y (default x's).
        bias: optional, the weight's shape (per head with a per-head weight).
        weight_offset: added to the weight in fp32 before it scales (Gemma's ``1 + w``); the
            weight gradient is unchanged.
        residual_out_dtype: dtype of ``h`` (default the residual's), e.g. fp32 for a residual
            stream kept in fp32 while x is bf16.

    Constraints:
      - normalized size D up to 524288 without gradients (131072 for fp32 rows with a weight,
        bias and residual), 262144 with
      - fp32 statistics and math; the weight gradient is summed from per-CTA partials in a
        fixed order (deterministic run to run)
      - a non-contiguous last dim costs a copy
      - to normalize over several trailing dims, reshape x so that they are one
    """
    affine = weight if weight is not None else bias
    per_head = affine is not None and affine.dim() == 2
    if affine is not None and affine.dim() > 2:
        raise UnsupportedError(
            f"weight / bias of shape {tuple(affine.shape)}: rms_norm takes (D,) or a per-head "
            f"(H, D); to normalize over several dims, reshape x and the weight to one")
    return _norm(x, weight, bias, residual, eps, False, out_dtype, per_head, weight_offset,
                 residual_out_dtype)


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5, residual=None, out_dtype=None, *,
               residual_out_dtype=None):
    """LayerNorm over the trailing dims that ``weight`` / ``bias`` cover (the last dim without).

    ``y = (h - mean(h)) / sqrt(var(h) + eps) * weight + bias`` with ``h = x + residual``.
    Arguments as :func:`rms_norm` (``weight`` and ``bias`` over the normalized dims, as
    ``F.layer_norm``'s ``normalized_shape``); the mean and variance are taken of the row
    shifted by its first value, so rows far from zero mean keep their precision.

    Constraints: as :func:`rms_norm`.
    """
    return _norm(x, weight, bias, residual, eps, True, out_dtype,
                 residual_out_dtype=residual_out_dtype)


# Row lengths reaching every branch of row_config for the forward (tensors held 1) and the
# backward (4), including overhanging tiles and each cluster size.
SAMPLE_ROW_LENGTHS = (1, 7, 192, 760, 1128, 4096, 8192, 16384, 65536, 131072, 262144)
_BF16, _FP16, _FP32 = torch.bfloat16, torch.float16, torch.float32
# (layer_norm, weight, bias, residual): RMSNorm with and without a bias too.
_VARIANTS = tuple((ln, w, b, r) for ln in (False, True) for w in (False, True)
                  for b in (False, True) for r in (False, True))
# RMSNorm options over a sample of row lengths: (heads, weight_offset, bias, residual).
_RMS_OPTIONS = ((8, 0.0, False, False), (4, 1.0, True, False), (0, 1.0, False, True), (32, 0.0, False, True))


def compile_configurations(quick: bool = False):
    """(kernel class, config, specs) for the norm kernels the ops can pick: every combination
    of RMSNorm / LayerNorm, weight, bias and residual over a sample of row lengths in bf16, and
    the two common ones (RMSNorm with weight; LayerNorm with all options) over
    ``SAMPLE_ROW_LENGTHS`` with fp16 x / fp32 weight and fp32; RMSNorm's per-head weights and
    weight offset (bf16 and an fp32 weight). ``quick`` keeps a sample."""
    if quick:
        plan = [(v, (_BF16, _BF16), n) for v in (_VARIANTS[4], _VARIANTS[-1]) for n in (7, 4096, 65536)]
        rms = [(o, (_BF16, _BF16), n) for o in _RMS_OPTIONS[:2] for n in (128,)]
    else:
        plan = [(v, (_BF16, _BF16), n) for v in _VARIANTS for n in (7, 1128, 4096, 16384, 65536, 131072, 262144)]
        plan += [(v, mix, n) for v in (_VARIANTS[4], _VARIANTS[-1]) for mix in ((_FP16, _FP32), (_FP32, _FP32))
                 for n in SAMPLE_ROW_LENGTHS]
        rms = [(o, mix, n) for o in _RMS_OPTIONS for mix in ((_BF16, _BF16), (_BF16, _FP32))
               for n in (64, 128, 256, 4096)]
    plan = [((ln, w, b, r, 0, 0.0), dtypes, n) for (ln, w, b, r), dtypes, n in plan]
    plan += [((False, True, b, r, heads, offset), dtypes, n) for (heads, offset, b, r), dtypes, n in rms]
    found = {}
    for (layer_norm, weight, bias, residual, heads, offset), (x_t, w_t), n in plan:
        wt, bt = (w_t if weight else None), (w_t if bias else None)
        r_t = x_t if residual else None
        vec = vector_width(n, widest_itemsize((x_t, wt, bt)), 0)
        fwd = (x_t, r_t, wt, bt, x_t, r_t, layer_norm, heads, offset, n)
        bwd = (x_t, wt, x_t, r_t, x_t, layer_norm, weight, bias, heads, offset, n)
        for name, key, build in (("fwd", fwd, _build_forward), ("bwd", bwd, _build_backward)):
            try:
                found[(name,) + key] = build(key, vec)
            except UnsupportedError:  # a combination the ops refuse (fp32 rows too long)
                pass
    if not quick:  # LayerNorm forward's other even splits: 4 x 32 values, 16 x 64 (no backward)
        for n in (32768, 262144):
            fwd = (_BF16, None, _BF16, _BF16, _BF16, None, True, 0, 0.0, n)
            found[("fwd",) + fwd] = _build_forward(fwd, 8)
    from .norm import ColumnSumSm90

    for width in (32, 128):
        found[("column_sum", width)] = (ColumnSumSm90, width, _COLUMN_SUM_SPECS)
    return list(found.values())


def self_checks():
    """Rows of the ``python -m cute_kernels`` table for RMSNorm and LayerNorm."""
    from ..reference import layer_norm_ref, rms_norm_ref
    from ..runtime.selfcheck import SelfCheck

    checks = []
    for m, n in ((4096, 4096), (256, 65536)):
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        w, b = (torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        shape = f"{m}x{n}"
        checks.append(SelfCheck("rmsnorm_fwd", shape, "bfloat16", lambda x=x, w=w: rms_norm(x, w),
                                lambda x=x, w=w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6),
                                rms_norm_ref(x, w), 2e-2))
        checks.append(SelfCheck("layernorm_fwd", shape, "bfloat16",
                                lambda x=x, w=w, b=b: layer_norm(x, w, b),
                                lambda x=x, w=w, b=b: torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b),
                                layer_norm_ref(x, w, b), 2e-2))
    return checks
