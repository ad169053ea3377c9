"""RMSNorm and LayerNorm over the last dim of a (M, N) tensor, forward and backward, for
Hopper (sm_90a).

Forward, per row (math in fp32, the row read once into registers). LayerNorm sums the row
shifted by its first value (mean = pivot + mean of the shifted values), so the sums stay
accurate when |mean| >> std. LayerNorm rows split over a
cluster (16-bit, no residual) reduce (count, mean, squared deviations) partials in one exchange
(Chan's merge): with x held in registers and the weight and bias bulk-copied to shared memory
at the start when the row splits evenly, else with x staged in shared memory. Otherwise the
mean and the centred squares are reduced in turn.
    h = x (+ residual, stored as the residual output)
    RMSNorm:   rstd = 1 / sqrt(mean(h^2) + eps),        y = h * rstd * w
    LayerNorm: mean = mean(h), rstd = 1 / sqrt(mean((h - mean)^2) + eps),
               y = (h - mean) * rstd * w + b
rstd (and mean) are stored for the backward, fp32.

Backward, with xhat = (h - mean) * rstd and g = dy * w:
    dx = rstd * (g - xhat * mean(xhat * g) - mean(g))   (the mean(g) term for LayerNorm only)
       + dh_out (the gradient reaching the residual output, when there is one)
    dw = sum over rows of dy * xhat,   db = sum over rows of dy
The backward grid is persistent: ``num_ctas`` CTAs walk the row tiles, each accumulating its
dw / db in registers, then writing one fp32 partial row; ``ColumnSumSm90`` sums the partials
(a fixed order: results are deterministic, no atomics).

With ``weight_offset`` the weight is w + offset (fp32) wherever it scales; with ``heads`` the
weight and bias are (heads, N) and row r uses row r % heads of them (per-head RMSNorm over x
viewed as (tokens * heads, N)).

Dtypes: x, residual, y, dy, dx in float32, float16 or bfloat16; w, b in any of those.

Constraints:
  - last dim contiguous; row strides and pointers divisible by ``vec`` elements
  - N static per compiled kernel, M dynamic; N <= 524288 forward, 262144 backward (over
    131072 with ``long_rows``)
  - w and b have N contiguous elements ((heads, N) contiguous with ``heads``)
  - backward with ``heads``: num_ctas * rows_per_cta a multiple of heads
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..primitives.reduce import add, row_reduce
from .config import RowConfig
from .rows import (
    RowKernel,
    bounds_predicate,
    bulk_copy,
    zero_padding,
    copy_async,
    load_fragments,
    make_row_copy,
    read_fragment,
    reduction_workspace,
    stage_buffer,
    stage_view,
    store_fragment,
    thread_fragment,
)


# The forward's barriers: two for the row exchanges, then the one for the bulk-copied weight and
# bias (``reduction_workspace`` has thread i initialize barrier i, so thread AFFINE_BARRIER
# issues those copies).
AFFINE_BARRIER = 2


@dataclass(frozen=True)
class NormConfig:
    row: RowConfig
    layer_norm: bool  # subtract the mean (LayerNorm) or not (RMSNorm)
    weight: bool
    bias: bool
    residual: bool  # forward: add a residual and store the sum; backward: add its gradient
    weight_grad: bool = False  # backward: write dw partials (bias: write db partials)
    # Forward: load the weight and bias after the row reductions instead of before them, so
    # they are not held in registers across the reductions.
    late_affine: bool = False
    # Forward: x goes to shared memory (cp.async) and is read again after each reduction instead
    # of being held in registers; the weight and bias load before the reductions and stay in
    # their own (16-bit) dtype until used.
    stage_x: bool = False
    # Forward, LayerNorm with x in registers: one reduction of (count, mean, squared
    # deviations) partials (Chan's merge) instead of the mean and then the centred squares, so
    # a split row pays one cluster exchange instead of two.
    one_exchange: bool = False
    # Forward: one thread bulk-copies the CTA's slices of the weight and bias to shared memory
    # at the start; they are read back for the output, so no registers are held across the
    # reductions and no load latency follows them. Needs rows split over a cluster, one row
    # per CTA and ``even_n`` (whole slices).
    stage_affine: bool = False
    # Backward: CTAs per SM that the launch caps the registers for (0: no cap).
    ctas_per_sm: int = 0
    # Added to the weight in fp32 before it scales (Gemma: y = xhat * (1 + w)); the weight
    # gradient is unchanged.
    weight_offset: float = 0.0
    # Per-head weight and bias (heads, N): row r uses row r % heads of them (x viewed as
    # (tokens * heads, N) rows, each head normalized on its own). Backward: one partial row per
    # thread row (num_ctas * rows_per_cta rows), the grid a multiple that keeps each thread on
    # one head. 0: one (N,) weight for every row.
    heads: int = 0
    # Backward of rows over 131072 (512-thread CTAs, so at most 128 registers a thread): the
    # dw / db accumulators live in shared memory (each thread its own slots) and the weight
    # stays in its own dtype in registers; x and dy are loaded straight into registers.
    long_rows: bool = False
    # Backward: shared-memory stages of x and dy (2: the next tile loads during this one; 1:
    # after this one's last read, where two do not fit beside long rows' accumulators).
    stages: int = 2


def _merge_moments(a: tuple, b: tuple) -> tuple:
    """Merge two (count, mean, sum of squared deviations from the mean) partials."""
    count = a[0] + b[0]
    share = b[0] / cute.arch.fmax(count, Float32(1.0))
    delta = b[1] - a[1]
    return (count, a[1] + delta * share, a[2] + b[2] + delta * delta * a[0] * share)


def _add2(a: tuple, b: tuple) -> tuple:
    return (a[0] + b[0], a[1] + b[1])


class _NormKernel(RowKernel):
    def _vector_row(self, mV: cute.Tensor, tile) -> cute.Tensor:
        """The (N,) weight or bias this thread's row of ``tile`` uses: ``mV`` itself, or with
        per-head vectors (heads, N) its row (row % heads)."""
        if const_expr(self.config.heads == 0):
            return mV
        tidx = cute.arch.thread_idx()[0]
        row = tile[0] * self.rows.rows_per_cta + tidx // self.rows.threads_per_row
        return mV[row % self.config.heads, None]

    def _with_offset(self, w):
        """The fp32 weight values plus ``config.weight_offset`` (when it is not 0)."""
        if const_expr(self.config.weight_offset != 0.0):
            return w + self.config.weight_offset
        return w

    def _load_weight(self, mW: cute.Tensor, tile):
        """This thread's slice of its row's weight, fp32, offset added."""
        return self._with_offset(self._load_vector(self._vector_row(mW, tile), tile))

    def _load_bias(self, mB: cute.Tensor, tile):
        return self._load_vector(self._vector_row(mB, tile), tile)

    def _broadcast_row(self, mW: cute.Tensor) -> cute.Tensor:
        """A (rows_per_cta, N) view of the (N,) vector ``mW`` with row stride 0."""
        layout = cute.prepend(mW.layout, cute.make_layout(self.rows.rows_per_cta, stride=0))
        return cute.make_tensor(mW.iterator, layout)

    def _load_vector(self, mW: cute.Tensor, tile):
        """This thread's slice of a per-column vector (weight or bias), as fp32."""
        return self._load_vector_raw(mW, tile).load().to(Float32)

    def _load_vector_raw(self, mW: cute.Tensor, tile) -> cute.Tensor:
        """This thread's slice of a per-column vector, in registers in its own dtype."""
        rows = self.rows
        mW2 = self._broadcast_row(mW)
        copy = make_row_copy(mW.element_type, rows)
        tWgW = thread_fragment(mW2, copy, rows, (0, tile[1]))
        coords = thread_fragment(cute.make_identity_tensor(mW2.shape), copy, rows, (0, tile[1]))
        tWrW = cute.make_rmem_tensor_like(tWgW)
        load_fragments(bounds_predicate(coords, None, rows), (tWgW, tWrW, None, mW.element_type(0)))
        return tWrW

    def _store(self, mT: cute.Tensor, tile, pred, values) -> None:
        """Store fp32 ``values`` (this thread's fragment of ``tile``) into ``mT``, converted."""
        tXgT = self._fragment(mT, tile)
        tXrT = cute.make_rmem_tensor_like(tXgT)
        tXrT.store(values.to(mT.element_type))
        store_fragment(tXrT, tXgT, pred)

    def _fragment(self, mT: cute.Tensor, tile):
        if const_expr(mT is None):
            return None
        return thread_fragment(mT, make_row_copy(mT.element_type, self.rows), self.rows, tile)


