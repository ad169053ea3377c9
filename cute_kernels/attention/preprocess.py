"""The attention backward's preprocess: D = rowsum(dO * O), one fp32 value per (token, head)
row, for Hopper (sm_90a), on the row-wise family's tiling (``rowwise/rows.py``).

O and dO arrive as (M, D) rows (M = tokens x heads); each row is read once, in 16-byte vectors,
by ``threads_per_row`` consecutive threads whose products are summed with warp shuffles (fp32),
and the thread holding column 0 writes D[row].

Constraints:
  - O and dO bf16 or fp16 (the same dtype), (M, D) with the last dim contiguous, row strides
    multiples of 8 elements and data on 16 bytes; D fp32 (M,) contiguous
  - head dim D static per compiled kernel (64, 96 or 128); M dynamic, M >= 1
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from ..primitives.reduce import add, row_reduce
from ..rowwise.rows import RowKernel, load_fragments, make_row_copy, reduction_workspace, thread_fragment


class RowDotSm90(RowKernel):
    """D[m] = sum_j O[m, j] * dO[m, j]. See the module docstring."""

    tensor_cores = False  # plain vector loads and shuffles (the self-check's table)

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mD: cute.Tensor, stream):
        self._launch(self.kernel(mO, mdO, mD), cute.ceil_div(mO.shape[0], self.rows.rows_per_cta), stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mD: cute.Tensor):
        cfg = self.rows
        smem = cutlass.memory.SmemAllocator()
        buffer, mbar_ptr = reduction_workspace(smem, cfg, 1)
        tile, pred = self._tile_and_predicate(mO)
        tXgO = thread_fragment(mO, make_row_copy(mO.element_type, cfg), cfg, tile)
        tXgdO = thread_fragment(mdO, make_row_copy(mdO.element_type, cfg), cfg, tile)
        tXrO = cute.make_rmem_tensor_like(tXgO)
        tXrdO = cute.make_rmem_tensor_like(tXgdO)
        load_fragments(pred, (tXgO, tXrO, None, mO.element_type(0)),
                       (tXgdO, tXrdO, None, mdO.element_type(0)))
        products = tXrO.load().to(Float32) * tXrdO.load().to(Float32)
        (dot,) = row_reduce((products.reduce(cute.ReductionOp.ADD, Float32(0.0), 0),), add,
                            (Float32(0.0),), cfg.threads_per_row, buffer[None, None, None, 0],
                            mbar_ptr, cfg.cluster_n)
        first = self._coords(mO, tile)[0]  # (row, column) of this thread's first element
        if first[1] == 0 and first[0] < mO.shape[0]:
            mD[first[0]] = dot
