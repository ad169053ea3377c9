"""Sequence bounds, key-block ranges and score masks of one query tile (device code, no torch).

Masks follow FlashAttention: aligned bottom-right, so query row i sits at key position
``i + Sk - Sq``; with ``local`` it sees keys ``[i + Sk - Sq - left, i + Sk - Sq + right]``
(causal: right = 0, left unbounded, passed as a value past every key). Masked scores become
-inf before the softmax. Only the boundary blocks of a tile are masked: the first block visited
(the last key block, which may hold the key tail) and the blocks the diagonal or the window's
left edge crosses. Each row's visible columns become one 32-bit keep mask per 32 of a thread's
values (two shifts from the row's limits), each value selected by a constant bit, which ptxas
turns into R2P predicate moves: about one instruction per value instead of two compares and a
select.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .fragments import rows_cols


@dsl_user_op
def _shift(value: Int32, amount: Int32, left: bool, *, loc=None, ip=None) -> Int32:
    """``value`` shifted by ``amount`` bits (PTX ``shl.b32`` / ``shr.u32``: amounts of 32 or
    more give 0, where LLVM's shifts are undefined)."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Int32(value).ir_value(loc=loc, ip=ip), Int32(amount).ir_value(loc=loc, ip=ip)],
            f"{'shl.b32' if left else 'shr.u32'} $0, $1, $2;",
            "=r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def _elements_before(limit, columns: int):
    """How many of a thread's accumulator columns (thread 0's: 0, 1, 8, 9, 16, 17, ...; the
    other threads' shifted by their own offset) lie below column ``limit``."""
    limit = cutlass.min(cutlass.max(limit, 0), columns)
    return 2 * (limit >> 3) + cutlass.min(limit & 7, 2)


@cute.jit
def mask_columns(row: cute.Tensor, lo, hi, col_offset):
    """Set the values of ``row`` (one row of a thread's wgmma accumulator, in order) whose
    column lies outside [lo, hi) to -inf; ``col_offset`` is the thread's first column."""
    width = 4 * cute.size(row)  # the accumulator's columns: a thread holds a quarter of them
    _mask_elements(row, _elements_before(lo - col_offset, width), _elements_before(hi - col_offset, width))


@cute.jit
def _mask_elements(row: cute.Tensor, lo, hi):
    """Set the elements of ``row`` (a thread's columns of one accumulator row, in order)
    outside [lo, hi) (element indices) to -inf: one 32-bit keep mask per 32 elements, each
    element selected by a constant bit (ptxas moves the bits to predicates with R2P)."""
    n = cute.size(row)
    for chunk in cutlass.range_constexpr((n + 31) // 32):
        base = 32 * chunk
        below = cutlass.min(cutlass.max(hi - base, 0), 32)
        above = cutlass.min(cutlass.max(lo - base, 0), 32)
        keep = _shift(Int32(-1), 32 - below, False) & _shift(Int32(-1), above, True)
        for i in cutlass.range_constexpr(min(32, n - base)):
            if keep & (1 << i if i < 31 else -(1 << 31)) == 0:
                row[base + i] = -Float32.inf


class Sequence:
    """Where one batch entry's query and key rows start and how many there are."""

    def __init__(self, batch, seqlen_q_static, seqlen_k_static, cu_seqlens_q, cu_seqlens_k):
        if cutlass.const_expr(cu_seqlens_q is None):
            self.offset_q, self.seqlen_q = Int32(0), seqlen_q_static
        else:
            self.offset_q = cu_seqlens_q[batch]
            self.seqlen_q = cu_seqlens_q[batch + 1] - self.offset_q
        if cutlass.const_expr(cu_seqlens_k is None):
            self.offset_k, self.seqlen_k = Int32(0), seqlen_k_static
        else:
            self.offset_k = cu_seqlens_k[batch]
            self.seqlen_k = cu_seqlens_k[batch + 1] - self.offset_k


class TileMask:
    """Key-block range and masks of query tile ``m_block`` (tile_m rows) against key blocks of
    tile_n rows."""

    def __init__(self, tile_m: int, tile_n: int, local: bool, seq: Sequence, m_block,
                 window_left, window_right):
        self.tile_m, self.tile_n, self.local = tile_m, tile_n, local
        self.seq, self.m_block = seq, m_block
        self.left, self.right = window_left, window_right
        # Key position of query row 0 of the tile (bottom-right alignment).
        self.diag0 = m_block * tile_m + seq.seqlen_k - seq.seqlen_q

    @cute.jit
    def block_range(self):
        """(n_min, n_max): the key blocks any row of the tile may see."""
        n_max = cute.ceil_div(self.seq.seqlen_k, self.tile_n)
        n_min = Int32(0)
        if cutlass.const_expr(self.local):
            right_edge = cutlass.max(self.diag0 + self.tile_m + self.right, 0)
            n_max = cutlass.min(n_max, cute.ceil_div(right_edge, self.tile_n))
            n_min = cutlass.max(self.diag0 - self.left, 0) // self.tile_n
        return n_min, n_max

    def first_block_past_diagonal(self, n_min):
        """Blocks from this one up may hold keys right of some row's window (need masking)."""
        return cutlass.max(n_min, cutlass.max(self.diag0 + self.right, 0) // self.tile_n)

    def first_block_inside_left_edge(self, n_min):
        """Blocks below this one may hold keys left of some row's window (need masking)."""
        left_edge = cutlass.max(self.diag0 + self.tile_m - self.left, 0)
        return cutlass.max(n_min, cute.ceil_div(left_edge, self.tile_n))

    @cute.jit
    def apply(self, acc_s: cute.Tensor, n_block, thr_mma, row_offset, check_seqlen: cutlass.Constexpr):
        """Set masked scores of key block ``n_block`` to -inf: keys past the sequence (with
        ``check_seqlen``) and, with ``local``, keys outside each row's window. ``acc_s`` is one
        warpgroup's 64 rows, the tile's rows from ``row_offset`` on, partitioned by ``thr_mma``."""
        s = rows_cols(acc_s)
        coords = cute.make_identity_tensor((64, self.tile_n))
        mine = rows_cols(thr_mma.partition_C(coords))
        # Thread 0's column coordinates are compile-time constants; other threads compare
        # against limits shifted by their own column offset.
        thread0 = rows_cols(thr_mma.get_slice(0).partition_C(coords))
        col_offset = mine[0][1]
        columns = cute.size(s, mode=[1])
        for c in cutlass.range_constexpr(columns):  # the column order _elements_before counts
            assert thread0[0, c][1] == 8 * (c // 2) + c % 2, "unexpected accumulator columns"
        n_block = cutlass.max(n_block, 0)  # an empty range still visits block -1 (all masked)
        seq_limit = self.seq.seqlen_k - n_block * self.tile_n - col_offset
        if cutlass.const_expr(not self.local):
            if cutlass.const_expr(check_seqlen):
                hi = _elements_before(seq_limit, self.tile_n)
                for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                    _mask_elements(s[r, None], 0, hi)
        else:
            diag = self.diag0 + row_offset - n_block * self.tile_n - col_offset
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                row_diag = diag + mine[r, 0][0]
                hi = row_diag + self.right + 1
                if cutlass.const_expr(check_seqlen):
                    hi = cutlass.min(hi, seq_limit)
                lo = row_diag - self.left
                _mask_elements(s[r, None], _elements_before(lo, self.tile_n),
                               _elements_before(hi, self.tile_n))
