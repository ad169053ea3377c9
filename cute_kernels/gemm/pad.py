"""Zero-padding two row-major 16-bit operands along K in one launch, for Hopper (sm_90a).

TMA reads rows whose length is a multiple of 16 bytes. A GEMM whose K is not (odd sizes, e.g.
333 x 1000 x 777) copies both operands into rows of ``Kp`` (the next multiple of 8 elements),
zeros after K: one kernel for both, so that such a call costs two allocations and two launches
of host time. Each thread writes 8 consecutive elements of the output, element by element (the
source rows have no alignment; the copies are small next to the GEMM).

Constraints:
  - src (R, K) 16-bit with unit column stride and any row stride; dst (R, Kp) row-major,
    Kp a multiple of 8 and >= K, data on 16 bytes; R, K dynamic
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

THREADS = 256
VEC = 8  # 16 bytes of a 16-bit type


class PadRowsSm90:
    """See the module docstring. ``config`` is unused (one kernel per dtype)."""

    tensor_cores = False  # plain loads and vector stores (the self-check's table)

    def __init__(self, config=None):
        self.config = config

    @cute.jit
    def __call__(self, mA: cute.Tensor, mAp: cute.Tensor, mB: cute.Tensor, mBp: cute.Tensor, stream):
        blocks_a = cute.ceil_div(mAp.shape[0] * (mAp.shape[1] // VEC), THREADS)
        blocks_b = cute.ceil_div(mBp.shape[0] * (mBp.shape[1] // VEC), THREADS)
        self.kernel(mA, mAp, mB, mBp, blocks_a).launch(
            grid=[blocks_a + blocks_b, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mAp: cute.Tensor, mB: cute.Tensor, mBp: cute.Tensor,
               blocks_a: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        if bidx < blocks_a:
            self.pad_vector(mA, mAp, bidx * THREADS + tidx)
        else:
            self.pad_vector(mB, mBp, (bidx - blocks_a) * THREADS + tidx)

    @cute.jit
    def pad_vector(self, src: cute.Tensor, dst: cute.Tensor, i: Int32):
        chunks = dst.shape[1] // VEC
        row = i // chunks
        chunk = i - row * chunks
        last = src.shape[1] - 1
        if row < dst.shape[0]:
            for j in cutlass.range_constexpr(VEC):
                col = chunk * VEC + j
                value = src[row, cutlass.min(col, last)]  # always in bounds (K >= 1)
                dst[row, col] = cutlass.select_(col <= last, value, dst.element_type(0))
