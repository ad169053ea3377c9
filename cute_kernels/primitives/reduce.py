"""Reductions of a value spread over the threads of a row: within a warp, across the warps
of a CTA through shared memory, and across the CTAs of a cluster through distributed shared
memory (``st.async`` into every peer's buffer, counted by the peer's mbarrier).

A *partial* is a tuple of Float32 values (one value for a sum or max, two for the online
softmax pair (max, sum)); ``combine(a, b)`` merges two partials and must be associative and
commutative.

Buffer layout: ``(rows_per_cta, warps_per_row * cluster_n, width)`` Float32, row-major, where
entry ``[r, rank * warps_per_row + w]`` holds warp ``w`` of CTA ``rank``'s partial for row ``r``.
"""

from __future__ import annotations

import math
from typing import Callable

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

LOG2_E = math.log2(math.e)


@cute.jit
def shuffle_combine(partial: tuple, combine: Callable, group: cutlass.Constexpr[int]) -> tuple:
    """Butterfly-combine ``partial`` over aligned groups of ``group`` lanes; all lanes get it."""
    result = partial
    for step in cutlass.range_constexpr(int(math.log2(group))):
        offset = group >> (step + 1)
        other = tuple(cute.arch.shuffle_sync_bfly(v, offset=offset) for v in result)
        result = combine(result, other)
    return result


@cute.jit
def _store_remote(
    values: tuple, smem_ptr: cute.Pointer, mbar_ptr: cute.Pointer, peer: Int32
) -> None:
    """``st.async`` one partial (1, 2 or 4 Float32) into ``peer``'s buffer, completing its
    bytes on the peer's mbarrier."""
    remote = cute.arch.map_dsmem_ptr(smem_ptr, peer).toint()
    remote_mbar = cute.arch.map_dsmem_ptr(mbar_ptr, peer).toint()
    width = const_expr(len(values))
    vector = const_expr({1: "f32", 2: "v2.f32", 4: "v4.f32"}[width])
    operands = const_expr(", ".join(f"{{$r{i + 1}}}" for i in range(width)))
    operands = const_expr(operands if width == 1 else "{" + operands + "}")
    cute.arch.inline_ptx(
        f"st.async.shared::cluster.mbarrier::complete_tx::bytes.{vector} "
        f"[{{$r0}}], {operands}, [{{$r{width + 1}}}];",
        read_only_args=[Int32(remote)] + [Float32(v) for v in values] + [Int32(remote_mbar)],
    )


def padded_width(width: int) -> int:
    """Entry width in the exchange buffer: st.async moves 1, 2 or 4 words."""
    return 4 if width == 3 else width


@cute.jit
def cross_warp_combine(
    partial: tuple,
    combine: Callable,
    identity: tuple,
    buffer: cute.Tensor,
    mbar_ptr: cute.Pointer,
    warps_per_row: cutlass.Constexpr[int],
    cluster_n: cutlass.Constexpr[int],
    before_exchange: Callable = None,
    phase: Int32 = 0,
) -> tuple:
    """Combine each warp's (already warp-reduced) partial over all warps of its row, across
    the cluster when ``cluster_n > 1``. Every thread of the row gets the result.

    ``before_exchange`` runs after the local write and before any remote store (the cluster
    path passes ``cluster_wait`` here so peers' barriers are known to be initialized).
    ``phase`` is the mbarrier phase to wait for when the same barrier is used repeatedly.
    A buffer may be written again only after every thread has read it: callers that reduce
    repeatedly alternate between two buffers (see ``rowwise.rows.reduction_workspace``).
    """
    width = const_expr(len(partial))
    lane = cute.arch.lane_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    row = warp // warps_per_row
    slot = warp % warps_per_row
    entries = const_expr(warps_per_row * cluster_n)
    if const_expr(cluster_n == 1):
        if lane == 0:
            for i in cutlass.range_constexpr(width):
                buffer[row, slot, i] = partial[i]
        cute.arch.barrier()
    else:
        rank = cute.arch.block_idx_in_cluster()
        if warp == 0:
            with cute.arch.elect_one():
                rows = const_expr(cute.size(buffer, mode=[0]))
                stored = const_expr(padded_width(width))
                cute.arch.mbarrier_arrive_and_expect_tx(mbar_ptr, rows * entries * stored * 4)
        if const_expr(before_exchange is not None):
            before_exchange()
        if lane < cluster_n:
            dst = buffer.iterator + cute.crd2idx((row, rank * warps_per_row + slot, 0), buffer.layout)
            padding = tuple(Float32(0.0) for _ in range(padded_width(width) - width))
            _store_remote(tuple(partial) + padding, dst, mbar_ptr, lane)
        cute.arch.mbarrier_wait(mbar_ptr, phase)
    result = identity
    for start in cutlass.range_constexpr(0, entries, 32):
        idx = lane + start
        entry = []
        for i in cutlass.range_constexpr(width):
            value = Float32(identity[i])
            if idx < entries:
                value = buffer[row, idx, i]
            entry.append(value)
        result = combine(result, tuple(entry))
    # Lanes past the last entry hold the identity: combine over the whole warp so every lane
    # ends with the row's result.
    return shuffle_combine(result, combine, 32)


@cute.jit
def row_reduce(
    partial: tuple,
    combine: Callable,
    identity: tuple,
    threads_per_row: cutlass.Constexpr[int],
    buffer: cute.Tensor,
    mbar_ptr: cute.Pointer,
    cluster_n: cutlass.Constexpr[int],
    before_exchange: Callable = None,
    phase: Int32 = 0,
) -> tuple:
    """Combine per-thread partials over the ``threads_per_row`` threads of a row (consecutive
    lanes, whole warps when more than 32) and over the cluster. All threads get the result."""
    group = const_expr(min(threads_per_row, 32))
    result = shuffle_combine(partial, combine, group)
    if const_expr(threads_per_row > 32 or cluster_n > 1):
        result = cross_warp_combine(
            result,
            combine,
            identity,
            buffer,
            mbar_ptr,
            max(threads_per_row // 32, 1),
            cluster_n,
            before_exchange,
            phase,
        )
    return result


def add(a: tuple, b: tuple) -> tuple:
    return (a[0] + b[0],)


def maximum(a: tuple, b: tuple) -> tuple:
    return (cute.arch.fmax(a[0], b[0]),)


def softmax_pair(a: tuple, b: tuple) -> tuple:
    """Merge two online-softmax partials (max, sum of exp(x - max)).

    A partial whose max is -inf contributes nothing; ``fmin(m - M, 0)`` maps the -inf - -inf
    NaN to 0, so two all-(-inf) partials merge to (-inf, 0) instead of NaN.
    """
    m = cute.arch.fmax(a[0], b[0])
    scale_a = cute.math.exp2(cute.arch.fmin(a[0] - m, Float32(0.0)) * LOG2_E, fastmath=True)
    scale_b = cute.math.exp2(cute.arch.fmin(b[0] - m, Float32(0.0)) * LOG2_E, fastmath=True)
    return (m, a[1] * scale_a + b[1] * scale_b)
