"""Dynamic per-row int8 quantization in one pass, for Hopper (sm_90a), on the row-wise family's
tiling (``rowwise/rows.py``).

Each row of x is read once into registers (16-byte vectors); the threads of the row reduce its
range ``hi = max(x, 0)``, ``lo = min(x, 0)`` and a finiteness probe (the sum of ``x * 0``: 0, or
NaN once any value is NaN or infinite) with warp shuffles, across warps and across the CTAs of
a cluster; then every thread scales, rounds and stores its codes, and the thread holding column
0 stores the row's scale (and zero point).

With ``inv = 1 / scale`` (one IEEE division per row, ``div.rn``; 1 for a scale of 0):
symmetric ``scale = max(hi, -lo) / 127``, ``q = rint(x * inv)`` (in [-127, 127]); asymmetric
``scale = (hi - lo) / 255``, ``zero = -128 - rint(lo * inv)`` (in [-128, 127]),
``q = clamp(rint(x * inv) + zero, -128, 127)``; so ``x ~ (q - zero) * scale`` and 0 is exact.
``rint`` rounds half to even. A row of zeros has scale 0 (codes 0, or the zero point). A row holding NaN or +-inf gets a NaN scale (the codes of
a NaN quotient are 0 before the zero point): its dequantized values are NaN, never finite junk.

Constraints:
  - x fp32, fp16 or bf16 (M, N), last dim contiguous; q int8 (M, N) likewise; scale fp32 (M,)
    and zero int32 (M,) contiguous; row strides and data aligned to the vector width
  - N static per compiled kernel (the row family's limit: 524288); M dynamic, M >= 1
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from dataclasses import dataclass

from ..primitives.reduce import row_reduce
from ..rowwise.config import RowConfig
from ..rowwise.rows import (
    RowKernel,
    load_fragments,
    make_row_copy,
    reduction_workspace,
    store_fragment,
    thread_fragment,
)


@dataclass(frozen=True)
class QuantizeConfig:
    row: RowConfig
    symmetric: bool = True

    label_fields = ("row", "symmetric")

    @property
    def label(self) -> str:
        return f"{self.row.label} {'sym' if self.symmetric else 'asym'}"


def _range_and_probe(a: tuple, b: tuple) -> tuple:
    return (cute.arch.fmax(a[0], b[0]), cute.arch.fmin(a[1], b[1]), a[2] + b[2])


@cute.jit
def _rint(x: Float32, low: cutlass.Constexpr[int], high: cutlass.Constexpr[int]) -> Int32:
    """Round to the nearest integer, half to even (``cvt.rni``: NaN gives 0, +-inf saturate),
    then saturate to [low, high]."""
    value = cute.arch.inline_ptx("cvt.rni.s32.f32 {$w0}, {$r0};", write_only_types=[Int32],
                                 read_only_args=[Float32(x)])
    return cutlass.min(cutlass.max(value, Int32(low)), Int32(high))


class QuantizeRowsSm90(RowKernel):
    """Per-row int8 codes and scales (and zero points). See the module docstring."""

    tensor_cores = False  # plain vector loads and shuffles (the self-check's table)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mScale: cute.Tensor, mZero, stream):
        self._launch(self.kernel(mX, mQ, mScale, mZero),
                     cute.ceil_div(mX.shape[0], self.rows.rows_per_cta), stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mScale: cute.Tensor, mZero):
        cfg = self.rows
        smem = cutlass.memory.SmemAllocator()
        buffer, mbar_ptr = reduction_workspace(smem, cfg, 3)
        tile, pred = self._tile_and_predicate(mX)
        tXgX = thread_fragment(mX, make_row_copy(mX.element_type, cfg), cfg, tile)
        tXgQ = thread_fragment(mQ, make_row_copy(mQ.element_type, cfg), cfg, tile)
        tXrX = cute.make_rmem_tensor_like(tXgX)
        load_fragments(pred, (tXgX, tXrX, None, mX.element_type(0)))
        x = tXrX.load().to(Float32)
        hi, lo, probe = row_reduce(
            (x.reduce(cute.ReductionOp.MAX, Float32(0.0), 0),
             x.reduce(cute.ReductionOp.MIN, Float32(0.0), 0),
             (x * 0.0).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)),
            _range_and_probe, (Float32(0.0), Float32(0.0), Float32(0.0)), cfg.threads_per_row,
            buffer[None, None, None, 0], mbar_ptr, cfg.cluster_n,
            cute.arch.cluster_wait if const_expr(cfg.cluster_n > 1) else None,
        )
        if const_expr(self.config.symmetric):
            scale = cute.arch.fmax(hi, -lo) / Float32(127.0) + probe
        else:
            scale = (hi - lo) / Float32(255.0) + probe
        inverse = Float32(1.0) / cutlass.select_(scale == Float32(0.0), Float32(1.0), scale)
        zero = Int32(0)
        if const_expr(not self.config.symmetric):
            zero = Int32(-128) - _rint(lo * inverse, -255, 0)
        quotients = cute.make_rmem_tensor_like(tXrX, Float32)
        quotients.store(x * inverse)
        tXrQ = cute.make_rmem_tensor_like(tXgQ)
        for i in cutlass.range(cute.size(quotients), unroll_full=True):
            if const_expr(self.config.symmetric):
                code = _rint(quotients[i], -127, 127)
            else:
                code = _rint(quotients[i], -256, 255) + zero
                code = cutlass.min(cutlass.max(code, Int32(-128)), Int32(127))
            tXrQ[i] = code.to(cutlass.Int8)
        store_fragment(tXrQ, tXgQ, pred)
        first = self._coords(mX, tile)[0]  # (row, column) of this thread's first element
        if first[1] == 0 and first[0] < mX.shape[0]:
            mScale[first[0]] = scale
            if const_expr(not self.config.symmetric):
                mZero[first[0]] = zero
