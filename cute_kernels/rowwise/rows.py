"""Device-side helpers shared by the row-wise kernels: tiling a (M, N) tensor into per-thread
register fragments, predicated vector loads and stores, and the reduction workspace.

The tiling follows :class:`~cute_kernels.rowwise.config.RowConfig`: a CTA owns ``rows_per_cta``
rows and ``cols_per_cta`` columns (one ``cluster_n``-th of each row); thread ``t`` of a row reads
vectors ``t, t + threads_per_row, ...`` so every warp access is coalesced.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync
from cutlass import Boolean, Float32, Int32, Int64, const_expr

from ..primitives.reduce import padded_width
from .config import RowConfig


def make_row_copy(dtype, config: RowConfig) -> cute.TiledCopy:
    """Tiled copy moving ``config.vec`` elements of ``dtype`` per thread access."""
    atom = cute.make_copy_atom(
        cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=config.vec * dtype.width
    )
    threads = cute.make_ordered_layout((config.rows_per_cta, config.threads_per_row), order=(1, 0))
    values = cute.make_layout((1, config.vec))
    return cute.make_tiled_copy_tv(atom, threads, values)


def cta_tiler(config: RowConfig) -> tuple:
    return (config.rows_per_cta, config.cols_per_cta)


def thread_fragment(mT: cute.Tensor, tiled_copy: cute.TiledCopy, config: RowConfig, tile):
    """This thread's (vec, 1, vecs_per_thread) view of its CTA's tile of ``mT``."""
    tidx, _, _ = cute.arch.thread_idx()
    gT = cute.local_tile(mT, cta_tiler(config), tile)
    return tiled_copy.get_slice(tidx).partition_S(gT)


def bounds_predicate(tXcX: cute.Tensor, m_rows, config: RowConfig):
    """One flag per vector of this thread's fragment: is it inside the tensor? (Its row is
    below ``m_rows`` -- not checked when None -- and, when the tile overhangs the row, its
    column below ``config.n``.) None when nothing needs checking: every access in bounds."""
    if const_expr(m_rows is None and config.even_n):
        return None
    pred = cute.make_rmem_tensor(
        cute.make_layout(
            (cute.size(tXcX, mode=[0, 1]), cute.size(tXcX, mode=[1]), cute.size(tXcX, mode=[2])),
            stride=(cute.size(tXcX, mode=[2]), 0, 1),
        ),
        Boolean,
    )
    row_ok = Boolean(True) if m_rows is None else tXcX[0][0] < m_rows
    for v in range(pred.shape[0]):
        for k in range(pred.shape[2]):
            if const_expr(config.even_n):
                pred[v, 0, k] = row_ok
            else:
                pred[v, 0, k] = row_ok & cute.elem_less(tXcX[(0, v), 0, k][1], config.n)
    return pred


@cute.jit
def zero_padding(values, tXrX: cute.Tensor, pred, config: RowConfig):
    """``values`` (a TensorSSA shaped like this thread's fragment ``tXrX``) with the elements
    of out-of-bounds vectors (``pred`` False) set to 0; ``values`` itself when every column
    is in bounds (``config.even_n``) or there is no predicate."""
    if const_expr(pred is None or config.even_n):
        return values
    held = cute.make_rmem_tensor_like(tXrX, Float32)
    held.store(values)
    for i in cutlass.range_constexpr(cute.size(tXrX, mode=[0, 0])):
        for v in cutlass.range_constexpr(cute.size(pred, mode=[0])):
            for k in cutlass.range_constexpr(cute.size(pred, mode=[2])):
                held[(i, v), 0, k] = cutlass.select_(pred[v, 0, k], held[(i, v), 0, k], Float32(0.0))
    return held.load()


def _vector_atom(tensor: cute.Tensor) -> cute.CopyAtom:
    bits = cute.size(tensor, mode=[0, 0]) * tensor.element_type.width
    return cute.make_copy_atom(
        cute.nvgpu.CopyUniversalOp(), tensor.element_type, num_bits_per_copy=bits
    )


def stage_buffer(smem, dtype, config: RowConfig, stages: int = 1) -> cute.Tensor:
    """Shared memory for ``stages`` copies of a CTA tile: (rows_per_cta, cols_per_cta, stages)."""
    layout = cute.make_ordered_layout(cta_tiler(config) + (stages,), order=(1, 0, 2))
    return smem.allocate_tensor(dtype, layout, 16)


def stage_view(sT: cute.Tensor, tiled_copy: cute.TiledCopy, stage) -> cute.Tensor:
    """This thread's fragment of stage ``stage`` of a staging buffer."""
    tidx, _, _ = cute.arch.thread_idx()
    return tiled_copy.get_slice(tidx).partition_D(sT[None, None, stage])


def copy_async(tXgX: cute.Tensor, tXsX: cute.Tensor, pred: cute.Tensor) -> None:
    """Issue cp.async of this thread's in-bounds vectors into its staged fragment (commit and
    wait are the caller's). Vectors must be at least 4 bytes."""
    bits = cute.size(tXgX, mode=[0, 0]) * tXgX.element_type.width
    mode = cpasync.LoadCacheMode.GLOBAL if bits == 128 else cpasync.LoadCacheMode.ALWAYS
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=mode), tXgX.element_type,
                               num_bits_per_copy=bits)
    cute.copy(atom, tXgX, tXsX, pred=pred)


@cute.jit
def bulk_copy(dst: cute.Pointer, src: cute.Pointer, num_bytes: cutlass.Constexpr[int], mbar_ptr: cute.Pointer) -> None:
    """One thread: copy ``num_bytes`` (a multiple of 16, both addresses 16-byte aligned) from
    global to shared memory, completing the bytes on ``mbar_ptr``."""
    cute.arch.inline_ptx(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [{$r0}], [{$r1}], {$r2}, [{$r3}];",
        read_only_args=[Int32(dst.toint()), Int64(src.toint()), Int32(num_bytes), Int32(mbar_ptr.toint())],
    )


