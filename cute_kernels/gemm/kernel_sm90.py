"""Dense GEMM for Hopper (sm_90a): D = epilogue(A @ B), batched.

Design:
  - Warp specialization: warpgroup 0 is the producer (one warp issues TMA loads of A and B
    tiles into a multi-stage mbarrier pipeline; its registers are cut to 40 with setmaxnreg);
    one or two MMA warpgroups (232 registers) consume the stages with wgmma, both operands from
    swizzled shared memory. Cooperative schedule: the MMA warpgroups split each tile (64 or
    128 rows each; 128 rows are two m64 MMAs per k-block). Ping-pong schedule
    (``config.pingpong``): each MMA warpgroup owns whole tiles (alternate tiles of the CTA)
    and named barriers hand the tensor cores from one to the other as soon as one has issued
    its last MMAs (they drain under the other's first ones), so one warpgroup's epilogue runs
    under the other's mainloop.
  - Persistent: a static schedule (scheduler.py) walks the output tiles in groups of
    ``swizzle`` cluster columns for L2 reuse; the producer runs ahead into the next tile
    while the MMA warpgroups run the epilogue of the current one. With ``stream_k`` the tiles
    of a last, partial wave are cut along K into equal runs, one per cluster (scheduler.py): a
    piece that does not end its tile stores its fp32 partial sum in a workspace and raises its
    flag (the launch's token); the piece that ends the tile waits for those flags, adds the
    partials (and clears the flags) and runs the epilogue.
  - Clusters of ``cluster_m`` x ``cluster_n`` CTAs share operand tiles by TMA multicast.
  - ``pad_k`` (K not a multiple of 16 bytes): before the mainloop every CTA copies its share of
    the caller's A and B rows into zero-padded buffers, and the grid meets at a barrier (per-CTA
    flags set to the launch's token), so that an unaligned product is one launch.
  - Programmatic dependent launch (``PDL``): the kernel may start while the previous kernel on
    the stream finishes; it sets up shared memory and barriers, then waits for that kernel's
    grid (``griddepcontrol.wait``) before any global memory access, and lets the next kernel
    launch once its producer has issued its last loads.
  - Epilogue: accumulators -> ``alpha * acc (+ beta * C) (+ bias)`` -> activation -> output
    dtype (alpha only where ``Epilogue.multiplies``: not 1, or a per-tensor scale folded in),
    staged through shared memory (stmatrix) and written by TMA store in 64-row x 32-column
    sub-tiles; each MMA warpgroup stores its own rows (own buffers, barrier and store
    warp), so in the cooperative schedule one warpgroup may start the next tile's MMAs while
    the other still stores.
  - fp8 (e4m3 / e5m2): MMA results are folded into a separate fp32 accumulator every
    ``fp8_promote_every`` k-tiles, so long K keeps fp32 accuracy (the first MMA after a fold
    overwrites the MMA accumulator instead of adding to a zeroed one); with ``fp8_split_n`` the MMA
    accumulator covers one column half of the tile and is folded after each half of every
    k-tile (so 128 x 256 tiles fit: 128 + 64 fp32 values per thread); per-row / per-column
    scales are applied in the epilogue, per-tensor scales are read once and folded into alpha.
    With ``epilogue_mma`` the MMA accumulator, idle while the epilogue stores a tile, takes the
    next tile's first k-tile then (the MMA warpgroups otherwise leave the tensor cores idle
    during their epilogue: 1-1.5 us of a 23 us fp8 128 x 256 tile at 4096^3); the producer
    loads one extra k-tile after the CTA's last tile for the last epilogue to run.

Tensors arrive in torch order: A (L, M, K), B (L, K, N), D and C (L, M, N), or without the L mode
for one problem; any of them may be row- or column-major in its last two dims (transposed views
go straight to the TMA descriptors).

Constraints:
  - 16-bit (fp16 / bf16) or 8-bit float A and B of the same width; fp8 needs K-major A and B
  - the contiguous dim of every operand holds a multiple of 16 bytes; the other strides too
  - tile M 64 / 128 / 256 with 64 or 128 rows per MMA warpgroup, tile N a multiple of 16 up to
    256; at most 192 fp32 accumulator values per thread in total; clusters of at most 2 x 2
  - ping-pong: two MMA warpgroups, each holding a whole tile's accumulators (at most 192 fp32
    values per thread, two fp32 accumulators for fp8)
  - ``fp8_split_n``: fp8, cooperative schedule, a fold every k-tile, tile N a multiple of 32
  - ``epilogue_mma``: fp8, a fold every k-tile, cooperative schedule, no stream-K tail
  - ``ctas_per_sm = 2``: one MMA warpgroup (each CTA gets half the shared memory and 216
    registers per MMA thread)
  - ``pad_k``: a capped grid of at most one CTA per SM (a grid barrier follows the copy), no
    stream-K tail; ``mSrcA`` (M, K) and ``mSrcB`` (K, N) with K contiguous, A and B the padded
    buffers (K rounded up to 8 elements), ``flags`` one int64 per CTA, ``token`` new per launch
  - ``stream_k``: cooperative schedule, a capped grid (``max_clusters``); ``work`` holds
    ``tile_m * tile_n`` fp32 values per launched CTA, ``flags`` one int64 per launched CTA, and
    ``token`` is nonzero and new for every launch whose flags were not cleared by a previous
    one (flags left at 0 by a finished launch may be reused with any token)
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.memory
import cutlass.tensor_utils as tensor_utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from ..primitives.named_barriers import GemmBarrier
from .config import GemmConfig
from .scheduler import cluster_tile_counts, sk_run, tail_piece, tile_coords, whole_tiles

SMEM_CAPACITY = 232448
SMEM_PER_SM = 233472  # 228 KB, each resident CTA also reserving 1 KB
PRODUCER_REGISTERS = 40
PAD_VECTOR = 8  # ``pad_k``: elements per thread and step of the copy (16 bytes of the padded row)
MMA_REGISTERS = 232
# Two CTAs per SM (``GemmConfig.ctas_per_sm``): 65536 registers / 2 CTAs / 128 threads per
# warpgroup = 256 per producer + MMA warpgroup pair.
MMA_REGISTERS_TWO_CTAS = 256 - PRODUCER_REGISTERS


def _to_blas_order(t: cute.Tensor, order) -> cute.Tensor:
    """(L, rows, cols) -> the given mode order; a 2-D (rows, cols) tensor gets a unit batch mode."""
    layout = t.layout
    if const_expr(cute.rank(layout) == 2):
        layout = cute.prepend(layout, cute.make_layout(1, stride=0))
    return cute.make_tensor(t.iterator, cute.select(layout, mode=order))


class GemmSm90:
    """See the module docstring. ``__init__`` takes only the compile-time configuration."""

    PDL = True  # launched with programmatic dependent launch (module docstring)

    def __init__(self, config: GemmConfig):
        if config.stream_k and (config.pingpong or config.max_clusters >= 1 << 30):
            raise ValueError(f"stream_k needs the cooperative schedule and a capped grid: {config}")
        if config.fp8_split_n and (config.pingpong or config.fp8_promote_every != 1 or config.tile_n % 32):
            raise ValueError(f"fp8_split_n needs the cooperative schedule, a fold every k-tile "
                             f"(fp8_promote_every=1) and tile N % 32 == 0: {config}")
        if config.epilogue_mma and (config.pingpong or config.stream_k or config.fp8_promote_every != 1):
            raise ValueError(f"epilogue_mma needs fp8 with a fold every k-tile (fp8_promote_every=1), "
                             f"the cooperative schedule and no stream-K tail: {config}")
        if config.pad_k and (config.stream_k or config.max_clusters >= 1 << 30 or config.ctas_per_sm != 1):
            raise ValueError(f"pad_k needs a persistent grid of one CTA per SM at most and no "
                             f"stream-K tail: {config}")
        if config.ctas_per_sm not in (1, 2) or config.ctas_per_sm == 2 and config.mma_warpgroups != 1:
            raise ValueError(f"ctas_per_sm is 1, or 2 with one MMA warpgroup: {config}")
        epi = config.epilogue
        if (epi.row_scale and epi.scalar_scale_a) or (epi.col_scale and epi.scalar_scale_b):
            raise ValueError(f"a scale is per tensor or per row / column, not both: {epi}")
        self.config = config
        self.cluster_mn = (config.cluster_m, config.cluster_n)
        self.num_mma_wg = config.mma_warpgroups
        self.pingpong = config.pingpong
        # Warpgroups that share one output tile: all of them (cooperative) or one (ping-pong).
        self.tile_wgs = 1 if self.pingpong else self.num_mma_wg
        # Each MMA warpgroup owns a block of rows of the tile (all of it in ping-pong): its
        # MMAs read that block of the A stage, and it stores those rows of the output (own
        # buffers, barrier and store warp), so one warpgroup's epilogue never waits for the
        # other's. 128 rows are two m64 MMA atoms per k-block.
        self.wg_rows = config.tile_m // self.tile_wgs
        if self.wg_rows not in (64, 128) or self.tile_wgs * self.wg_rows != config.tile_m:
            raise ValueError(f"tile_m={config.tile_m} with {self.tile_wgs} warpgroup(s) per tile: "
                             f"each needs 64 or 128 rows: {config}")
        # fp32 accumulator values per thread: the tile's, and the MMA accumulator's where fp8
        # folds (a column half with fp8_split_n); more than 192 do not fit next to addresses.
        values = self.wg_rows * config.tile_n // 128
        if config.fp8_promote_every:
            values += values // 2 if config.fp8_split_n else values
        if values > 192:
            raise ValueError(f"{values} fp32 accumulator values per thread (at most 192): {config}")
        self.threads = config.threads
        # setmaxnreg: the producer warpgroup's registers and each MMA warpgroup's (a subclass
        # with more warpgroups per CTA sets its own, within the CTA's launch allocation)
        self.producer_registers = PRODUCER_REGISTERS
        self.mma_registers = MMA_REGISTERS if config.ctas_per_sm == 1 else MMA_REGISTERS_TWO_CTAS

    # ------------------------------------------------------------------ host side

    def _setup(self, a, b, d):
        cfg = self.config
        self.a_dtype, self.b_dtype, self.d_dtype = self.mma_a_dtype(a, b), b.element_type, d.element_type
        self.a_smem_dtype = a.element_type  # what A's pipeline stages hold (the MMA's A dtype here)
        self.a_layout = tensor_utils.LayoutEnum.from_tensor(a)
        self.b_layout = tensor_utils.LayoutEnum.from_tensor(b)
        self.d_layout = tensor_utils.LayoutEnum.from_tensor(d)
        self.acc_dtype = self.accumulator_dtype(self.a_dtype)
        # The epilogue's working values: the accumulator's integers for an integer output,
        # else fp32.
        self.epi_dtype = self.acc_dtype if self.d_dtype is Int32 else Float32
        self._check_dtypes()
        mma_n = cfg.tile_n // 2 if cfg.fp8_split_n else cfg.tile_n
        # One warpgroup's MMA (its block of rows against all of B's columns, or a column half).
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.a_dtype, self.b_dtype, self.a_layout.sm90_mma_major_mode(),
            self.b_layout.sm90_mma_major_mode(), self.acc_dtype, (1, 1, 1), tiler_mn=(64, mma_n),
            a_source=self.a_source,
        )
        mma_k = cute.size(self.tiled_mma.shape_mnk, mode=[2])
        self.tile_mnk = (cfg.tile_m, cfg.tile_n, mma_k * cfg.k_blocks)
        self.a_tiler = self.a_stage_tiler()
        self.cta_layout_mnk = cute.make_layout((*self.cluster_mn, 1))
        self.mcast_a, self.mcast_b = cfg.cluster_n, cfg.cluster_m
        self.epi_tile = (64, min(cfg.epi_n, cfg.tile_n))
        self.epi_buffers = cfg.epi_stages * self.num_mma_wg  # each MMA warpgroup has its own
        ab_bytes = (self.a_tiler[0] * self.a_tiler[1] * self.a_smem_dtype.width
                    + cfg.tile_n * self.tile_mnk[2] * self.b_dtype.width) // 8
        epi_bytes = self.epi_tile[0] * self.epi_tile[1] * self.d_dtype.width // 8 * self.epi_buffers
        capacity = SMEM_CAPACITY if cfg.ctas_per_sm == 1 else SMEM_PER_SM // cfg.ctas_per_sm - 1024
        self.ab_stages = (capacity - 1024 - epi_bytes) // ab_bytes
        self.a_smem_staged = self.a_stage_layout()
        self.b_smem_staged = self._smem_layout(self.b_layout, self.b_dtype, (cfg.tile_n, self.tile_mnk[2]))
        d_major = self.epi_tile[1] if self.d_layout.is_n_major_c() else self.epi_tile[0]
        d_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(self.d_layout, self.d_dtype, d_major), self.d_dtype
        )
        self.epi_smem_staged = cute.tile_to_shape(
            d_atom, cute.append(self.epi_tile, self.epi_buffers),
            order=(1, 0, 2) if self.d_layout.is_m_major_c() else (0, 1, 2),
        )

    # ---- seams for a subclass whose A arrives encoded (NVFP4 weights: quant/nvfp4_w4a16_sm90.py)

    a_source = cute.nvgpu.warpgroup.OperandSource.SMEM  # where the MMA reads A

    def mma_a_dtype(self, a, b):
        """The MMA's A dtype (A's own element type here)."""
        return a.element_type

    def a_stage_tiler(self):
        """(rows, columns) of A's tensor that one pipeline stage loads for one tile."""
        return (self.config.tile_m, self.tile_mnk[2])

    def a_stage_layout(self):
        """A's staged shared-memory layout (swizzled for the MMA here)."""
        return self._smem_layout(self.a_layout, self.a_dtype, self.a_tiler)

    def _check_swap(self, *extras):
        """Trace time: a swapped product (``GemmConfig.swap_ab``) has no epilogue operands
        (they would be indexed along the other dim)."""
        epi = self.config.epilogue
        if any(t is not None for t in extras) or epi != type(epi)(activation=epi.activation, alpha=epi.alpha):
            raise ValueError(f"swap_ab takes no C, bias, scales or zero points: {self.config}")

    def accumulator_dtype(self, operand_dtype):
        """The MMA accumulator's dtype for these operands: Int32 for 8-bit integers (s8 / u8
        wgmma), else Float32."""
        return Int32 if operand_dtype in (cutlass.Int8, cutlass.Uint8) else Float32

    def _check_dtypes(self):
        """Trace time: the epilogue options against the operand and output dtypes."""
        cfg, epi = self.config, self.config.epilogue
        integer = self.acc_dtype is Int32
        if epi.zero_point and not integer:
            raise ValueError(f"zero points need 8-bit integer operands, got {self.a_dtype}: {cfg}")
        if integer and (cfg.fp8_promote_every or cfg.stream_k):
            raise ValueError(f"integer operands accumulate exactly: no fp8 folds, no stream-K: {cfg}")
        if self.d_dtype is Int32 and (not integer or epi.bias or epi.residual or epi.activation
                                      or epi.row_scale or epi.col_scale or epi.multiplies):
            raise ValueError(f"an int32 output is the exact integer product (zero points at most), "
                             f"got {self.a_dtype} operands and {epi}")

    def _smem_layout(self, layout, dtype, shape_mk):
        """Swizzled, staged shared-memory layout for one operand tile (rows, K)."""
        k_major = layout.sm90_mma_major_mode() == cute.nvgpu.OperandMajorMode.K
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(layout, dtype, shape_mk[1] if k_major else shape_mk[0]),
            dtype,
        )
        return cute.tile_to_shape(
            atom, cute.append(shape_mk, self.ab_stages), order=(0, 1, 2) if k_major else (1, 0, 2)
        )

    def _tma_load(self, tensor, smem_staged, tile, mcast):
        op = (cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp() if mcast == 1
              else cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp())
        return cute.nvgpu.cpasync.make_tiled_tma_atom(
            op, tensor, cute.slice_(smem_staged, (None, None, 0)), tile, num_multicast=mcast
        )

    @cute.jit
    def __call__(self, mA, mB, mD, mC, mBias, mScaleA, mScaleB, mZeroA, mSumB, mWork, mFlags,
                 mSrcA, mSrcB, alpha: Float32, beta: Float32, token: cutlass.Int64, stream):
        cfg = self.config
        a = _to_blas_order(mA, (1, 2, 0))  # (M, K, L)
        b = _to_blas_order(mB, (2, 1, 0))  # (N, K, L)
        d = _to_blas_order(mD, (1, 2, 0))  # (M, N, L)
        # pad_k: the kernel first copies the caller's rows (mSrcA, mSrcB) into a and b.
        src_a = _to_blas_order(mSrcA, (1, 2, 0)) if const_expr(cfg.pad_k) else None
        src_b = _to_blas_order(mSrcB, (2, 1, 0)) if const_expr(cfg.pad_k) else None
        pad_a = a if const_expr(cfg.pad_k) else None
        pad_b = b if const_expr(cfg.pad_k) else None
        if const_expr(cfg.swap_ab):  # D^T = B^T A^T: (N, K, L) as A, (M, K, L) as B, (N, M, L)
            self._check_swap(mC, mBias, mScaleA, mScaleB, mZeroA, mSumB)
            a, b, d = b, a, _to_blas_order(mD, (2, 1, 0))
        c = _to_blas_order(mC, (1, 2, 0)) if const_expr(mC is not None) else None
        self._setup(a, b, d)
        tma_a, tma_tensor_a = self._tma_load(a, self.a_smem_staged, self.a_tiler, self.mcast_a)
        tma_b, tma_tensor_b = self._tma_load(b, self.b_smem_staged, (cfg.tile_n, self.tile_mnk[2]), self.mcast_b)
        tma_d, tma_tensor_d = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), d,
            cute.slice_(self.epi_smem_staged, (None, None, 0)), self.epi_tile,
        )
        cm_tiles, cn_tiles, total = cluster_tile_counts(
            d.shape[0], d.shape[1], d.shape[2], (cfg.tile_m, cfg.tile_n), self.cluster_mn)
        schedule = (cm_tiles, cn_tiles, total)
        # Stream-K launches every cluster it may: with fewer tiles than clusters (one partial
        # wave) all of them are cut along K over the whole grid.
        grid = (*self.cluster_mn, cfg.max_clusters if cfg.stream_k else cutlass.min(total, cfg.max_clusters))

        @cute.struct
        class Storage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.a_smem_dtype, cute.cosize(self.a_smem_staged)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem_staged)], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[self.d_dtype, cute.cosize(self.epi_smem_staged)], 1024]

        self.storage = Storage
        self.kernel(
            tma_a, tma_tensor_a, tma_b, tma_tensor_b, tma_d, tma_tensor_d, c, mBias, mScaleA,
            mScaleB, mZeroA, mSumB, mWork, mFlags, src_a, src_b, pad_a, pad_b, alpha, beta, token,
            self.tiled_mma, self.cta_layout_mnk, self.a_smem_staged, self.b_smem_staged,
            self.epi_smem_staged, schedule,
        ).launch(grid=grid, block=[self.threads, 1, 1], cluster=(*self.cluster_mn, 1),
                 min_blocks_per_mp=cfg.ctas_per_sm,
                 preferred_smem_carveout=100 if cfg.ctas_per_sm > 1 else None,
                 stream=stream, use_pdl=self.PDL)

    # ------------------------------------------------------------------ device side

    @cute.kernel
    def kernel(self, tma_a, mA, tma_b, mB, tma_d, mD, mC, mBias, mScaleA, mScaleB, mZeroA, mSumB,
               mWork, mFlags, mSrcA, mSrcB, mPadA, mPadB, alpha: Float32, beta: Float32,
               token: cutlass.Int64, tiled_mma: cute.TiledMma,
               cta_layout_mnk: cute.Layout,
               a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
               epi_smem_staged: cute.ComposedLayout, schedule):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_d)
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout_mnk.get_flat_coord(rank)
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.storage)
        stage_bytes = cute.size_in_bytes(self.a_smem_dtype, cute.slice_(a_smem_staged, (None, None, 0))) + \
            cute.size_in_bytes(self.b_dtype, cute.slice_(b_smem_staged, (None, None, 0)))
        # Every warp of the warpgroup(s) that consume a stage releases it, in each CTA it feeds.
        consumers = (self.mcast_a + self.mcast_b - 1) * self.tile_wgs * 4
        mainloop = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumers),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)),
            defer_sync=True,
        )
        pipeline_init_arrive(cluster_shape_mn=self.cluster_mn, is_relaxed=True)
        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sD = storage.sD.get_tensor(epi_smem_staged.outer, swizzle=epi_smem_staged.inner)
        gA = cute.local_tile(mA, self.a_tiler, (None, None, None))
        gB = cute.local_tile(mB, cute.slice_(self.tile_mnk, (0, None, None)), (None, None, None))
        gD = cute.local_tile(mD, cute.slice_(self.tile_mnk, (None, None, 0)), (None, None, None))
        k_tiles = cute.size(gA, mode=[3])
        pipeline_init_wait(cluster_shape_mn=self.cluster_mn)
        if const_expr(self.PDL):
            cute.arch.griddepcontrol_wait()
        if const_expr(self.config.pad_k):
            self.pad_operands(mSrcA, mPadA, mSrcB, mPadB, mFlags, token, tidx)

        warpgroup = cute.arch.make_warp_uniform(tidx // 128)
        if warpgroup == 0:
            cute.arch.setmaxregister_decrease(self.producer_registers)
            if warp == 0:
                self.load(tma_a, tma_b, sA, sB, gA, gB, mainloop, cta_layout_mnk, cluster_coord,
                          k_tiles, schedule)
        else:
            cute.arch.setmaxregister_increase(self.mma_registers)
            self.mma_and_epilogue(tiled_mma, sA, sB, sD, gD, mD, tma_d, mC, mBias,
                                  (mScaleA, mScaleB, mZeroA, mSumB), mWork, mFlags, alpha, beta,
                                  token, mainloop, k_tiles, schedule, cluster_coord, rank,
                                  tidx - 128, warp)

    @cute.jit
    def pad_operands(self, src_a, pad_a, src_b, pad_b, mFlags, token, tidx):
        """``pad_k``: every CTA copies its share of the rows of A and B into the zero-padded
        buffers the TMA descriptors read (8 consecutive elements per thread and step, element by
        element: the source rows have no alignment; the 8 loads are issued before the 8 stores,
        which could alias them, so that they wait for memory once), then the grid meets at a
        barrier: each CTA raises its flag to ``token`` (release) and waits for every other CTA's
        (acquire). The generic-proxy writes are fenced against the async proxy (TMA) on both
        sides. The grid is at most one CTA per SM (a persistent grid), so every CTA is
        resident."""
        bx, by, bz = cute.arch.block_idx()
        gx, gy, gz = cute.arch.grid_dim()
        cta = (bz * gy + by) * gx + bx
        ctas = gx * gy * gz
        first = cta * self.threads + tidx
        step = ctas * self.threads
        for src, dst in ((src_a, pad_a), (src_b, pad_b)):
            chunks = dst.shape[1] // PAD_VECTOR
            last = src.shape[1] - 1
            for i in range(first, dst.shape[0] * chunks, step):
                row = i // chunks
                chunk = i - row * chunks
                values = cute.make_rmem_tensor((PAD_VECTOR,), dst.element_type)
                for j in cutlass.range_constexpr(PAD_VECTOR):
                    values[j] = src[row, cutlass.min(chunk * PAD_VECTOR + j, last), 0]  # in bounds (K >= 1)
                for j in cutlass.range_constexpr(PAD_VECTOR):
                    col = chunk * PAD_VECTOR + j
                    dst[row, col, 0] = cutlass.select_(col <= last, values[j], dst.element_type(0))
        cute.arch.fence_proxy("async.global")
        cute.arch.barrier()
        if tidx == 0:
            cute.arch.store(mFlags.iterator + cta, token, sem="release", scope="gpu")
        # Every thread waits for its share of the flags (one each up to a grid of as many CTAs
        # as the block has threads): the polls run side by side, one L2 round trip, not a chain.
        for other in range(tidx, ctas, self.threads):
            seen = cute.arch.load(mFlags.iterator + other, cutlass.Int64, sem="acquire", scope="gpu")
            while seen != token:
                seen = cute.arch.load(mFlags.iterator + other, cutlass.Int64, sem="acquire", scope="gpu")
        cute.arch.barrier()
        cute.arch.fence_proxy("async.global")

    @cute.jit
    def load(self, tma_a, tma_b, sA, sB, gA, gB, mainloop, cta_layout_mnk, cluster_coord, k_tiles,
             schedule):
        """Producer warp: TMA loads of A and B k-tiles for every tile this CTA owns."""
        a_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=1) if const_expr(self.mcast_a > 1) else 0
        b_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0) if const_expr(self.mcast_b > 1) else 0
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, cluster_coord[1], cute.make_layout(cute.slice_(cta_layout_mnk, (0, None, 0)).shape),
            cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2),
        )
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, cluster_coord[0], cute.make_layout(cute.slice_(cta_layout_mnk, (None, 0, 0)).shape),
            cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2),
        )
        cm_tiles, cn_tiles, total = schedule
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        cluster, clusters = cute.arch.block_idx()[2], cute.arch.grid_dim()[2]
        for item in range(whole_tiles(cluster, clusters, total, self.config.stream_k)):
            m, n, l = tile_coords(cluster + item * clusters, cm_tiles, cn_tiles, self.config.swizzle,
                                  self.cluster_mn, cluster_coord[0], cluster_coord[1])
            state = self.load_k_tiles(tma_a, tma_b, tAsA, tBsB, tAgA[(None, m, None, l)],
                                      tBgB[(None, n, None, l)], a_mask, b_mask, mainloop, state,
                                      0, k_tiles)
        if const_expr(self.config.epilogue_mma):
            # The last tile's epilogue runs a next first k-tile too: any valid one (unused).
            m0, n0, l0 = tile_coords(cluster, cm_tiles, cn_tiles, self.config.swizzle,
                                     self.cluster_mn, cluster_coord[0], cluster_coord[1])
            state = self.load_k_tiles(tma_a, tma_b, tAsA, tBsB, tAgA[(None, m0, None, l0)],
                                      tBgB[(None, n0, None, l0)], a_mask, b_mask, mainloop, state,
                                      0, 1)
        if const_expr(self.config.stream_k):
            for piece in range(2):
                t, k_first, k_end = tail_piece(piece, cluster, clusters, total, k_tiles)
                m, n, l = tile_coords(t, cm_tiles, cn_tiles, self.config.swizzle, self.cluster_mn,
                                      cluster_coord[0], cluster_coord[1])
                state = self.load_k_tiles(tma_a, tma_b, tAsA, tBsB, tAgA[(None, m, None, l)],
                                          tBgB[(None, n, None, l)], a_mask, b_mask, mainloop,
                                          state, k_first, k_end)
        if const_expr(self.PDL):
            cute.arch.griddepcontrol_launch_dependents()
        mainloop.producer_tail(state)

    @cute.jit
    def load_k_tiles(self, tma_a, tma_b, tAsA, tBsB, tAgA_tile, tBgB_tile, a_mask, b_mask,
                     mainloop, state, k_first, k_end):
        """TMA loads of k-tiles ``k_first .. k_end - 1`` of one tile; returns the advanced state."""
        for k in range(k_first, k_end):
            mainloop.producer_acquire(state)
            barrier = mainloop.producer_get_barrier(state)
            cute.copy(tma_a, tAgA_tile[(None, k)], tAsA[(None, state.index)],
                      tma_bar_ptr=barrier, mcast_mask=a_mask)
            cute.copy(tma_b, tBgB_tile[(None, k)], tBsB[(None, state.index)],
                      tma_bar_ptr=barrier, mcast_mask=b_mask)
            mainloop.producer_commit(state)
            state.advance()
        return state

    @cute.jit
    def mma_and_epilogue(self, tiled_mma, sA, sB, sD, gD, mD, tma_d, mC, mBias, vectors,
                         mWork, mFlags, alpha: Float32, beta: Float32, token, mainloop, k_tiles,
                         schedule, cluster_coord, rank, tidx, warp):
        """MMA warpgroups: wgmma over the k-tiles, then the epilogue, tile after tile.

        Cooperative: every MMA warpgroup works on every tile (64 or 128 rows each). Ping-pong:
        warpgroup w takes this CTA's tiles w, w + 2, ...; named barriers make the two take turns
        on the tensor cores, so one's epilogue runs under the other's mainloop. Each skips the
        other's k-tiles in its pipeline states. ``vectors``: (scale_a, scale_b, zero_a, sum_b),
        the epilogue's per-row / per-column operands (None where unused)."""
        cfg = self.config
        mScaleA, mScaleB = vectors[0], vectors[1]
        wg = cute.arch.make_warp_uniform(tidx // 128)
        # This warpgroup's block of tile rows (cooperative) and its A operand in every stage.
        row_block = 0 if const_expr(self.pingpong) else wg
        thr_mma = tiled_mma.get_slice(0)  # the warpgroup's operand descriptors
        tCrA = self.a_operand(tiled_mma, sA, sD, row_block, tidx % 128)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        wg_tile = cute.make_identity_tensor((self.wg_rows, cfg.tile_n))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(wg_tile).shape, self.acc_dtype)
        promote = const_expr(cfg.fp8_promote_every)
        split = const_expr(cfg.fp8_split_n)
        mma_acc = acc
        if const_expr(split):  # one column half
            half_tile = cute.make_identity_tensor((self.wg_rows, cfg.tile_n // 2))
            mma_acc = cute.make_rmem_tensor(thr_mma.partition_C(half_tile).shape, Float32)
        elif const_expr(promote > 0):
            mma_acc = cute.make_rmem_tensor(acc.shape, Float32)

        # Epilogue plumbing: accumulator -> registers of the output dtype -> smem -> TMA.
        store_atom = sm90_utils.sm90_get_smem_store_op(self.d_layout, elem_ty_d=self.d_dtype,
                                                       elem_ty_acc=self.acc_dtype)
        tiled_store = cute.make_tiled_copy_S(
            store_atom,
            cute.make_tiled_copy_C_atom(
                cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(self.d_layout.is_m_major_c(), 4), self.d_dtype),
                tiled_mma,
            ),
        )
        thr_store = tiled_store.get_slice(tidx % 128)
        tRS_sD = thr_store.partition_D(sD)
        tRS_acc = tiled_store.retile(acc)
        # (row, col) in the warpgroup's rows of each accumulator value this thread holds:
        # partitioned by the thread's own index (thr_mma is right for the operands only).
        coords = tiled_mma.get_slice(tidx % 128).partition_C(wg_tile)
        tRS_coords = tiled_store.retile(coords)
        frag_shape = cute.shape(thr_store.partition_S(sD))[:3]
        tRS_rD = cute.make_rmem_tensor(frag_shape, self.epi_dtype)
        tRS_rOut = cute.make_rmem_tensor(frag_shape, self.d_dtype)
        per_subtile = cute.size(tRS_rD)
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.config.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
        )
        # Warpgroup w: its first warp issues the TMA stores, its own epilogue barrier, buffers
        # from w * epi_stages.
        store_warp = 4 + 4 * wg
        epi_barrier = int(GemmBarrier.EPILOGUE) + wg
        buffer_base = wg * cfg.epi_stages

        # Per-tensor fp8 scales: one multiplier for every value, folded into alpha once.
        if const_expr(cfg.epilogue.scalar_scale_a):
            alpha = alpha * mScaleA[0]
        if const_expr(cfg.epilogue.scalar_scale_b):
            alpha = alpha * mScaleB[0]
        cm_tiles, cn_tiles, total = schedule
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        tiles_done = Int32(0)
        cluster, clusters = cute.arch.block_idx()[2], cute.arch.grid_dim()[2]
        stream_k = const_expr(self.config.stream_k)
        items = whole_tiles(cluster, clusters, total, stream_k)
        first_item, item_step = 0, 1
        if const_expr(self.pingpong):
            first_item, item_step = wg, 2
            if wg == 1:  # the CTA's first tile belongs to warpgroup 0
                for _ in range(k_tiles):
                    read.advance()
                    release.advance()
        overlap = const_expr(cfg.epilogue_mma)
        if const_expr(overlap):  # the first tile's first k-tile (later ones run in an epilogue)
            tiled_mma, read, release = self.mma_k_tiles(tiled_mma, acc, mma_acc, tCrA, tCrB,
                                                        mainloop, read, release, 0, 1, k_tiles)
        for item in range(first_item, items, item_step):
            m, n, l = tile_coords(cluster + item * clusters, cm_tiles, cn_tiles, cfg.swizzle,
                                  self.cluster_mn, cluster_coord[0], cluster_coord[1])
            if const_expr(self.pingpong):
                # Wait for the other warpgroup's previous mainloop.
                done = int(GemmBarrier.MAINLOOP_DONE)
                if wg == 0:
                    if tiles_done > 0:
                        cute.arch.barrier(barrier_id=done + 1, number_of_threads=256)
                else:
                    cute.arch.barrier(barrier_id=done, number_of_threads=256)
            # Ping-pong: the other warpgroup's turn (if it has a next tile) once this one has
            # issued its last MMAs, while they still run.
            hand_over = (int(GemmBarrier.MAINLOOP_DONE) + wg, item + 1 < items) if const_expr(self.pingpong) else None
            tiled_mma, read, release = self.mma_k_tiles(tiled_mma, acc, mma_acc, tCrA, tCrB,
                                                        mainloop, read, release,
                                                        1 if overlap else 0, k_tiles,
                                                        k_tiles, zero=not overlap,
                                                        hand_over=hand_over, nonempty=True)
            next_k_tile = (tiled_mma, mma_acc, tCrA, tCrB, mainloop, read, release) if overlap else None
            after = self.epilogue(acc, tRS_acc, tRS_coords, tRS_rD, tRS_rOut, tRS_sD, sD, gD, mD,
                                  tma_d, tiled_store, store_pipe, mC, mBias, vectors, alpha,
                                  beta, m, n, l, per_subtile, tiles_done, warp, store_warp,
                                  epi_barrier, buffer_base, row_block, next_k_tile)
            if const_expr(overlap):
                tiled_mma, read, release = after
            tiles_done += 1
            if const_expr(self.pingpong):
                for _ in range(k_tiles):  # the other warpgroup's tile
                    read.advance()
                    release.advance()
        if const_expr(stream_k):
            for piece in range(2):
                t, k_first, k_end = tail_piece(piece, cluster, clusters, total, k_tiles)
                m, n, l = tile_coords(t, cm_tiles, cn_tiles, cfg.swizzle, self.cluster_mn,
                                      cluster_coord[0], cluster_coord[1])
                tiled_mma, read, release = self.mma_k_tiles(tiled_mma, acc, mma_acc, tCrA, tCrB,
                                                            mainloop, read, release, k_first,
                                                            k_end, k_tiles)
                if k_end > k_first:
                    if k_end < k_tiles:  # not the tile's end: hand the partial sum to its owner
                        self.store_partial(acc, mWork, mFlags, token, cluster, rank, tidx)
                    else:
                        if k_first > 0:
                            self.add_partials(acc, mWork, mFlags, token, cluster, clusters, rank,
                                              tidx, total - total % clusters, t, k_tiles,
                                              (total % clusters) * k_tiles)
                        self.epilogue(acc, tRS_acc, tRS_coords, tRS_rD, tRS_rOut, tRS_sD, sD, gD,
                                      mD, tma_d, tiled_store, store_pipe, mC, mBias, vectors,
                                      alpha, beta, m, n, l, per_subtile, tiles_done,
                                      warp, store_warp, epi_barrier, buffer_base, row_block)
                        tiles_done += 1
        store_pipe.producer_tail()

    def a_operand(self, tiled_mma, sA, sD, row_block, tidx):
        """The warpgroup's A operand in every stage: MMA descriptors of its block of rows
        (``tidx``: the thread's index in its warpgroup, and ``sD``, the epilogue's buffers, for
        a subclass that reads A itself and exchanges partial sums between its warpgroups)."""
        sA_rows = sA
        if const_expr(self.tile_wgs > 1):
            sA_rows = cute.local_tile(sA, (self.wg_rows, self.tile_mnk[2], self.ab_stages), (row_block, 0, 0))
        return tiled_mma.make_fragment_A(tiled_mma.get_slice(0).partition_A(sA_rows))

    @cute.jit
    def mma_k_tiles(self, tiled_mma, acc, mma_acc, tCrA, tCrB, mainloop, read, release, k_first,
                    k_end, k_tiles, zero: cutlass.Constexpr = True, hand_over=None,
                    nonempty: cutlass.Constexpr = False):
        """``acc`` <- the MMAs over k-tiles ``k_first .. k_end - 1`` of one tile (zero when the
        range is empty; with ``zero=False`` added to ``acc``; ``nonempty``: the caller
        guarantees at least one k-tile). ``hand_over`` = (named barrier, condition), ping-pong
        only (never with ``fp8_split_n``): arrive on it once the last MMAs are issued, before
        waiting for them (if the condition holds). Returns the MMA (its accumulate flag changes
        here) and the advanced pipeline states, so that the caller's loops carry them."""
        promote = const_expr(self.config.fp8_promote_every)
        # Without a fold, and where the caller knows the range is not empty, the first MMA
        # overwrites the accumulator instead of a fill on the way to the tensor cores.
        first_overwrites = const_expr(zero and nonempty and promote == 0 and not self.config.fp8_split_n)
        if const_expr(zero and not first_overwrites):
            acc.fill(0 if const_expr(self.acc_dtype is Int32) else 0.0)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.fence()
        if const_expr(self.config.fp8_split_n):
            # Per k-tile and column half: the MMAs into the half's tensor-core accumulator
            # (the first overwrites it), a wait for them, a fold into the fp32 accumulator.
            for k in range(k_first, k_end):
                mainloop.consumer_wait(read)
                for h in cutlass.range_constexpr(2):
                    tiled_mma = self.issue_fold_mmas(tiled_mma, mma_acc, tCrA, tCrB, read.index, h)
                    cute.nvgpu.warpgroup.wait_group(0)
                    acc_h = acc[(None, 0, h)]
                    self.fold(acc_h, mma_acc[(None, 0, 0)])
                    cute.nvgpu.warpgroup.fence()
                mainloop.consumer_release(release)
                release.advance()
                read.advance()
        else:
            k_blocks = cute.size(tCrA, mode=[2])
            # One wgmma batch stays in flight; a stage is released once the batch after it has
            # been issued. fp8 folds the MMA accumulator into the fp32 one after every window of
            # ``promote`` k-tiles (one window without fp8).
            window = promote if const_expr(promote > 0) else k_tiles
            for k0 in range(k_first, k_end, window):
                for k in range(k0, cutlass.min(k0 + window, k_end)):
                    mainloop.consumer_wait(read)
                    for kb in cutlass.range_constexpr(k_blocks):
                        if const_expr(promote > 0):  # the window's first MMA overwrites
                            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True if kb > 0 else k > k0)
                        elif const_expr(first_overwrites and kb < 2):
                            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True if kb > 0 else k > k_first)
                        cute.gemm(tiled_mma, mma_acc, *self.stage_operands(tCrA, tCrB, kb, read.index),
                                  mma_acc)
                    cute.nvgpu.warpgroup.commit_group()
                    cute.nvgpu.warpgroup.wait_group(1)
                    if k > k_first:
                        mainloop.consumer_release(release)
                        release.advance()
                    read.advance()
                if const_expr(promote > 0):
                    cute.nvgpu.warpgroup.wait_group(0)
                    self.fold(acc, mma_acc)
                    cute.nvgpu.warpgroup.fence()
            if const_expr(hand_over is not None):
                if hand_over[1]:
                    cute.arch.barrier_arrive(barrier_id=hand_over[0], number_of_threads=256)
            cute.nvgpu.warpgroup.wait_group(0)
            if k_end > k_first:
                mainloop.consumer_release(release)
                release.advance()
        return tiled_mma, read, release

    def stage_operands(self, tCrA, tCrB, kb, stage):
        """The MMA operands of k-block ``kb`` of shared-memory stage ``stage``: the stage's A and
        B descriptors as loaded. The step between a stage and its MMAs -- a subclass whose
        operands arrive encoded (packed 4-bit weights) decodes them here."""
        return tCrA[(None, None, kb, stage)], tCrB[(None, None, kb, stage)]

    def fold(self, acc, mma_acc):
        """``acc += mma_acc``: the MMA accumulator folded into the epilogue's accumulator (fp8
        promotion; a subclass with per-block scales along K applies them here)."""
        acc.store(acc.load() + mma_acc.load())

    @cute.jit
    def issue_fold_mmas(self, tiled_mma, mma_acc, tCrA, tCrB, stage, half: cutlass.Constexpr):
        """fp8 with a fold every k-tile: the MMAs of one k-tile in shared-memory stage ``stage``
        into ``mma_acc`` (the first overwrites it), committed as one group; with
        ``fp8_split_n`` only column half ``half``. Returns the MMA (its accumulate flag changes)."""
        for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, kb > 0)
            a, b = self.stage_operands(tCrA, tCrB, kb, stage)
            if const_expr(self.config.fp8_split_n):
                b = cute.logical_divide(tCrB, (None, 1))[(None, (None, half), kb, stage)]
            cute.gemm(tiled_mma, mma_acc, a, b, mma_acc)
        cute.nvgpu.warpgroup.commit_group()
        return tiled_mma

    @cute.jit
    def store_partial(self, acc, mWork, mFlags, token, cluster, rank, tidx):
        """Stream-K: this CTA's fp32 partial sum into its workspace slot (value-major, so a warp
        writes 128 contiguous bytes per value), then its flag set to ``token`` (release)."""
        threads = 128 * self.num_mma_wg
        size = cute.size(acc)
        slot = cluster * (self.config.cluster_m * self.config.cluster_n) + rank
        base = slot * (threads * size)
        for v in cutlass.range(size, unroll_full=True):
            mWork[base + v * threads + tidx] = acc[v]
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=int(GemmBarrier.STREAM_K), number_of_threads=threads)
        if tidx == 0:
            cute.arch.store(mFlags.iterator + slot, token, sem="release", scope="gpu")

    @cute.jit
    def add_partials(self, acc, mWork, mFlags, token, cluster, clusters, rank, tidx, whole,
                     t, k_tiles, units):
        """Stream-K, the owner of tail tile ``t`` (its end piece): for each earlier cluster whose
        run reaches into the tile, wait for its flag and clear it (compare-and-swap token -> 0,
        acquire), then add its partial sum to ``acc``."""
        threads = 128 * self.num_mma_wg
        size = cute.size(acc)
        tile_start = (t - whole) * k_tiles
        other = cluster - 1
        more = other >= 0
        while more:  # the runs of earlier clusters that end inside the tile
            first, end = sk_run(other, clusters, units)
            if end > tile_start:
                if end > first:
                    slot = other * (self.config.cluster_m * self.config.cluster_n) + rank
                    flag = mFlags.iterator + slot
                    if tidx == 0:  # swap the token for 0 once it is there (acquire)
                        seen = cute.arch.atomic_cas(flag, cmp=token, val=cutlass.Int64(0),
                                                    sem="acquire", scope="gpu")
                        while seen != token:
                            seen = cute.arch.atomic_cas(flag, cmp=token, val=cutlass.Int64(0),
                                                        sem="acquire", scope="gpu")
                    cute.arch.barrier(barrier_id=int(GemmBarrier.STREAM_K), number_of_threads=threads)
                    cute.arch.fence_acq_rel_gpu()
                    base = slot * (threads * size)
                    for v in cutlass.range(size, unroll_full=True):
                        acc[v] = acc[v] + mWork[base + v * threads + tidx]
                other -= 1
                more = other >= 0
            else:
                more = False

    @cute.jit
    def epilogue(self, acc, tRS_acc, tRS_coords, tRS_rD, tRS_rOut, tRS_sD, sD, gD, mD, tma_d,
                 tiled_store, store_pipe, mC, mBias, vectors, alpha: Float32,
                 beta: Float32, m, n, l, per_subtile, tiles_done, warp, store_warp, epi_barrier,
                 buffer_base, row_block, next_k_tile=None):
        """The tile's output from ``acc``, sub-tile by sub-tile. With ``next_k_tile`` = (MMA,
        MMA accumulator, A and B fragments, mainloop, read and release states) it also runs the
        next tile's first k-tile (fp8, a fold every k-tile, ``epilogue_mma``): its MMAs go to the
        tensor cores while the sub-tiles are stored and become ``acc`` at the end. From the first
        sub-tile on into the MMA accumulator; with ``fp8_split_n`` from the middle one, once the
        sub-tiles before it have read column half 0 of ``acc``: that half's MMAs straight into
        it (a tile's first k-tile needs no fold), half 1's into the MMA accumulator. Returns the
        MMA and the advanced states then."""
        cfg, epi = self.config, self.config.epilogue
        mScaleA, mScaleB, mZeroA, mSumB = vectors
        halves = 2 if const_expr(cfg.fp8_split_n) else 1
        gD_tile = gD[(None, None, m, n, l)]
        if const_expr(self.tile_wgs > 1):  # this warpgroup's rows of the cooperative tile
            gD_tile = cute.local_tile(gD_tile, (self.wg_rows, cfg.tile_n), (row_block, 0))
        gD_sub = cute.zipped_divide(gD_tile, self.epi_tile)
        sD_part, gD_part = cute.nvgpu.cpasync.tma_partition(
            tma_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), gD_sub
        )
        subtiles = cute.size(gD_sub, mode=[1])
        if const_expr(next_k_tile is not None):
            tiled_mma, mma_acc, tCrA, tCrB, mainloop, read, release = next_k_tile
            issue_at = 0
            if const_expr(halves == 2):
                issue_at = subtiles // 2
                _check_first_half_read_first(acc, tRS_acc, issue_at * per_subtile)
                acc_half0 = cute.make_tensor(acc[(None, 0, 0)].iterator, mma_acc.layout)
        sub_layout = cute.make_layout(gD_sub.shape[1], stride=(gD_sub.shape[1][1], 1))
        row0, col0 = m * cfg.tile_m + row_block * self.wg_rows, n * cfg.tile_n
        rows, cols = mD.shape[0], mD.shape[1]
        row_scales = {}  # this thread's per-row scales of the tile, by row offset: read once
        row_zeros = {}  # likewise its per-row zero points
        for s in cutlass.range_constexpr(subtiles):
            if const_expr(next_k_tile is not None and s == issue_at):
                mainloop.consumer_wait(read)
                if const_expr(halves == 2):
                    cute.nvgpu.warpgroup.fence()  # acc half 0 was read since the last fence
                    tiled_mma = self.issue_fold_mmas(tiled_mma, acc_half0, tCrA, tCrB, read.index, 0)
                    tiled_mma = self.issue_fold_mmas(tiled_mma, mma_acc, tCrA, tCrB, read.index, 1)
                else:
                    tiled_mma = self.issue_fold_mmas(tiled_mma, mma_acc, tCrA, tCrB, read.index, 0)
            self.accumulator_values(tRS_rD, tRS_acc, tRS_coords, s * per_subtile, row_zeros,
                                    mZeroA, mSumB, row0, col0, rows, cols)
            if const_expr(epi.bias or epi.residual or epi.row_scale or epi.col_scale):
                self._apply_operands(tRS_rD, tRS_coords, s * per_subtile, row_scales, mC, mBias,
                                     mScaleA, mScaleB, alpha, beta, row0, col0, rows, cols, l)
                x = tRS_rD.load()
            elif const_expr(epi.multiplies):
                x = tRS_rD.load() * alpha
            else:
                x = tRS_rD.load()
            tRS_rOut.store(_activation(x, epi.activation).to(self.d_dtype))
            buffer = buffer_base + (tiles_done * subtiles + s) % self.config.epi_stages
            cute.copy(tiled_store, tRS_rOut, tRS_sD[(None, None, None, buffer)])
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=epi_barrier, number_of_threads=128)
            if warp == store_warp:
                cute.copy(tma_d, sD_part[(None, buffer)], gD_part[(None, sub_layout.get_hier_coord(s))])
                store_pipe.producer_commit()
                store_pipe.producer_acquire()
            cute.arch.barrier(barrier_id=epi_barrier, number_of_threads=128)
        if const_expr(next_k_tile is not None):
            cute.nvgpu.warpgroup.wait_group(0)
            if const_expr(halves == 2):
                acc[(None, 0, 1)].store(mma_acc[(None, 0, 0)].load())
            else:
                acc.store(mma_acc.load())
            cute.nvgpu.warpgroup.fence()
            mainloop.consumer_release(release)
            release.advance()
            read.advance()
            return tiled_mma, read, release

    def accumulator_values(self, frag, tRS_acc, coords, offset, row_zeros, mZeroA, mSumB, row0,
                           col0, rows, cols):
        """``frag`` (the epilogue's working dtype) <- the accumulator's values ``offset ..``
        of the store view. Integer accumulators: with ``Epilogue.zero_point`` first
        ``acc - zero_a[row] * sum_b[col]`` in exact int32 arithmetic (A's zero points against
        B's column sums; per-row zero points kept in ``row_zeros`` for the tile), then
        converted where the epilogue works in fp32. Traced once per sub-tile, like
        ``_apply_operands``."""
        size = cute.size(frag)
        zero_point = self.config.epilogue.zero_point
        if self.acc_dtype is self.epi_dtype and not zero_point:
            for v in range(size):
                frag[v] = tRS_acc[offset + v]
            return
        values = cute.make_rmem_tensor(frag.layout, self.acc_dtype)
        for v in range(size):
            values[v] = tRS_acc[offset + v]
        if zero_point:
            base_r, base_c = coords.iterator
            col_sums = {}
            for v in range(size):
                r, c = coords.layout(offset + v)
                if r not in row_zeros:
                    row_zeros[r] = _load_int_or_zero(mZeroA, row0 + base_r + r, rows)
                if c not in col_sums:
                    col_sums[c] = _load_int_or_zero(mSumB, col0 + base_c + c, cols)
                values[v] = values[v] - row_zeros[r] * col_sums[c]
        frag.store(values.load().to(self.epi_dtype))

    def _apply_operands(self, frag, coords, offset, row_scales, mC, mBias, mScaleA, mScaleB,
                        alpha: Float32, beta: Float32, row0, col0, rows, cols, l):
        """frag[v] <- alpha * frag[v] * scale_a[row] * scale_b[col] + beta * C[row, col] + bias[col],
        element by element at each value's (row, col); operands outside D read as 0.

        Traced once per sub-tile: each value's (row, col) is the thread's base coordinate plus a
        static offset, so values that share a row or column share one load (per-row scales are
        kept in ``row_scales`` for the whole tile, per-column operands for the sub-tile)."""
        epi = self.config.epilogue
        base_r, base_c = coords.iterator
        col_operands = {}
        for v in range(cute.size(frag)):
            r, c = coords.layout(offset + v)
            row, col = row0 + base_r + r, col0 + base_c + c
            x = frag[v] * alpha if const_expr(epi.multiplies) else frag[v]
            if const_expr(epi.row_scale):
                if r not in row_scales:
                    row_scales[r] = _load_or(mScaleA, (row,), row < rows, 0.0)
                x = x * row_scales[r]
            if const_expr(epi.col_scale or epi.bias):
                if c not in col_operands:
                    col_operands[c] = (
                        _load_or(mScaleB, (col,), col < cols, 0.0) if const_expr(epi.col_scale) else None,
                        _load_or(mBias, (col,), col < cols, 0.0) if const_expr(epi.bias) else None,
                    )
                scale_b, bias = col_operands[c]
            if const_expr(epi.col_scale):
                x = x * scale_b
            if const_expr(epi.residual):
                x = x + beta * _load_or(mC, (row, col, l), _inside(row, rows, col, cols), 0.0)
            if const_expr(epi.bias):
                x = x + bias
            frag[v] = x


