"""The backward's fp32 accumulators: their layout, shared by the main kernels (which add into
them), the prepare pass (which zeroes dQ's) and the finish pass (which scales one into dQ, dK
or dV).

The accumulator is (H, R, D) fp32, one contiguous range of R rows of D per query head. Query
block m (``tile_m`` rows) of sequence b owns the ``tile_m`` rows from ``chunk_row``: b times
the padded sequence length (``ceil(Sq / tile_m) * tile_m``), or, varlen, the sequence's first
token plus ``tile_m`` rows per sequence before it (so no block overlaps the next sequence's);
R is what that needs (``accum_rows``). The dK and dV accumulators of a split query-head group
(``bwd_sm90.py``: several CTAs add into one key block) are the same over keys: (2 Hkv, R, D),
dK's heads first, blocks of ``tile_n`` keys, a block's two MMA warpgroup tiles by rows.

Inside a block's ``tile_m x D`` floats the values are not in row order but in the order the
MMA warpgroups hold them: each dQ warpgroup's 64-row wgmma C fragment (``dq_cols`` columns)
is one contiguous ``64 x dq_cols`` tile, and in it the 4 values v = 4 k .. 4 k + 3 of thread
t (0..127) lie at floats ``(128 k + t) * 4``. So a warpgroup stores its tile with one 16-byte
store per 4 values (a warp writes 512 contiguous bytes: no bank conflicts), and the reduce
warp adds it to global memory with one 1-D bulk reduce. Value v of thread t is element
(``fragment_row``, ``fragment_col``) of the warpgroup's tile: rows 16 (t / 32) + (t % 32) / 4
(+ 8 for v % 4 >= 2), columns 8 (v / 4) + 2 (t % 4) + v % 2. The warpgroup tiles of a block
split it by rows (tile_m 128: 64 rows each, all of D) or by columns (tile_m 64: ``dq_cols``
each; one warpgroup takes all of D at head dim 96).

Constraints:
  - dQ tiles of 64 rows (one m64 wgmma per warpgroup) and a multiple of 8 columns; 128 threads
    per warpgroup
  - the accumulator fp32, contiguous, on 16 bytes (every tile then starts on 16 bytes: a bulk
    reduce's source, destination and size must be)
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

WG_ROWS = 64  # rows of one warpgroup's dQ tile (one m64 wgmma)
THREADS = 128  # threads of a warpgroup


def dq_warpgroups(head_dim: int) -> int:
    """Warpgroups that compute dQ (head dim 96: its halves would cut K's swizzle atoms)."""
    return 1 if head_dim == 96 else 2


def dq_split(head_dim: int, tile_m: int) -> tuple[bool, int]:
    """(split by rows, columns per warpgroup tile) of a query block's dQ."""
    by_rows = tile_m == 2 * WG_ROWS
    return by_rows, head_dim if by_rows else head_dim // dq_warpgroups(head_dim)


def accum_rows(batches: int, rows_q: int, tile_m: int, varlen: bool) -> int:
    """R of the (H, R, D) accumulator: ``rows_q`` is Sq, or varlen the packed query tokens."""
    if varlen:
        return rows_q + batches * tile_m
    return batches * (-(-rows_q // tile_m) * tile_m)


@cute.jit
def chunk_row(seq, batch, m_block, tile_m: cutlass.Constexpr, varlen: cutlass.Constexpr,
              keys: cutlass.Constexpr = False):
    """First accumulator row (within a head) of query block ``m_block`` of sequence ``batch``
    (``keys``: of key block ``m_block``, in a dK / dV accumulator)."""
    offset, length = seq.offset_q, seq.seqlen_q
    if const_expr(keys):
        offset, length = seq.offset_k, seq.seqlen_k
    if const_expr(varlen):
        return offset + (batch + m_block) * tile_m
    return (batch * cute.ceil_div(length, tile_m) + m_block) * tile_m


@cute.jit
def chunk_address(mAcc: cute.Tensor, head, row) -> cutlass.Int64:
    """Byte address of accumulator row ``row`` of query head ``head`` (64-bit arithmetic)."""
    return (mAcc.iterator + cute.crd2idx((head, row, Int32(0)), mAcc.layout)).toint()


@cute.jit
def bulk_reduce_add(dst: cutlass.Int64, src: Int32, size: cutlass.Constexpr, issue):
    """``size`` bytes of fp32 in shared memory (``src``) added to global memory (``dst``) by one
    1-D bulk reduce, issued by the threads where ``issue`` holds, committed to their bulk
    group (the caller commits and waits)."""
    cute.arch.inline_ptx(
        "{ .reg .pred p; setp.ne.b32 p, {$r2}, 0;"
        " @p cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32"
        f" [{{$r0}}], [{{$r1}}], {size}; }}",
        read_only_args=[dst, src, cutlass.select_(issue, Int32(1), Int32(0))])


@cute.jit
def store_fragment(acc: cute.Tensor, address: Int32):
    """A warpgroup's dQ fragment (fp32, 4 k + j = its compact index) into its tile in shared
    memory: values 4 k .. 4 k + 3 at byte ``address + 2048 k``, ``address`` = the tile's start
    + 16 t."""
    for k in cutlass.range_constexpr(cute.size(acc) // 4):
        cute.arch.inline_ptx(
            f"st.shared.v4.f32 [{{$r0}}+{2048 * k}], {{{{$r1}}, {{$r2}}, {{$r3}}, {{$r4}}}};",
            read_only_args=[address, acc[4 * k], acc[4 * k + 1], acc[4 * k + 2], acc[4 * k + 3]])


def fragment_row(t, v: int):
    """Row within a warpgroup's 64-row tile of value ``v`` of thread ``t`` (module docstring)."""
    return 16 * (t // 32) + (t % 32) // 4 + 8 * ((v // 2) % 2)


def fragment_col(t, v: int):
    """Column within a warpgroup's tile of value ``v`` of thread ``t``."""
    return 8 * (v // 4) + 2 * (t % 4) + v % 2