def read_fragment(source: cute.Tensor, tXrX: cute.Tensor, pred, fill) -> None:
    """Registers <- ``fill``, then the in-bounds vectors of ``source`` (global or staged); with
    no predicate (all in bounds) just the vectors."""
    if const_expr(pred is not None):
        tXrX.fill(fill)
    cute.copy(_vector_atom(source), source, tXrX, pred=pred)


def load_fragments(pred: cute.Tensor, *loads) -> None:
    """Load each ``(global fragment, register fragment, staged fragment or None, fill)``: the
    registers are filled with ``fill`` and the in-bounds vectors loaded over them. With a staged
    fragment the vectors go through shared memory by cp.async (all issued before one wait); each
    thread reads back only what it copied itself, so no barrier is needed."""
    staged = [load for load in loads if load[2] is not None]
    for tXgX, _, tXsX, _ in staged:
        copy_async(tXgX, tXsX, pred)
    if staged:
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
    for tXgX, tXrX, tXsX, fill in loads:
        read_fragment(tXgX if tXsX is None else tXsX, tXrX, pred, fill)


def store_fragment(tXrY: cute.Tensor, tXgY: cute.Tensor, pred: cute.Tensor) -> None:
    cute.copy(_vector_atom(tXgY), tXrY, tXgY, pred=pred)


def reduction_workspace(smem, config: RowConfig, width: int, buffers: int = 1, extra_barriers: int = 0):
    """Shared-memory exchange buffers for row reductions: a Float32 tensor
    (rows_per_cta, warps_per_row * cluster_n, padded width, buffers) and, for a cluster, one
    mbarrier per buffer, each initialized for one arrival (the transaction bytes do the rest).
    Index both with the buffer number: ``buffer[None, None, None, b]``, ``mbar_ptr + b``.
    ``extra_barriers`` more mbarriers follow for the caller's own use (bulk copies): barrier
    ``buffers + j`` is initialized by thread ``buffers + j``, which may use it at once; the
    other threads after the cluster barrier."""
    warps_per_row = max(config.threads_per_row // 32, 1)
    layout = cute.make_ordered_layout(
        (config.rows_per_cta, warps_per_row * config.cluster_n, padded_width(width), buffers),
        order=(2, 1, 0, 3),
    )
    buffer = smem.allocate_tensor(Float32, layout, byte_alignment=16)
    mbar_ptr = None
    if const_expr(config.cluster_n > 1):
        mbar_ptr = smem.allocate_array(Int64, buffers + extra_barriers, byte_alignment=8)
        _init_cluster_barriers(mbar_ptr, buffers + extra_barriers)
    return buffer, mbar_ptr


@cute.jit
def _init_cluster_barriers(mbar_ptr: cute.Pointer, count: cutlass.Constexpr[int]) -> None:
    tidx, _, _ = cute.arch.thread_idx()
    if tidx < count:
        cute.arch.mbarrier_init(mbar_ptr + tidx, 1)
    cute.arch.mbarrier_init_fence()
    cute.arch.cluster_arrive_relaxed()


class RowKernel:
    """Launch plumbing shared by the row kernels: CTAs of ``num_threads`` threads own
    ``rows_per_cta`` rows each, and a cluster of ``cluster_n`` CTAs (grid dim y) shares a row.

    ``config`` is a :class:`RowConfig`, or a config with one in its ``row`` field.
    """

    def __init__(self, config):
        self.config = config
        self.rows = config if isinstance(config, RowConfig) else config.row

    def _launch(self, kernel, grid_x, stream, ctas_per_sm: int = 0, full_carveout: bool = False):
        """Launch ``kernel`` on ``grid_x`` row tiles; ``ctas_per_sm`` > 1 caps its registers so
        that many CTAs fit on one SM (with the whole shared-memory carveout, also asked for by
        ``full_carveout``)."""
        rows = self.rows
        kernel.launch(
            grid=[grid_x, rows.cluster_n, 1],
            block=[rows.num_threads, 1, 1],
            cluster=[1, rows.cluster_n, 1] if const_expr(rows.cluster_n > 1) else None,
            stream=stream,
            min_blocks_per_mp=ctas_per_sm,
            preferred_smem_carveout=100 if ctas_per_sm > 1 or full_carveout else None,
        )

    def _tile(self, tile_m):
        """(row tile, column tile) of this CTA: the column tile is its rank in the cluster."""
        if const_expr(self.rows.cluster_n > 1):
            return (tile_m, cute.arch.block_idx()[1])
        return (tile_m, 0)

    def _coords(self, mT: cute.Tensor, tile):
        """This thread's (row, column) coordinates in ``mT`` for the CTA tile ``tile``."""
        coords = cute.make_identity_tensor(mT.shape)
        return thread_fragment(coords, make_row_copy(mT.element_type, self.rows), self.rows, tile)

    def _tile_and_predicate(self, mT: cute.Tensor):
        """This CTA's tile and this thread's in-bounds flags, one per vector (one tile per CTA,
        launched for the row tiles of ``mT`` only)."""
        tile = self._tile(cute.arch.block_idx()[0])
        return tile, bounds_predicate(self._coords(mT, tile), self.rows_to_check(mT), self.rows)

    def rows_to_check(self, mT: cute.Tensor):
        """The row bound for ``bounds_predicate`` on a tile that exists (index below the tile
        count): ``mT``'s rows, or None when a tile is one row, which is then always in range."""
        return None if const_expr(self.rows.rows_per_cta == 1) else mT.shape[0]
