"""Softmax over the last dim of a (M, N) tensor, forward and backward, for Hopper (sm_90a).

Forward: each thread loads its slice of a row into registers (16-byte vectors), takes the
max of its warp's slice, exponentiates against it and sums; warps (and the CTAs of a cluster,
through distributed shared memory) then merge their (max, sum) pairs in one exchange, so the
row is read from global memory exactly once. ``y = exp(x - max) / sum``, computed in fp32.

Backward: ``dx = y * (dy - sum(dy * y))`` with the same tiling; y and dy are read once.

Dtypes: x, y, dy, dx in float32, float16 or bfloat16, in any mix (math is fp32).

Constraints:
  - last dim contiguous; row stride, data pointers and N divisible by ``config.vec``
    elements (the op picks ``vec`` from the actual tensors, down to 1)
  - N static per compiled kernel; M dynamic (no recompile for a new batch size), M >= 1
  - N <= 524288 forward, 262144 backward (see ``config.row_config``)
  - rows with NaN give NaN rows; rows of all -inf give NaN rows (as torch)
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from ..primitives.reduce import LOG2_E, add, maximum, row_reduce, shuffle_combine, softmax_pair
from ..primitives.reduce import cross_warp_combine
from .rows import (
    RowKernel,
    load_fragments,
    make_row_copy,
    reduction_workspace,
    stage_buffer,
    stage_view,
    store_fragment,
    thread_fragment,
)


class SoftmaxFwdSm90(RowKernel):
    """y = softmax(x) along the last dim. See the module docstring."""

    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, stream):
        self._launch(self.kernel(mX, mY), cute.ceil_div(mX.shape[0], self.rows.rows_per_cta), stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mY: cute.Tensor):
        cfg = self.config
        smem = cutlass.memory.SmemAllocator()
        buffer, mbar_ptr = reduction_workspace(smem, cfg, 2)
        buffer = buffer[None, None, None, 0]
        tile, pred = self._tile_and_predicate(mX)
        copy_x = make_row_copy(mX.element_type, cfg)
        tXgX = thread_fragment(mX, copy_x, cfg, tile)
        tXgY = thread_fragment(mY, make_row_copy(mY.element_type, cfg), cfg, tile)
        tXrX = cute.make_rmem_tensor_like(tXgX)
        tXsX = None
        if const_expr(cfg.stage_smem):
            tXsX = stage_view(stage_buffer(smem, mX.element_type, cfg), copy_x, 0)
        load_fragments(pred, (tXgX, tXrX, tXsX, -mX.element_type.inf))
        x = tXrX.load().to(Float32)

        group = const_expr(min(cfg.threads_per_row, 32))
        (warp_max,) = shuffle_combine(
            (x.reduce(cute.ReductionOp.MAX, -Float32.inf, 0),), maximum, group
        )
        # A slice of only -inf (padding or data) exponentiates against 0 so its sum is 0, not NaN.
        shift = cutlass.select_(warp_max == -Float32.inf, Float32(0.0), warp_max)
        e = cute.math.exp2(x * LOG2_E - shift * LOG2_E, fastmath=True)
        (warp_sum,) = shuffle_combine((e.reduce(cute.ReductionOp.ADD, Float32(0.0), 0),), add, group)
        row_max, row_sum = warp_max, warp_sum
        if const_expr(cfg.threads_per_row > 32 or cfg.cluster_n > 1):
            row_max, row_sum = cross_warp_combine(
                (warp_max, warp_sum),
                softmax_pair,
                (-Float32.inf, Float32(0.0)),
                buffer,
                mbar_ptr,
                max(cfg.threads_per_row // 32, 1),
                cfg.cluster_n,
                cute.arch.cluster_wait if const_expr(cfg.cluster_n > 1) else None,
            )
        scale = cute.math.exp2((shift - row_max) * LOG2_E, fastmath=True) * cute.arch.rcp_approx(
            row_sum
        )
        tXrY = cute.make_rmem_tensor_like(tXgY)
        tXrY.store((e * scale).to(mY.element_type))
        store_fragment(tXrY, tXgY, pred)


class SoftmaxBwdSm90(RowKernel):
    """dx = y * (dy - sum(dy * y)) along the last dim. See the module docstring."""

    @cute.jit
    def __call__(self, mY: cute.Tensor, mdY: cute.Tensor, mdX: cute.Tensor, stream):
        self._launch(
            self.kernel(mY, mdY, mdX), cute.ceil_div(mY.shape[0], self.rows.rows_per_cta), stream
        )

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mdY: cute.Tensor, mdX: cute.Tensor):
        cfg = self.config
        smem = cutlass.memory.SmemAllocator()
        buffer, mbar_ptr = reduction_workspace(smem, cfg, 1)
        buffer = buffer[None, None, None, 0]
        tile, pred = self._tile_and_predicate(mY)
        copy_y, copy_dy = make_row_copy(mY.element_type, cfg), make_row_copy(mdY.element_type, cfg)
        tXgY = thread_fragment(mY, copy_y, cfg, tile)
        tXgdY = thread_fragment(mdY, copy_dy, cfg, tile)
        tXgdX = thread_fragment(mdX, make_row_copy(mdX.element_type, cfg), cfg, tile)
        tXrY = cute.make_rmem_tensor_like(tXgY)
        tXrdY = cute.make_rmem_tensor_like(tXgdY)
        tXsY, tXsdY = None, None
        if const_expr(cfg.stage_smem):
            tXsY = stage_view(stage_buffer(smem, mY.element_type, cfg), copy_y, 0)
            tXsdY = stage_view(stage_buffer(smem, mdY.element_type, cfg), copy_dy, 0)
        load_fragments(
            pred, (tXgY, tXrY, tXsY, mY.element_type(0)), (tXgdY, tXrdY, tXsdY, mdY.element_type(0))
        )
        y = tXrY.load().to(Float32)
        dy = tXrdY.load().to(Float32)
        (dot,) = row_reduce(
            ((dy * y).reduce(cute.ReductionOp.ADD, Float32(0.0), 0),),
            add,
            (Float32(0.0),),
            cfg.threads_per_row,
            buffer,
            mbar_ptr,
            cfg.cluster_n,
            cute.arch.cluster_wait if const_expr(cfg.cluster_n > 1) else None,
        )
        tXrdX = cute.make_rmem_tensor_like(tXgdX)
        tXrdX.store((y * (dy - dot)).to(mdX.element_type))
        store_fragment(tXrdX, tXgdX, pred)
