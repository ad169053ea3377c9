"""Cross-entropy over the last dim of (M, V) logits, forward and backward, for Hopper (sm_90a).

Forward, per row with target t (ignored rows: loss 0; a target outside [0, V): loss NaN):
    lse  = log(sum(exp(x)))                          (one pass: max and sum merged online,
                                                     across warps and the CTAs of a cluster)
    loss = lse - (1 - eps) * x[t] - eps / V * sum(x) + z * lse^2
with eps the label smoothing and z the lse-square (z-loss) scale. With a soft cap c, x stands
for c * tanh(x / c) throughout (each logit turned into the ratio r below as it is loaded) and
the gradient is times the cap's derivative 1 - tanh^2(x / c). lse is stored for the backward.
Optionally the forward also writes the gradient (times a scale read from device
memory, e.g. 1 / number of counted rows), so the logits are read once for loss and gradient;
the gradient may overwrite the logits. With a scale the stored per-row loss is scaled too, so
a mean is the plain sum of the stored rows (``InverseCountSm90`` computes 1 / counted rows on
the device).

When the forward wrote the gradient, the backward only scales it by the incoming gradient
(``ScaleRowsSm90``, which skips all memory traffic when that is 1).

Backward from the logits, elementwise with the stored lse (no reduction):
    dx = dloss[row] * (p * (1 + 2 z lse) - eps / V - (1 - eps) * [j == t]),   p = exp(x - lse)
and 0 for ignored rows. ``dloss`` may have row stride 0 (a broadcast scalar).

Dtypes: logits and gradient float32 / float16 / bfloat16; target int64 or int32; loss and
lse float32.

Constraints:
  - last dim contiguous; row strides and pointers divisible by ``vec`` elements
  - V static per compiled kernel, M dynamic; V <= 524288
  - target is never used to index out of bounds; a logit of -inf counts as 0 in the
    label-smoothing sum
  - with a soft cap a logit of -inf stays -inf in the row's sums (its capped value is -c: the
    sum of exponentials lacks exp(-c) for it); at the target column it is capped to -c
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int64, const_expr

from ..primitives.reduce import LOG2_E, add, cross_warp_combine, maximum, shuffle_combine
from ..primitives.reduce import softmax_pair
from .config import RowConfig
from .rows import (
    RowKernel,
    bounds_predicate,
    load_fragments,
    make_row_copy,
    reduction_workspace,
    store_fragment,
    thread_fragment,
)

LN_2 = 0.6931471805599453


@dataclass(frozen=True)
class CrossEntropyConfig:
    row: RowConfig
    smoothing: bool  # label smoothing term compiled in
    z_loss: bool  # lse-square term compiled in
    write_grad: bool = False  # forward also writes the gradient
    scaled: bool = False  # forward: loss (and gradient) times scale[0]
    softcap: bool = False  # logits capped to c * tanh(x / c) as they are loaded
    ctas_per_sm: int = 0  # forward: > 1 caps the registers so that many CTAs share an SM


def _softmax_sum(a: tuple, b: tuple) -> tuple:
    """Merge (max, sum exp, sum x) partials: softmax pair on the first two, add on the third."""
    return softmax_pair(a[:2], b[:2]) + (a[2] + b[2],)


@cute.jit
def _load_target(mTarget: cute.Tensor, row, m_rows, ignore_index: Int64) -> Int64:
    target = Int64(ignore_index)
    if row < m_rows:
        target = Int64(mTarget[row])
    return target


@cute.jit
def _load_logit(mX: cute.Tensor, row, target: Int64, in_range: Boolean) -> Float32:
    value = Float32(0.0)
    if row < mX.shape[0] and in_range:
        value = mX[row, target].to(Float32)
    return value


# The soft cap through r = 1 / (1 + exp(2 x / c)): c * tanh(x / c) = c (1 - 2 r) and the
# derivative 1 - tanh^2 = 4 r (1 - r). A thread keeps r alone for its slice (the capped
# value, the softmax's exponent and the derivative are each one FMA from it), so the capped
# kernel holds as many row values in registers as the plain one. ex2.approx and rcp.approx put
# the capped value within ~3e-7 c of the exact one (an absolute error: what a softmax sees).


@cute.jit
def _cap_ratio(x: Float32, cap: Float32) -> Float32:
    """r = 1 / (1 + exp(2 x / c)) of one logit (0 at +inf, 1 at -inf, NaN at NaN)."""
    return cute.arch.rcp_approx(1.0 + cute.math.exp2(x * (2.0 * LOG2_E / cap), fastmath=True))


@cute.jit
def _cap_slope_quarter(r: Float32) -> Float32:
    """(1 - tanh^2) / 4 = r (1 - r) from ``_cap_ratio``'s r; 0 where r is +inf (a -inf logit,
    see ``_slice_ratio``) or NaN (its gradient is NaN through the softmax). Within ~1e-7 of
    the exact value; far below the cap (x << -c, r -> 1) that is all of its digits, as with
    1 - tanh^2 from a rounded tanh (the softmax there is exp(-c - lse) small)."""
    return cute.arch.fmax(r - r * r, Float32(0.0))


@cute.jit
def _capped(x: Float32, cap: Float32) -> Float32:
    """c * tanh(x / c) of one logit (-c at -inf)."""
    return cap - (2.0 * cap) * _cap_ratio(x, cap)


@cute.jit
def _slice_ratio(v: Float32, cap: Float32) -> Float32:
    """``_cap_ratio`` of a row slice's logit, +inf where it is -inf (padding or data): the
    softmax's exponent (c - shift) log2 e - 2 c log2 e r is then -inf, as for a -inf logit
    without a cap."""
    return cutlass.select_(v == -Float32.inf, Float32.inf, _cap_ratio(v, cap))


@cute.jit
def _cap_ratios(x, cap: Float32):
    """``_slice_ratio`` of a row slice (its register fragment as loaded)."""
    r = cute.make_rmem_tensor_like(x, Float32)
    for i in cutlass.range_constexpr(cute.size(r)):
        r[i] = _slice_ratio(x[i].to(Float32), cap)
    return r.load()


@cute.jit
def _capped_sums(x, cap: Float32, shift: Float32, smoothing: cutlass.Constexpr):
    """``_cap_ratios`` of a row slice, with the slice's sum of exp(capped - shift) and (with
    ``smoothing``) of its finite capped values, accumulated as the ratios are made (so that
    they replace the logits one by one)."""
    r = cute.make_rmem_tensor_like(x, Float32)
    exponent = (cap - shift) * LOG2_E
    e_sum, capped_sum = Float32(0.0), Float32(0.0)
    for i in cutlass.range_constexpr(cute.size(r)):
        r[i] = _slice_ratio(x[i].to(Float32), cap)
        e_sum += cute.math.exp2(exponent - (2.0 * LOG2_E) * cap * r[i], fastmath=True)
        if const_expr(smoothing):
            capped_sum += cutlass.select_(r[i] == Float32.inf, Float32(0.0), cap - (2.0 * cap) * r[i])
    return r.load(), e_sum, capped_sum


@cute.jit
def _load_row_pair(mA: cute.Tensor, mB: cute.Tensor, row, m_rows):
    a, b = Float32(0.0), Float32(0.0)
    if row < m_rows:
        a, b = mA[row], mB[row]
    return a, b


class _CrossEntropyKernel(RowKernel):
    def _row_info(self, mX, mTarget, coords, ignore_index):
        """This thread's row, its target, and the flags ``counted`` (a real row whose target is
        not ignored) and ``in_range`` (0 <= target < V)."""
        row = coords[0][0]
        target = _load_target(mTarget, row, mX.shape[0], ignore_index)
        counted = target != Int64(ignore_index)
        in_range = (target >= Int64(0)) & (target < Int64(self.rows.n))
        return row, target, counted, in_range

    @cute.jit
    def _gradient(self, mGrad, coords, pred, tile, p, lse, scale, row, target, counted, in_range,
                  x_target: Float32, smoothing: Float32, z_scale: Float32, ratio, slope_target,
                  softcap: Float32):
        """Write scale * dloss/dx for this thread's slice of the row (0 for ignored rows), given
        ``p`` = softmax of the slice; with a soft cap instead the slice's ``_cap_ratios`` (p and
        the cap's derivative from them, value by value) and ``slope_target``, a quarter of the
        derivative at the target. The -(1 - eps) at the target column is written afterwards, as
        one scalar, by the thread whose slice holds that column (its own earlier vector store
        is ordered before it)."""
        cfg, rows = self.config, self.rows
        row_scale = scale if counted else Float32(0.0)
        factor = 1.0 + 2.0 * z_scale * lse if const_expr(cfg.z_loss) else Float32(1.0)
        floor = smoothing * (1.0 / rows.n) if const_expr(cfg.smoothing) else Float32(0.0)
        tXgG = thread_fragment(mGrad, make_row_copy(mGrad.element_type, rows), rows, tile)
        tXrG = cute.make_rmem_tensor_like(tXgG)
        if const_expr(cfg.softcap):
            row_scale = row_scale * 4.0  # the derivative comes as a quarter of it
            g = cute.make_rmem_tensor_like(ratio, Float32)
            g.store(ratio)
            exponent = (softcap - lse) * LOG2_E
            for i in cutlass.range_constexpr(cute.size(g)):
                r = g[i]
                p_i = cute.math.exp2(exponent - (2.0 * LOG2_E) * softcap * r, fastmath=True)
                g[i] = (p_i * factor - floor) * row_scale * _cap_slope_quarter(r)
            tXrG.store(g.load().to(mGrad.element_type))
        else:
            tXrG.store(((p * factor - floor) * row_scale).to(mGrad.element_type))
        store_fragment(tXrG, tXgG, pred)
        # Columns of this thread: first + k * stride + v for k < vecs_per_thread, v < vec.
        offset = target - Int64(coords[0][1])
        stride = rows.threads_per_row * rows.vec
        mine = (offset >= Int64(0)) & (offset < Int64(stride * rows.vecs_per_thread)) & (
            offset % Int64(stride) < Int64(rows.vec)
        )
        if counted and in_range and mine and row < mGrad.shape[0]:
            p_t = cute.math.exp2(x_target * LOG2_E - lse * LOG2_E, fastmath=True)
            hit = 1.0 - smoothing if const_expr(cfg.smoothing) else Float32(1.0)
            g_t = (p_t * factor - floor - hit) * row_scale
            if const_expr(cfg.softcap):
                g_t = g_t * slope_target  # times 4 in row_scale
            mGrad[row, target] = g_t.to(mGrad.element_type)


class CrossEntropyFwdSm90(_CrossEntropyKernel):
    """Loss and lse per row (and, with ``write_grad``, the scaled gradient). See the module
    docstring."""

    @cute.jit
    def __call__(self, mX, mTarget, mLoss, mLse, mGrad, mScale, ignore_index: Int64,
                 smoothing: Float32, z_scale: Float32, softcap: Float32, stream):
        grid_x = cute.ceil_div(mX.shape[0], self.rows.rows_per_cta)
        kernel = self.kernel(mX, mTarget, mLoss, mLse, mGrad, mScale, ignore_index, smoothing, z_scale,
                             softcap)
        self._launch(kernel, grid_x, stream, ctas_per_sm=self.config.ctas_per_sm)

    @cute.kernel
    def kernel(self, mX, mTarget, mLoss, mLse, mGrad, mScale, ignore_index: Int64,
               smoothing: Float32, z_scale: Float32, softcap: Float32):
        cfg, rows = self.config, self.rows
        smem = cutlass.memory.SmemAllocator()
        width = 3 if const_expr(cfg.smoothing) else 2
        buffer, mbar_ptr = reduction_workspace(smem, rows, width, 1)
        tile = self._tile(cute.arch.block_idx()[0])
        coords = self._coords(mX, tile)
        pred = bounds_predicate(coords, self.rows_to_check(mX), rows)
        # Measured: issuing the target's two dependent scalar loads before the row's loads is
        # faster than after them (benchmarks/NOTES.md).
        row, target, counted, in_range = self._row_info(mX, mTarget, coords, ignore_index)
        x_target = _load_logit(mX, row, target, in_range)
        tXgX = thread_fragment(mX, make_row_copy(mX.element_type, rows), rows, tile)
        tXrX = cute.make_rmem_tensor_like(tXgX)
        load_fragments(pred, (tXgX, tXrX, None, -mX.element_type.inf))
        x = tXrX.load().to(Float32)
        group = const_expr(min(rows.threads_per_row, 32))
        (warp_max,) = shuffle_combine((x.reduce(cute.ReductionOp.MAX, -Float32.inf, 0),), maximum, group)
        ratio, slope_target = None, None
        if const_expr(cfg.softcap):
            # The cap is increasing: the capped row's max is the max capped.
            warp_max = cutlass.select_(warp_max == -Float32.inf, warp_max, _capped(warp_max, softcap))
        # A slice of only -inf (padding or data) exponentiates against 0 so its sum is 0, not NaN.
        shift = cutlass.select_(warp_max == -Float32.inf, Float32(0.0), warp_max)
        if const_expr(cfg.softcap):
            # The ratios replace the logits one by one, each exponentiated and summed at once,
            # so that one row-sized fragment is held (as without a cap).
            ratio, e_sum, capped_sum = _capped_sums(tXrX, softcap, shift, cfg.smoothing)
            (warp_sum,) = shuffle_combine((e_sum,), add, group)
            target_ratio = _cap_ratio(x_target, softcap)
            x_target, slope_target = softcap - (2.0 * softcap) * target_ratio, _cap_slope_quarter(target_ratio)
        else:
            e = cute.math.exp2(x * LOG2_E - shift * LOG2_E, fastmath=True)
            (warp_sum,) = shuffle_combine((e.reduce(cute.ReductionOp.ADD, Float32(0.0), 0),), add, group)
        partial, identity, combine = (warp_max, warp_sum), (-Float32.inf, Float32(0.0)), softmax_pair
        if const_expr(cfg.smoothing):
            if const_expr(cfg.softcap):
                x_sum = capped_sum
            else:
                finite = cute.where(x == -Float32.inf, cute.full_like(x, 0.0), x)
                x_sum = finite.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            (x_sum,) = shuffle_combine((x_sum,), add, group)
            partial, identity, combine = partial + (x_sum,), identity + (Float32(0.0),), _softmax_sum
        if const_expr(rows.threads_per_row > 32 or rows.cluster_n > 1):
            partial = cross_warp_combine(
                partial, combine, identity, buffer[None, None, None, 0], mbar_ptr,
                max(rows.threads_per_row // 32, 1), rows.cluster_n,
                cute.arch.cluster_wait if const_expr(rows.cluster_n > 1) else None,
            )
            lse = partial[0] + cute.math.log2(partial[1], fastmath=True) * LN_2
        else:
            lse = shift + cute.math.log2(warp_sum, fastmath=True) * LN_2
        loss = lse - x_target
        if const_expr(cfg.smoothing):
            loss = lse - (1.0 - smoothing) * x_target - smoothing * (1.0 / rows.n) * partial[2]
        if const_expr(cfg.z_loss):
            loss = loss + z_scale * lse * lse
        if not in_range:
            loss = Float32(float("nan"))
        if not counted:
            loss = Float32(0.0)
        scale = Float32(mScale[0]) if const_expr(cfg.scaled) else Float32(1.0)
        if coords[0][1] == 0 and row < mX.shape[0]:
            # Ignored rows store 0 * scale: NaN when no row counts (scale inf), as torch's mean.
            mLoss[row] = loss * scale if const_expr(cfg.scaled) else loss
            mLse[row] = lse
        if const_expr(cfg.write_grad):
            p = None  # with a cap, from the ratios (a second exponential rather than e kept)
            if const_expr(not cfg.softcap):
                # softmax = e * exp(shift - lse): reuse e rather than keep x alive for another exp
                p = e * cute.math.exp2((shift - lse) * LOG2_E, fastmath=True)
            self._gradient(mGrad, coords, pred, tile, p, lse, scale, row, target,
                           counted, in_range, x_target, smoothing, z_scale, ratio, slope_target, softcap)


class CrossEntropyBwdSm90(_CrossEntropyKernel):
    """dx from the logits and the stored lse, elementwise. See the module docstring."""

    @cute.jit
    def __call__(self, mX, mTarget, mLse, mdLoss, mGrad, ignore_index: Int64, smoothing: Float32,
                 z_scale: Float32, softcap: Float32, stream):
        grid_x = cute.ceil_div(mX.shape[0], self.rows.rows_per_cta)
        kernel = self.kernel(mX, mTarget, mLse, mdLoss, mGrad, ignore_index, smoothing, z_scale, softcap)
        self._launch(kernel, grid_x, stream)

    @cute.kernel
    def kernel(self, mX, mTarget, mLse, mdLoss, mGrad, ignore_index: Int64, smoothing: Float32,
               z_scale: Float32, softcap: Float32):
        rows = self.rows
        tile = self._tile(cute.arch.block_idx()[0])
        coords = self._coords(mX, tile)
        pred = bounds_predicate(coords, self.rows_to_check(mX), rows)
        tXgX = thread_fragment(mX, make_row_copy(mX.element_type, rows), rows, tile)
        tXrX = cute.make_rmem_tensor_like(tXgX)
        load_fragments(pred, (tXgX, tXrX, None, mX.element_type(0)))
        row, target, counted, in_range = self._row_info(mX, mTarget, coords, ignore_index)
        lse, dloss = _load_row_pair(mLse, mdLoss, row, mX.shape[0])
        x_target = _load_logit(mX, row, target, in_range)
        x = tXrX.load().to(Float32)
        p, ratio, slope_target = None, None, None
        if const_expr(self.config.softcap):
            ratio = _cap_ratios(tXrX, softcap)
            target_ratio = _cap_ratio(x_target, softcap)
            x_target, slope_target = softcap - (2.0 * softcap) * target_ratio, _cap_slope_quarter(target_ratio)
        else:
            p = cute.math.exp2(x * LOG2_E - lse * LOG2_E, fastmath=True)
        self._gradient(mGrad, coords, pred, tile, p, lse, dloss, row, target,
                       counted, in_range, x_target, smoothing, z_scale, ratio, slope_target, softcap)


SCALE_ROWS_CTAS = 1024  # grid cap: CTAs loop over row tiles, so a skipped scaling is cheap


class ScaleRowsSm90(RowKernel):
    """x[M, N] *= scale[0] in place, unless scale[0] == 1: then every CTA returns at once, so
    the usual ``loss.backward()`` costs one launch of at most ``SCALE_ROWS_CTAS`` CTAs and no
    memory traffic."""

    @cute.jit
    def __call__(self, mX, mScale, stream):
        tiles = cute.ceil_div(mX.shape[0], self.rows.rows_per_cta)
        self._launch(self.kernel(mX, mScale), cutlass.min(tiles, SCALE_ROWS_CTAS), stream)

    @cute.kernel
    def kernel(self, mX, mScale):
        scale = Float32(mScale[0])
        if scale != Float32(1.0):
            tiles = cute.ceil_div(mX.shape[0], self.rows.rows_per_cta)
            for tile_m in range(cute.arch.block_idx()[0], tiles, cute.arch.grid_dim()[0]):
                tile = self._tile(tile_m)
                pred = bounds_predicate(self._coords(mX, tile), self.rows_to_check(mX), self.rows)
                tXgX = thread_fragment(mX, make_row_copy(mX.element_type, self.rows), self.rows, tile)
                tXrX = cute.make_rmem_tensor_like(tXgX)
                load_fragments(pred, (tXgX, tXrX, None, mX.element_type(0)))
                tXrX.store((tXrX.load().to(Float32) * scale).to(mX.element_type))
                store_fragment(tXrX, tXgX, pred)


COUNT_THREADS = 1024


class InverseCountSm90:
    """scale[0] = 1 / (number of targets != ignore_index), inf when there are none: the mean's
    divisor, computed on the device by one CTA (no host synchronization)."""

    def __init__(self, config=None):
        self.config = config

    @cute.jit
    def __call__(self, mTarget, mScale, ignore_index: Int64, stream):
        self.kernel(mTarget, mScale, ignore_index).launch(grid=[1, 1, 1], block=[COUNT_THREADS, 1, 1],
                                                          stream=stream)

    @cute.kernel
    def kernel(self, mTarget, mScale, ignore_index: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        partials = smem.allocate_tensor(Float32, cute.make_layout(COUNT_THREADS // 32), byte_alignment=16)
        count = Float32(0.0)
        for i in range(tidx, mTarget.shape[0], COUNT_THREADS):
            count += cutlass.select_(Int64(mTarget[i]) != ignore_index, Float32(1.0), Float32(0.0))
        (count,) = shuffle_combine((count,), add, 32)
        warp, lane = cute.arch.warp_idx(), cute.arch.lane_idx()
        if lane == 0:
            partials[warp] = count
        cute.arch.barrier()
        if warp == 0:
            (total,) = shuffle_combine((partials[lane],), add, 32)
            if lane == 0:
                mScale[0] = Float32(1.0) / total