class NormFwdSm90(_NormKernel):
    """RMSNorm / LayerNorm forward. See the module docstring."""

    def __init__(self, config: NormConfig):
        super().__init__(config)
        rows = self.rows
        if config.stage_affine and not (rows.cluster_n > 1 and rows.rows_per_cta == 1 and rows.even_n):
            raise ValueError(f"stage_affine needs one row per CTA split evenly over a cluster: {rows}")
        if config.one_exchange and (not config.layer_norm or config.stage_x):
            raise ValueError(f"one_exchange is for LayerNorm with x in registers: {config}")
        if config.heads and config.stage_affine:
            raise ValueError(f"per-head vectors are not bulk-copied (stage_affine): {config}")

    @cute.jit
    def __call__(self, mX, mR, mW, mB, mY, mH, mRstd, mMean, eps: Float32, stream):
        grid_x = cute.ceil_div(mX.shape[0], self.rows.rows_per_cta)
        self._launch(self.kernel(mX, mR, mW, mB, mY, mH, mRstd, mMean, eps), grid_x, stream,
                     full_carveout=self.config.stage_affine)

    @cute.kernel
    def kernel(self, mX, mR, mW, mB, mY, mH, mRstd, mMean, eps: Float32):
        cfg, rows = self.config, self.rows
        smem = cutlass.memory.SmemAllocator()
        moments = const_expr(cfg.stage_x or cfg.one_exchange)
        # Two exchange buffers; with ``stage_affine`` a third barrier (AFFINE_BARRIER) counts the
        # weight and bias bytes.
        buffer, mbar_ptr = reduction_workspace(smem, rows, 3 if moments else 1, 2,
                                               extra_barriers=1 if const_expr(cfg.stage_affine) else 0)
        affine = None
        if const_expr(cfg.stage_affine):
            affine = (mbar_ptr + AFFINE_BARRIER,
                      stage_buffer(smem, mW.element_type, rows) if const_expr(cfg.weight) else None,
                      stage_buffer(smem, mB.element_type, rows) if const_expr(cfg.bias) else None)
        tile, pred = self._tile_and_predicate(mX)
        tXgX, tXgR = self._fragment(mX, tile), self._fragment(mR, tile)
        tXrX = cute.make_rmem_tensor_like(tXgX)
        tXsX = tXsR = None
        if const_expr(cfg.stage_x):
            return self._forward_staged(mX, mW, mB, mY, mRstd, mMean, eps, smem, buffer, mbar_ptr,
                                        tile, pred, tXgX, tXrX)
        if const_expr(rows.stage_smem):
            tXsX = stage_view(stage_buffer(smem, mX.element_type, rows), make_row_copy(mX.element_type, rows), 0)
        loads = [(tXgX, tXrX, tXsX, mX.element_type(0))]
        if const_expr(cfg.residual):
            tXrR = cute.make_rmem_tensor_like(tXgR)
            if const_expr(rows.stage_smem):
                tXsR = stage_view(stage_buffer(smem, mR.element_type, rows), make_row_copy(mR.element_type, rows), 0)
            loads.append((tXgR, tXrR, tXsR, mR.element_type(0)))
        if const_expr(cfg.stage_affine):
            self._bulk_copy_affine(affine, mW, mB, tile)
        load_fragments(pred, *loads)
        # Weight and bias loads go out before the reductions so their latency hides behind them
        # (unless ``late_affine`` or ``stage_affine``).
        w = b = None
        if const_expr(not (cfg.late_affine or cfg.stage_affine)):
            w = self._load_weight(mW, tile) if const_expr(cfg.weight) else None
            b = self._load_bias(mB, tile) if const_expr(cfg.bias) else None
        h = tXrX.load().to(Float32)
        if const_expr(cfg.residual):
            h = h + tXrR.load().to(Float32)
            self._store(mH, tile, pred, h)

        wait = cute.arch.cluster_wait if const_expr(rows.cluster_n > 1) else None
        inv_n = 1.0 / rows.n
        pivot = Float32(0.0)
        if const_expr(cfg.layer_norm):
            pivot = self._row_pivot(mX, mR, tile)
            h = self._shift(h, tXrX, pred, pivot)
        mean = Float32(0.0)
        if const_expr(cfg.one_exchange):
            _, mean, squares = row_reduce(
                self._thread_moments(h, tXrX, pred, True), _merge_moments,
                (Float32(0.0), Float32(0.0), Float32(0.0)), rows.threads_per_row,
                buffer[None, None, None, 0], mbar_ptr, rows.cluster_n, wait,
            )
            h = h - mean
        elif const_expr(cfg.layer_norm):
            (total,) = row_reduce(
                (h.reduce(cute.ReductionOp.ADD, Float32(0.0), 0),), add, (Float32(0.0),),
                rows.threads_per_row, buffer[None, None, None, 0],
                mbar_ptr, rows.cluster_n, wait,
            )
            mean = total * inv_n
            h = zero_padding(h - mean, tXrX, pred, rows)  # padding out of the centred squares
            wait = None
        if const_expr(not cfg.one_exchange):
            (squares,) = row_reduce(
                ((h * h).reduce(cute.ReductionOp.ADD, Float32(0.0), 0),), add, (Float32(0.0),),
                rows.threads_per_row, buffer[None, None, None, 1],
                mbar_ptr + 1 if const_expr(rows.cluster_n > 1) else None, rows.cluster_n, wait,
            )
        rstd = cute.math.rsqrt(squares * inv_n + eps, fastmath=True)
        if const_expr(cfg.late_affine):
            w = self._load_weight(mW, tile) if const_expr(cfg.weight) else None
            b = self._load_bias(mB, tile) if const_expr(cfg.bias) else None
        if const_expr(cfg.stage_affine):
            bar, sW, sB = affine
            cute.arch.mbarrier_wait(bar, 0)
            w = self._with_offset(self._read_vector(sW, mW)) if const_expr(cfg.weight) else None
            b = self._read_vector(sB, mB) if const_expr(cfg.bias) else None
        y = h * rstd
        if const_expr(cfg.weight):
            y = y * w
        if const_expr(cfg.bias):
            y = y + b
        self._store(mY, tile, pred, y)
        self._store_row_stats(mX, tile, rstd, pivot + mean, mRstd, mMean)

    @cute.jit
    def _row_pivot(self, mX, mR, tile) -> Float32:
        """x (+ residual) at this thread's row's first column, in fp32 (0 past the last row)."""
        row = self._coords(mX, tile)[0][0]
        pivot = Float32(0.0)
        if row < mX.shape[0]:
            pivot = Float32(mX[row, 0])
            if const_expr(mR is not None):
                pivot = pivot + Float32(mR[row, 0])
        return pivot

    def _shift(self, h, tXrX, pred, pivot):
        """LayerNorm's shifted data: ``h - pivot`` with padding columns set to 0. A pivot from
        the row itself keeps every sum small when |mean| >> std, so the mean and the centred
        squares keep their digits; padding kept out of the sums (rather than subtracted after
        them) cancels nothing."""
        return zero_padding(h - pivot, tXrX, pred, self.rows)

    @cute.jit
    def _forward_staged(self, mX, mW, mB, mY, mRstd, mMean, eps: Float32, smem, buffer, mbar_ptr,
                        tile, pred, tXgX, tXrX):
        """The forward with ``stage_x``: x is copied to shared memory and read from there for
        each reduction and for the output, so only the 16-bit weight and bias stay in registers
        (two CTAs per SM on long rows, with every load issued up front)."""
        cfg, rows = self.config, self.rows
        tXsX = stage_view(stage_buffer(smem, mX.element_type, rows), make_row_copy(mX.element_type, rows), 0)
        copy_async(tXgX, tXsX, pred)
        cute.arch.cp_async_commit_group()
        w = self._load_vector_raw(self._vector_row(mW, tile), tile) if const_expr(cfg.weight) else None
        b = self._load_vector_raw(self._vector_row(mB, tile), tile) if const_expr(cfg.bias) else None
        cute.arch.cp_async_wait_group(0)
        # One reduction of (count, mean, sum of squared deviations) partials, merged as in
        # Chan et al. (RMSNorm: mean 0, the plain sum of squares).
        read_fragment(tXsX, tXrX, pred, mX.element_type(0))
        h = tXrX.load().to(Float32)
        pivot = Float32(0.0)
        if const_expr(cfg.layer_norm):
            pivot = self._row_pivot(mX, None, tile)
            h = self._shift(h, tXrX, pred, pivot)
        _, mean, squares = row_reduce(
            self._thread_moments(h, tXrX, pred, cfg.layer_norm), _merge_moments, (Float32(0.0), Float32(0.0), Float32(0.0)),
            rows.threads_per_row, buffer[None, None, None, 0], mbar_ptr, rows.cluster_n,
            cute.arch.cluster_wait if const_expr(rows.cluster_n > 1) else None,
        )
        rstd = cute.math.rsqrt(squares * (1.0 / rows.n) + eps, fastmath=True)
        read_fragment(tXsX, tXrX, pred, mX.element_type(0))
        y = (tXrX.load().to(Float32) - pivot - mean) * rstd
        if const_expr(cfg.weight):
            y = y * self._with_offset(w.load().to(Float32))
        if const_expr(cfg.bias):
            y = y + b.load().to(Float32)
        self._store(mY, tile, pred, y)
        self._store_row_stats(mX, tile, rstd, pivot + mean, mRstd, mMean)

    @cute.jit
    def _thread_moments(self, h, tXrX, pred, centre: cutlass.Constexpr[bool]) -> tuple:
        """(count, mean, sum of squared deviations from it) of this thread's in-bounds values
        of ``h`` (padding reads as 0; ``tXrX`` is the fragment ``h`` came from); with
        ``centre`` False the mean is taken as 0 (RMSNorm)."""
        rows = self.rows
        count = Float32(rows.elems_per_thread)
        if const_expr(not rows.even_n):
            count = Float32(0.0)
            per_flag = Float32(rows.elems_per_thread // cute.size(pred))
            for v in cutlass.range_constexpr(cute.size(pred, mode=[0])):
                for k in cutlass.range_constexpr(cute.size(pred, mode=[2])):
                    count += cutlass.select_(pred[v, 0, k], per_flag, Float32(0.0))
        mean = Float32(0.0)
        if const_expr(centre):
            total = h.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            if const_expr(rows.even_n):
                mean = total * (1.0 / rows.elems_per_thread)
            else:
                mean = total / cute.arch.fmax(count, Float32(1.0))
        d = h - mean
        if const_expr(centre):  # padding out of the centred squares
            d = zero_padding(d, tXrX, pred, rows)
        deviations = (d * d).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        return count, mean, deviations

    @cute.jit
    def _bulk_copy_affine(self, affine, mW, mB, tile):
        """Thread AFFINE_BARRIER (which initialized the barrier) bulk-copies this CTA's slices of
        the weight and bias into their buffers, completing on the barrier (wait for phase 0 to
        read)."""
        cfg, rows = self.config, self.rows
        bar, sW, sB = affine
        vectors = []
        if const_expr(cfg.weight):
            vectors.append((mW, sW))
        if const_expr(cfg.bias):
            vectors.append((mB, sB))
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == AFFINE_BARRIER:
            total = 0
            for mV, _ in vectors:
                total += rows.cols_per_cta * mV.element_type.width // 8
            cute.arch.mbarrier_arrive_and_expect_tx(bar, total)
            for mV, sV in vectors:
                bulk_copy(sV.iterator, mV.iterator + tile[1] * rows.cols_per_cta,
                          rows.cols_per_cta * mV.element_type.width // 8, bar)

    def _read_vector(self, sV: cute.Tensor, mV: cute.Tensor):
        """This thread's slice of a staged per-column vector, as fp32."""
        tVsV = stage_view(sV, make_row_copy(mV.element_type, self.rows), 0)
        tVrV = cute.make_rmem_tensor_like(tVsV)
        read_fragment(tVsV, tVrV, None, tVsV.element_type(0))
        return tVrV.load().to(Float32)

    @cute.jit
    def _store_row_stats(self, mX, tile, rstd, mean, mRstd, mMean):
        coords = self._coords(mX, tile)
        row, col = coords[0][0], coords[0][1]
        if col == 0 and row < mX.shape[0]:  # the thread holding the row's first column
            mRstd[row] = rstd
            if const_expr(self.config.layer_norm):
                mMean[row] = mean


class NormBwdSm90(_NormKernel):
    """RMSNorm / LayerNorm backward with per-CTA dw / db partials. See the module docstring.

    Persistent loop over row tiles. When vectors are at least 4 bytes, x and dy go through a
    two-stage shared-memory pipeline: while tile k is computed, tile k + num_ctas is already
    in flight (cp.async; each thread copies and reads back only its own vectors, so no barrier
    is needed), and x, dy are read again from shared memory after the row reduction instead of
    being kept in registers across it. The next tile's rstd (and mean) load during this one.
    With ``config.ctas_per_sm`` the registers are capped so that many CTAs share an SM.
    """

    @cute.jit
    def __call__(self, mX, mW, mdY, mRstd, mMean, mdH, mdX, mdW, mdB, num_ctas: Int32, stream):
        self._launch(
            self.kernel(mX, mW, mdY, mRstd, mMean, mdH, mdX, mdW, mdB, num_ctas), num_ctas, stream,
            self.config.ctas_per_sm,
        )

    @cute.kernel
    def kernel(self, mX, mW, mdY, mRstd, mMean, mdH, mdX, mdW, mdB, num_ctas: Int32):
        cfg, rows = self.config, self.rows
        # The column sum of the partials (launched next, as a programmatic dependent) may be
        # placed on the SMs as this grid's CTAs leave; it waits for this grid to finish.
        cute.arch.griddepcontrol_launch_dependents()
        staged = const_expr(rows.vec * min(mX.element_type.width, mdY.element_type.width) >= 32)
        smem = cutlass.memory.SmemAllocator()
        buffer, mbar_ptr = reduction_workspace(smem, rows, 2 if const_expr(cfg.layer_norm) else 1, 2)
        copy_x, copy_dy = make_row_copy(mX.element_type, rows), make_row_copy(mdY.element_type, rows)
        sX = sdY = None
        if const_expr(staged):
            sX = stage_buffer(smem, mX.element_type, rows, cfg.stages)
            sdY = stage_buffer(smem, mdY.element_type, rows, cfg.stages)
        bidx = cute.arch.block_idx()[0]
        first = self._tile(bidx)
        # With per-head weights the grid keeps every row of this thread on one head.
        w = w_raw = None
        if const_expr(cfg.weight and cfg.long_rows):
            w_raw = self._load_vector_raw(self._vector_row(mW, first), first)
        elif const_expr(cfg.weight):
            w = self._load_weight(mW, first)
        sAccW = sAccB = None
        if const_expr(cfg.long_rows):  # accumulators in shared memory, this thread's slots
            sAccW = stage_buffer(smem, Float32, rows) if const_expr(cfg.weight_grad) else None
            sAccB = stage_buffer(smem, Float32, rows) if const_expr(cfg.bias) else None
            dw_acc = None if const_expr(sAccW is None) else self._own_slots(sAccW)
            db_acc = None if const_expr(sAccB is None) else self._own_slots(sAccB)
        else:
            dw_acc = cute.make_rmem_tensor_like(self._fragment(mX, first), Float32)
            db_acc = cute.make_rmem_tensor_like(self._fragment(mX, first), Float32)
        if const_expr(dw_acc is not None):
            dw_acc.fill(0.0)
        if const_expr(db_acc is not None):
            db_acc.fill(0.0)
        m_rows = mX.shape[0]
        num_tiles = cute.ceil_div(m_rows, rows.rows_per_cta)
        if const_expr(staged):
            self._prefetch(mX, mdY, sX, sdY, copy_x, copy_dy, bidx, 0)
        if const_expr(rows.cluster_n > 1):
            cute.arch.cluster_wait()  # peers' exchange barriers are initialized from here on
        rstd, mean = self._row_stats(mX, mRstd, mMean, bidx)
        step = Int32(0)
        for tile_m in cutlass.range(bidx, num_tiles, num_ctas, unroll=1):
            buf = step % 2  # the reduction's exchange buffer
            stage = step % cfg.stages if const_expr(staged) else 0
            if const_expr(staged and cfg.stages == 2):
                self._prefetch(mX, mdY, sX, sdY, copy_x, copy_dy, tile_m + num_ctas, 1 - stage)
                cute.arch.cp_async_wait_group(1)
            if const_expr(staged and cfg.stages == 1):
                cute.arch.cp_async_wait_group(0)
            # The next tile's statistics load now, so their latency is not paid at its start.
            next_rstd, next_mean = self._row_stats(mX, mRstd, mMean, tile_m + num_ctas)
            tile = self._tile(tile_m)
            pred = bounds_predicate(self._coords(mX, tile), self.rows_to_check(mX), rows)
            srcX, srcdY = self._fragment(mX, tile), self._fragment(mdY, tile)
            if const_expr(staged):
                srcX, srcdY = stage_view(sX, copy_x, stage), stage_view(sdY, copy_dy, stage)
            xhat, dy = self._read_xhat_dy(srcX, srcdY, pred, mean, rstd)
            w_tile = w
            if const_expr(w_raw is not None):
                w_tile = self._with_offset(w_raw.load().to(Float32))
            g = dy * w_tile if const_expr(cfg.weight) else dy
            mbar = mbar_ptr + buf if const_expr(rows.cluster_n > 1) else None
            partial = ((xhat * g).reduce(cute.ReductionOp.ADD, Float32(0.0), 0),)
            if const_expr(cfg.layer_norm):
                partial = partial + (g.reduce(cute.ReductionOp.ADD, Float32(0.0), 0),)
            sums = row_reduce(
                partial, _add2 if const_expr(cfg.layer_norm) else add,
                tuple(Float32(0.0) for _ in partial), rows.threads_per_row,
                buffer[None, None, None, buf], mbar, rows.cluster_n, None, (step // 2) % 2,
            )
            if const_expr(staged):  # read again rather than hold x and dy across the reduction
                xhat, dy = self._read_xhat_dy(srcX, srcdY, pred, mean, rstd)
                if const_expr(not cfg.long_rows):
                    g = dy * w_tile if const_expr(cfg.weight) else dy
            if const_expr(staged and cfg.stages == 1):  # the one stage is free: the next tile
                self._prefetch(mX, mdY, sX, sdY, copy_x, copy_dy, tile_m + num_ctas, 0)
            if const_expr(cfg.long_rows):  # dw and db first: dy is dead once g is formed
                self._accumulate(dw_acc, db_acc, dy, xhat)
                if const_expr(staged and cfg.weight):  # the weight converted again, not held
                    g = dy * self._with_offset(w_raw.load().to(Float32))
                elif const_expr(staged):
                    g = dy
            dx = g - xhat * (sums[0] * (1.0 / rows.n))
            if const_expr(cfg.layer_norm):
                dx = dx - sums[1] * (1.0 / rows.n)
            dx = dx * rstd
            tXgdX = self._fragment(mdX, tile)
            if const_expr(cfg.residual):
                tXgdH = self._fragment(mdH, tile)
                tXrdH = cute.make_rmem_tensor_like(tXgdH)
                read_fragment(tXgdH, tXrdH, pred, mdH.element_type(0))
                dx = dx + tXrdH.load().to(Float32)
            tXrdX = cute.make_rmem_tensor_like(tXgdX)
            tXrdX.store(dx.to(mdX.element_type))
            store_fragment(tXrdX, tXgdX, pred)
            if const_expr(not cfg.long_rows):
                self._accumulate(dw_acc, db_acc, dy, xhat)
            rstd, mean = next_rstd, next_mean
            step += 1
        if const_expr(cfg.weight_grad):
            self._store_partial(smem, dw_acc, mdW, first, sAccW)
        if const_expr(cfg.bias):
            self._store_partial(smem, db_acc, mdB, first, sAccB)

    def _accumulate(self, dw_acc, db_acc, dy, xhat) -> None:
        """dw += dy * xhat, db += dy (the accumulators in registers or shared memory)."""
        if const_expr(self.config.bias):
            db_acc.store(db_acc.load() + dy)
        if const_expr(self.config.weight_grad):
            dw_acc.store(dw_acc.load() + dy * xhat)

    def _own_slots(self, sAcc: cute.Tensor) -> cute.Tensor:
        """This thread's slots of a (rows_per_cta, cols_per_cta, 1) fp32 accumulator in shared
        memory, laid out like its register fragments."""
        tidx = cute.arch.thread_idx()[0]
        thr = make_row_copy(cutlass.BFloat16, self.rows).get_slice(tidx)  # layout only: any dtype
        return thr.partition_D(sAcc[None, None, 0])

    @cute.jit
    def _row_stats(self, mX, mRstd, mMean, tile_m):
        """rstd and (LayerNorm) mean of this thread's row in row tile ``tile_m``; 0 past the end."""
        row = self._coords(mX, self._tile(tile_m))[0][0]
        rstd, mean = Float32(0.0), Float32(0.0)
        if row < mX.shape[0]:
            rstd = mRstd[row]
            if const_expr(self.config.layer_norm):
                mean = mMean[row]
        return rstd, mean

    def _prefetch(self, mX, mdY, sX, sdY, copy_x, copy_dy, tile_m, stage):
        """Start copying row tile ``tile_m`` of x and dy into ``stage`` (rows past the end are
        skipped by the predicate) and commit the group."""
        tile = self._tile(tile_m)
        pred = bounds_predicate(self._coords(mX, tile), mX.shape[0], self.rows)
        copy_async(self._fragment(mX, tile), stage_view(sX, copy_x, stage), pred)
        copy_async(self._fragment(mdY, tile), stage_view(sdY, copy_dy, stage), pred)
        cute.arch.cp_async_commit_group()

    def _read_xhat_dy(self, srcX, srcdY, pred, mean, rstd):
        tXrX = cute.make_rmem_tensor_like(srcX)
        tXrdY = cute.make_rmem_tensor_like(srcdY)
        read_fragment(srcX, tXrX, pred, srcX.element_type(0))
        read_fragment(srcdY, tXrdY, pred, srcdY.element_type(0))
        return (tXrX.load().to(Float32) - mean) * rstd, tXrdY.load().to(Float32)

    @cute.jit
    def _store_partial(self, smem, acc: cute.Tensor, mPart: cute.Tensor, tile, sStaged=None):
        """Sum this CTA's per-row accumulators over its rows and write one fp32 row of
        ``mPart`` (num_ctas, N) at this CTA's row, its cluster rank's columns; with per-head
        vectors, write each row's accumulator to row ``cta * rows_per_cta + r`` of ``mPart``
        (num_ctas * rows_per_cta, N) instead (the rows' heads differ). ``sStaged``: the
        accumulators already in shared memory, (rows_per_cta, cols_per_cta, 1)."""
        rows = self.rows
        tidx = cute.arch.thread_idx()[0]
        if const_expr(sStaged is not None):
            sAcc = sStaged[None, None, 0]
            cute.arch.barrier()
        else:
            sAcc = smem.allocate_tensor(
                Float32, cute.make_ordered_layout((rows.rows_per_cta, rows.cols_per_cta), order=(1, 0)), 16
            )
            thr = make_row_copy(cutlass.BFloat16, rows).get_slice(tidx)  # layout only: any dtype
            cute.arch.barrier()
            cute.autovec_copy(acc, thr.partition_D(sAcc))
            cute.arch.barrier()
        col0 = tile[1] * rows.cols_per_cta
        bidx = cute.arch.block_idx()[0]
        for c in cutlass.range_constexpr(0, rows.cols_per_cta, rows.num_threads):
            col = c + tidx
            if col < rows.cols_per_cta and col0 + col < rows.n:
                if const_expr(self.config.heads):
                    for r in cutlass.range_constexpr(rows.rows_per_cta):
                        mPart[bidx * rows.rows_per_cta + r, col0 + col] = sAcc[r, col]
                else:
                    total = Float32(0.0)
                    for r in cutlass.range_constexpr(rows.rows_per_cta):
                        total += sAcc[r, col]
                    mPart[bidx, col0 + col] = total


COLUMN_SUM_WARPS = 32  # warps per CTA of ColumnSumSm90


class ColumnSumSm90:
    """out[b, c] = sum over r of part[b, r, c] for fp32 (B, R, N) partials (the backward's
    per-CTA dw and db rows), in a fixed order, so the result is deterministic.

    One CTA per ``config`` (32 or 128) columns of one b: 32 columns spread a few hundred rows
    of a few thousand columns over every SM, 128 keep the CTAs long enough for wide rows. With
    L = config / 4 lanes per row, lane l of warp w adds columns 4 (l % L) .. + 3 of rows
    (32 / L) w + l // L, then 32 (32 / L) rows further, ... (16-byte loads, four in flight
    per thread); the warp's row groups are added by shuffles, then the 32 warp sums in warp
    order. Launched as a programmatic dependent of the kernel before it on the stream: its
    CTAs are placed while that kernel's last CTAs finish and wait for its results
    (``griddepcontrol.wait``; a no-op without such a kernel).

    Constraints:
      - part fp32 (B, R, N), R >= 1, N a multiple of 4, rows 16-byte aligned; out fp32 (B, N)
    """

    def __init__(self, config: int = 32):
        if config not in (32, 128):
            raise ValueError(f"ColumnSumSm90 covers 32 or 128 columns per CTA, got {config}")
        self.config = config

    @cute.jit
    def __call__(self, mPart: cute.Tensor, mOut: cute.Tensor, stream):
        self.kernel(mPart, mOut).launch(
            grid=[cute.ceil_div(mPart.shape[2], self.config), mPart.shape[0], 1],
            block=[32 * COLUMN_SUM_WARPS, 1, 1],
            stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def kernel(self, mPart: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, b, _ = cute.arch.block_idx()
        warp, lane = tidx // 32, tidx % 32
        smem = cutlass.memory.SmemAllocator()
        columns = const_expr(self.config)
        lanes = const_expr(columns // 4)  # lanes per row
        sums = smem.allocate_tensor(
            Float32, cute.make_ordered_layout((COLUMN_SUM_WARPS, columns), order=(1, 0)), 16
        )
        acc = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        acc.fill(0.0)
        vector = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        chunk = bidx * lanes + lane % lanes  # this lane's group of 4 columns
        rows_per_warp = const_expr(32 // lanes)
        cute.arch.griddepcontrol_wait()
        if chunk * 4 < mPart.shape[2]:
            for r in cutlass.range(warp * rows_per_warp + lane // lanes, mPart.shape[1],
                                   rows_per_warp * COLUMN_SUM_WARPS, unroll=4):
                cute.copy(atom, cute.local_tile(mPart[b, r, None], (4,), (chunk,)), vector)
                acc.store(acc.load() + vector.load())
        for i in cutlass.range_constexpr(4):
            value = acc[i]
            for step in cutlass.range_constexpr(rows_per_warp.bit_length() - 1):  # log2
                value = value + cute.arch.shuffle_sync_bfly(value, offset=lanes << step)
            if lane < lanes:
                sums[warp, lane * 4 + i] = value
        cute.arch.barrier()
        column = bidx * columns + tidx
        if tidx < columns and column < mPart.shape[2]:
            total = Float32(0.0)
            for w in cutlass.range_constexpr(COLUMN_SUM_WARPS):
                total += sums[w, tidx]
            mOut[b, column] = total