def _check_first_half_read_first(acc, tRS_acc, values: int) -> None:
    """Trace time: the first ``values`` values of the store view are column half 0 of ``acc``."""
    read_first = {tRS_acc.layout(i) for i in range(values)}
    half0 = {acc.layout((v, 0, 0)) for v in range(cute.size(acc) // 2)}
    if read_first != half0:
        raise ValueError(f"the epilogue's first {values} values are not column half 0 of the "
                         f"accumulator {acc.layout} (store view {tRS_acc.layout})")


@cute.jit
def _inside(row, rows, col, cols):
    return row < rows and col < cols


@cute.jit
def _load_int_or_zero(vector: cute.Tensor, index, size) -> Int32:
    value = Int32(0)
    if index < size:
        value = vector[index]
    return value


@cute.jit
def _load_or(tensor: cute.Tensor, coord, ok, default: cutlass.Constexpr) -> Float32:
    value = Float32(default)
    if ok:
        value = tensor[coord].to(Float32)
    return value


def _activation(x, name):
    """relu / gelu (tanh approximation) / silu on an fp32 TensorSSA."""
    if name is None:
        return x
    if name == "relu":
        return cute.where(x > 0.0, x, cute.full_like(x, 0.0))
    if name == "gelu_tanh":
        inner = x * (0.7978845608028654 + 0.035677408136300125 * x * x)
        return 0.5 * x * (1.0 + cute.math.tanh(inner, fastmath=True))
    if name == "silu":
        return x / (1.0 + cute.math.exp2(x * -1.4426950408889634, fastmath=True))
    raise ValueError(f"unknown activation {name!r}")
