"""Online softmax over the rows of a wgmma accumulator (device code, no torch).

Each thread holds two rows of a warpgroup's 64-row score tile, and four threads (a quad) share
a row. Scores are kept unscaled; ``scale_log2`` (softmax scale times log2 e) is folded into one
FFMA per value before ``exp2``. The row maximum is reduced over the quad at every block; the
row sum only at the end (each thread sums its own columns).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .fragments import rows_cols

LN_2 = math.log(2.0)


class OnlineSoftmax:
    """Running row maximum and row sum of one thread's rows across key blocks."""

    def __init__(self, scale_log2: Float32, rows: int):
        self.scale_log2 = scale_log2
        self.rows = rows
        self.row_max = cute.make_rmem_tensor(rows, Float32)
        self.row_sum = cute.make_rmem_tensor(rows, Float32)

    @cute.jit
    def step(self, acc_s: cute.Tensor, first: cutlass.Constexpr) -> cute.Tensor:
        """Turn the scores of one key block into probabilities relative to the running row
        maximum (in place) and return the factor by which each row's output so far must be
        scaled (1 for the first block)."""
        s = rows_cols(acc_s)
        scale = cute.make_rmem_tensor(self.rows, Float32)
        for r in cutlass.range_constexpr(self.rows):
            row = s[r, None].load()
            if cutlass.const_expr(first):
                block_max = row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
            else:
                block_max = row.reduce(cute.ReductionOp.MAX, self.row_max[r], 0)
            new_max = cute.arch.warp_reduction_max(block_max, threads_in_group=4)
            old_max = self.row_max[r]
            self.row_max[r] = new_max
            # A row that has seen only masked keys keeps -inf; exponentiate against 0 instead.
            safe_max = Float32(0.0) if new_max == -Float32.inf else new_max
            probs = cute.math.exp2(row * self.scale_log2 - safe_max * self.scale_log2, fastmath=True)
            if cutlass.const_expr(first):
                scale[r] = Float32(1.0)
                self.row_sum[r] = probs.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            else:
                scale[r] = cute.math.exp2((old_max - safe_max) * self.scale_log2, fastmath=True)
                self.row_sum[r] = probs.reduce(cute.ReductionOp.ADD, self.row_sum[r] * scale[r], 0)
            s[r, None].store(probs)
        return scale

    @cute.jit
    def finish(self) -> cute.Tensor:
        """Sum the rows over the quad; return 1 / row sum (1 where the sum is 0 or NaN) and
        leave the natural-log LSE in ``row_sum`` (-inf for a row that saw no key)."""
        inv = cute.make_rmem_tensor(self.rows, Float32)
        for r in cutlass.range_constexpr(self.rows):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=4)
            empty = total == Float32(0.0) or total != total
            inv[r] = cute.arch.rcp_approx(Float32(1.0) if empty else total)
            lse = (self.row_max[r] * self.scale_log2 + cute.math.log2(total, fastmath=True)) * LN_2
            self.row_sum[r] = -Float32.inf if empty else lse
        return inv


@cute.jit
def scale_rows(acc: cute.Tensor, scale: cute.Tensor):
    """Multiply each row of a wgmma accumulator by ``scale[row]``."""
    o = rows_cols(acc)
    for r in cutlass.range_constexpr(cute.size(scale)):
        o[r, None].store(o[r, None].load() * scale[r])
