"""Views and conversions of wgmma register fragments, and the warpgroup GEMM issue (device
code, no torch).

A Hopper wgmma accumulator of one warpgroup's 64 x N tile holds, per thread, values of shape
``((2, 2, N / 8), MMA_M, MMA_N)``: a pair of adjacent columns, two rows 8 apart, one pair per
8-column group. Attention works on it by rows (the online softmax, the masks) and feeds it back
to the next wgmma as its A operand from registers (P in ``O += P V``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op


def rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """The accumulator as (rows, columns) of this thread: ((2, MMA_M), (2, N / 8, MMA_N))."""
    compact = cute.make_layout(acc.layout.shape)
    (pair, half, groups), mma_m, mma_n = compact.shape
    (s_pair, s_half, s_groups), t_m, t_n = compact.stride
    by_rows = cute.make_layout(
        ((half, mma_m), (pair, groups, mma_n)),
        stride=((s_half, t_m), (s_pair, s_groups, t_n)),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, by_rows))


def as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """The accumulator of ``S = Q K^T`` viewed as the register A operand of ``O += P V``:
    ((2, 2, N / 8), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, (N / 16, MMA_N)), each k16 block of P
    being two 8-column groups of S."""
    split = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
    (pair, half, (two, blocks)), mma_m, mma_n = split.shape
    (s_pair, s_half, (s_two, s_blocks)), t_m, t_n = split.stride
    layout = cute.make_layout(
        ((pair, half, two), mma_m, (blocks, mma_n)),
        stride=((s_pair, s_half, s_two), t_m, (s_blocks, t_n)),
    )
    return cute.make_tensor(acc.iterator, layout)


@dsl_user_op
def _pack_half2(lo: Float32, hi: Float32, to_bf16: bool, *, loc=None, ip=None) -> Int32:
    kind = "bf16x2" if to_bf16 else "f16x2"
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
            f"cvt.rn.{kind}.f32 $0, $1, $2;",
            "=r,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def convert_pairs(src: cute.Tensor, dst: cute.Tensor):
    """dst (bf16 / fp16) = src (fp32), two values per ``cvt`` (element order of both tensors'
    shapes; the pairs must be adjacent in ``dst``'s layout, as in a compact fragment)."""
    packed = cute.recast_tensor(dst, Int32)
    to_bf16 = cutlass.const_expr(dst.element_type is cutlass.BFloat16)
    for i in cutlass.range(cute.size(packed), unroll_full=True):
        packed[i] = _pack_half2(src[2 * i], src[2 * i + 1], to_bf16)


@cute.jit
def warpgroup_gemm(tiled_mma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor, zero: cutlass.Constexpr):
    """Issue one warpgroup GEMM (the k-blocks of ``a`` and ``b``) into ``acc`` and commit it as
    one wgmma group; ``zero`` overwrites ``acc`` instead of adding to it. The caller waits."""
    warpgroup.fence()
    # A fresh atom: setting ACCUMULATE on a shared one inside dynamic control flow fails.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero)
    for k in cutlass.range_constexpr(cute.size(a, mode=[2])):
        cute.gemm(atom, acc, a[None, None, k], b[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
