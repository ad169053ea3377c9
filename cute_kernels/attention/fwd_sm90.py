"""FlashAttention-2 forward for Hopper (sm_90a): O = softmax(Q K^T * scale) V, and the LSE.

Design:
  - One CTA per query tile (tile_m rows of one head of one sequence); the key / value blocks
    of tile_n rows it may see are walked from the last to the first, never an S x S matrix in
    memory.
  - Warp specialization: warpgroup 0 is the producer (one warp issues TMA: Q once, then K and V
    blocks through their own ``stages``-deep mbarrier pipelines; 24-32 registers with
    setmaxnreg); tile_m / 64 MMA warpgroups (240 or 160 registers) each own 64 query rows.
  - Per key block, inside a warpgroup: S = Q K_j^T (wgmma, both operands in shared memory), the
    online softmax in exp2 with scale * log2(e) folded into one FFMA (``softmax.py``), P
    converted to 16 bits in registers and fed to O += P V_j as the register A operand. The
    GEMMs of one block overlap the softmax of the next: S_{j+1} and P_j V_j are issued
    together, the softmax of S_{j+1} runs while P_j V_j is on the tensor cores. For head dims up
    to 128 the warpgroups also take turns issuing their GEMMs through named barriers
    (ping-pong), so one's softmax runs under the other's GEMMs. For larger heads, and at head
    dim 128 with one CTA per tile, O is rescaled before the P V GEMM is issued, under the S
    GEMM; elsewhere after P V, at the end of the block.
  - Masks (``mask.py``): only the first block visited (the key tail) and, with ``local``, the
    blocks that the diagonal or the window's left edge crosses are masked; blocks outside every
    row's window are never loaded.
  - Tile order: the 1-D grid walks groups of ``l2_group`` (batch, head) pairs, query tiles from
    the last (the longest with a causal mask) to the first within a group, the pairs of a group
    interleaved. The launcher passes 1 without a mask (consecutive CTAs are consecutive tiles of
    one pair, reading the same K / V blocks together) and, with one, as many pairs as have K and
    V fit in L2. Varlen: a (query tile, head, sequence) grid, tiles past a sequence's end exit
    at once. Persistent CTAs with a mask (fixed lengths) take the tiles by a static stride of
    the grid, so tiles of the same length would fall to the same CTAs (a 1.15x longer
    schedule than the SMs' even share at 1024 keys, by simulation): they take a pair's
    j-th longest and j-th shortest query tiles in two consecutive rounds
    (``schedule.paired_rank``), every CTA's two tiles together as long as any other's.
  - Persistent CTAs (``config.persistent``, where shared memory holds a separate O buffer): one
    CTA per SM walks the tiles; the MMA warpgroups release Q after their last S GEMM of a tile,
    so the producer loads the next tile's Q and first K / V blocks under the last P V GEMM and
    the epilogue. Otherwise one CTA per tile, and O is staged over Q's buffer.
  - Epilogue: O / row sum in 16 bits, written to shared memory over Q's buffer (stmatrix), then
    TMA-stored by one warp (batch layout) or copied out in 16-byte vectors with the rows past
    the sequence left alone (varlen). LSE (fp32, natural log; -inf for a row that sees no key)
    is always written: the backward needs it.

Tensors arrive in torch order: Q and O (B, Sq, Hq, D), K and V (B, Sk, Hkv, D), LSE (B, Hq, Sq);
varlen: (total, H, D) and LSE (Hq, total_q) with int32 ``cu_seqlens`` of B + 1 offsets.

Constraints:
  - bf16 or fp16 Q, K, V, O (all one dtype); fp32 LSE
  - head dim 64, 96, 128, 192 or 256, the same for Q, K and V; tile_m 128 or 192
  - the head dim contiguous; every other stride a multiple of 8 elements (16 bytes, for TMA);
    16-byte aligned data pointers
  - Hq a multiple of Hkv (query head h reads key / value head h // (Hq / Hkv))
  - ``window_left`` / ``window_right`` non-negative; unbounded is any value >= Sq + Sk
  - sequence lengths < 2^31 / tile rows; an empty key range gives O = 0 and LSE = -inf
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.memory
import cutlass.tensor_utils as tensor_utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from ..primitives.named_barriers import AttentionBarrier
from .config import AttentionFwdConfig
from .fragments import as_operand_a, convert_pairs, rows_cols, warpgroup_gemm
from .mask import Sequence, TileMask
from .schedule import grouped_rank, paired_rank, paired_slots
from .softmax import OnlineSoftmax, scale_rows

LOG2_E = math.log2(math.e)
# (producer, MMA warpgroup) registers per thread by MMA warpgroup count: 65536 in total.
REGISTERS = {2: (24, 240), 3: (32, 160)}


def _select(t: cute.Tensor, modes) -> cute.Tensor:
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


class FlashAttnFwdSm90:
    """See the module docstring. ``__init__`` takes only the compile-time configuration."""

    def __init__(self, config: AttentionFwdConfig):
        if config.tile_m not in (128, 192) or config.tile_n % 16 or config.tile_n > 256:
            raise ValueError(f"tile {config.tile_m} x {config.tile_n} is not supported: {config}")
        self.config = config
        self.tile_m, self.tile_n, self.head_dim = config.tile_m, config.tile_n, config.head_dim
        self.mma_wgs = config.mma_warpgroups
        self.mma_threads = 128 * self.mma_wgs
        self.producer_regs, self.mma_regs = REGISTERS[self.mma_wgs]
        # Warpgroups take turns issuing GEMMs where the softmax is long next to the GEMMs.
        self.pingpong = config.head_dim <= 128
        # O rescaled while the S GEMM runs, before P V is issued (otherwise after P V, at the end
        # of the block): large heads, and head dim 128 with one CTA per tile. Measured on H100
        # (bf16, 16k tokens, two runs, early / late): hdim 128 causal +1-2% at 2048, +2-3% at
        # 4096, +5% at 16384, unmasked 16384 +3%; but persistent CTAs lost 2-3% (hdim 128
        # unmasked at 1024 / 4096) and hdim 64 lost 1-3% either way.
        self.rescale_early = config.head_dim > 128 or (config.head_dim == 128 and not config.persistent)

    # ------------------------------------------------------------------ host side

    def _smem(self, rows: int, stages: int | None = None):
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(tensor_utils.LayoutEnum.ROW_MAJOR, self.dtype, self.head_dim),
            self.dtype,
        )
        shape = (rows, self.head_dim) if stages is None else (rows, self.head_dim, stages)
        return cute.tile_to_shape(atom, shape, order=(0, 1) if stages is None else (0, 1, 2))

    @cute.jit
    def __call__(self, mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, scale_log2: Float32,
                 softcap_prescale: Float32, window_left: Int32, window_right: Int32,
                 max_seqlen_q: Int32, l2_group: Int32, max_ctas: Int32, stream):
        cfg = self.config
        self.dtype = mQ.element_type
        varlen = const_expr(cfg.varlen)
        # (rows, D, H[, B]) views: rows and the head dim lead, as the TMA boxes want.
        qo_modes = [0, 2, 1] if varlen else [1, 3, 2, 0]
        q, o = _select(mQ, qo_modes), _select(mO, qo_modes)
        k, v = _select(mK, qo_modes), _select(mV, qo_modes)
        lse = _select(mLSE, [1, 0] if varlen else [2, 1, 0])  # (rows, H[, B])

        self.tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            Float32, (1, 1, 1), tiler_mn=(64, self.tile_n),
        )
        self.tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            Float32, (1, 1, 1), tiler_mn=(64, self.head_dim), a_source=warpgroup.OperandSource.RMEM,
        )
        self.sQ_layout = self._smem(self.tile_m)
        self.sK_layout = self._smem(self.tile_n, cfg.stages)
        self.sV_layout = self._smem(self.tile_n, cfg.stages)
        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_tensor_q = cpasync.make_tiled_tma_atom(load_op, q, self.sQ_layout, (self.tile_m, self.head_dim))
        tma_k, tma_tensor_k = cpasync.make_tiled_tma_atom(
            load_op, k, cute.slice_(self.sK_layout, (None, None, 0)), (self.tile_n, self.head_dim))
        tma_v, tma_tensor_v = cpasync.make_tiled_tma_atom(
            load_op, v, cute.slice_(self.sV_layout, (None, None, 0)), (self.tile_n, self.head_dim))
        tma_o, out = None, o
        if const_expr(not varlen):
            tma_o, out = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), o, self.sQ_layout, (self.tile_m, self.head_dim))
        self.q_bytes = cute.size_in_bytes(self.dtype, self.sQ_layout)
        self.kv_bytes = cute.size_in_bytes(self.dtype, cute.slice_(self.sK_layout, (None, None, 0)))

        o_cosize = cute.cosize(self.sQ_layout) if const_expr(cfg.persistent) else 0

        @cute.struct
        class Storage:
            bar_q: cute.struct.MemRange[cutlass.Int64, 2]
            bar_k: cute.struct.MemRange[cutlass.Int64, cfg.stages * 2]
            bar_v: cute.struct.MemRange[cutlass.Int64, cfg.stages * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.sV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, o_cosize], 1024]

        self.storage = Storage
        m_blocks = cute.ceil_div(max_seqlen_q, self.tile_m)
        heads = q.shape[2]
        batches = mCuSeqlensQ.shape[0] - 1 if const_expr(varlen) else q.shape[3]
        tiles = m_blocks * heads * batches
        grid = (cutlass.min(tiles, max_ctas), 1, 1)
        self.kernel(
            tma_q, tma_tensor_q, tma_k, tma_tensor_k, tma_v, tma_tensor_v, tma_o, out, lse,
            mCuSeqlensQ, mCuSeqlensK, q.shape[0], k.shape[0], heads, k.shape[2], scale_log2,
            softcap_prescale, window_left, window_right, m_blocks, batches, l2_group,
            self.sQ_layout, self.sK_layout, self.sV_layout, self.tiled_mma_qk, self.tiled_mma_pv,
        ).launch(grid=grid, block=[self.config.threads, 1, 1], min_blocks_per_mp=1, stream=stream)

    # ------------------------------------------------------------------ device side

    def paired(self) -> bool:
        """Persistent CTAs with a mask take a pair's query tiles two at a time, the j-th longest
        and the j-th shortest (module docstring: tile order)."""
        cfg = self.config
        return const_expr(cfg.persistent and cfg.local and not cfg.varlen)

    @cute.jit
    def tile_slots(self, schedule):
        """Linear tile indices the CTAs walk (every grid-size-th from their block index on):
        the tiles, or with ``paired`` the slots of ``schedule.paired_slots``."""
        m_blocks, heads, batches, _ = schedule
        slots = m_blocks * heads * batches
        if const_expr(self.paired()):
            slots = paired_slots(cute.arch.grid_dim()[0], m_blocks, heads * batches)
        return slots

    @cute.jit
    def tile_coords(self, tile, m_blocks, heads, batches, l2_group):
        """(m_block, head, batch) of linear tile index ``tile`` (module docstring: tile order);
        an empty slot gets m_block = m_blocks (past every sequence)."""
        if const_expr(self.paired()):
            m_rank, head, batch = paired_rank(tile, cute.arch.grid_dim()[0], m_blocks, heads,
                                              batches, l2_group)
        else:
            m_rank, head, batch = grouped_rank(tile, m_blocks, heads, batches, l2_group)
        m_block = cutlass.select_(m_rank == m_blocks, m_blocks, m_blocks - 1 - m_rank)
        return m_block, head, batch

    @cute.kernel
    def kernel(self, tma_q, mQ, tma_k, mK, tma_v, mV, tma_o, mO, mLSE, mCuSeqlensQ, mCuSeqlensK,
               seqlen_q_static: Int32, seqlen_k_static: Int32, heads: Int32, heads_kv: Int32,
               scale_log2: Float32, softcap_prescale: Float32, window_left: Int32,
               window_right: Int32, m_blocks: Int32, batches: Int32, l2_group: Int32,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, tiled_mma_qk: cute.TiledMma,
               tiled_mma_pv: cute.TiledMma):
        cfg = self.config
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            if const_expr(tma_o is not None):
                cpasync.prefetch_descriptor(tma_o)
        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        # Every warp of every MMA warpgroup releases a stage.
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_wgs * 4)
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bar_q.data_ptr(), num_stages=1, producer_group=producer,
            consumer_group=consumers, tx_count=self.q_bytes, defer_sync=True)
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bar_k.data_ptr(), num_stages=cfg.stages, producer_group=producer,
            consumer_group=consumers, tx_count=self.kv_bytes, defer_sync=True)
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bar_v.data_ptr(), num_stages=cfg.stages, producer_group=producer,
            consumer_group=consumers, tx_count=self.kv_bytes, defer_sync=True)
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)

        sO = sQ  # O is staged over Q's buffer, unless the CTA goes on to another tile
        if const_expr(cfg.persistent):
            sO = storage.sO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        schedule = (m_blocks, heads, batches, l2_group)
        pipeline_init_wait(cluster_shape_mn=(1, 1))

        if tidx < 128:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp == 0:
                self.load(tma_q, tma_k, tma_v, mQ, mK, mV, sQ, sK, sV, pipe_q, pipe_k, pipe_v,
                          schedule, seqlen_q_static, seqlen_k_static, mCuSeqlensQ, mCuSeqlensK,
                          heads_kv, window_left, window_right)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self.mma(tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, sO, tma_o, mO, mLSE, pipe_q, pipe_k,
                     pipe_v, schedule, seqlen_q_static, seqlen_k_static, mCuSeqlensQ, mCuSeqlensK,
                     window_left, window_right, scale_log2, softcap_prescale, tidx - 128)

    def _tile(self, tile, schedule, seqlen_q_static, seqlen_k_static, cu_q, cu_k, window_left,
              window_right):
        """(m_block, head, batch, sequence bounds, masks) of linear tile index ``tile``."""
        m_block, head, batch = self.tile_coords(tile, *schedule)
        seq = Sequence(batch, seqlen_q_static, seqlen_k_static, cu_q, cu_k)
        mask = TileMask(self.tile_m, self.tile_n, self.config.local, seq, m_block, window_left,
                        window_right)
        return m_block, head, batch, seq, mask

    def _rows(self, t: cute.Tensor, offset, head, batch) -> cute.Tensor:
        """One head's (rows, D) of a (rows, D, H[, B]) tensor, from this sequence's first row."""
        if const_expr(self.config.varlen):
            return cute.domain_offset((offset, 0), t[None, None, head])
        return t[None, None, head, batch]

    @cute.jit
    def load(self, tma_q, tma_k, tma_v, mQ, mK, mV, sQ, sK, sV, pipe_q, pipe_k, pipe_v, schedule,
             seqlen_q_static, seqlen_k_static, cu_q, cu_k, heads_kv, window_left, window_right):
        """Producer warp, tile after tile: Q once, then K and V blocks from the last to the first
        (K one block ahead of V, the order in which the MMA warpgroups use them). A persistent
        CTA loads the next tile's Q and first blocks while the MMA warpgroups finish the last."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.config.stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        for tile in range(cute.arch.block_idx()[0], self.tile_slots(schedule), cute.arch.grid_dim()[0]):
            state, q_state = self.load_tile(
                tile, tma_q, tma_k, tma_v, mQ, mK, mV, sQ, sK, sV, pipe_q, pipe_k, pipe_v, schedule,
                seqlen_q_static, seqlen_k_static, cu_q, cu_k, heads_kv, window_left, window_right,
                state, q_state)

    @cute.jit
    def load_tile(self, tile, tma_q, tma_k, tma_v, mQ, mK, mV, sQ, sK, sV, pipe_q, pipe_k, pipe_v,
                  schedule, seqlen_q_static, seqlen_k_static, cu_q, cu_k, heads_kv, window_left,
                  window_right, state, q_state):
        """The loads of one tile; returns the advanced pipeline states."""
        m_block, head, batch, seq, mask = self._tile(tile, schedule, seqlen_q_static,
                                                     seqlen_k_static, cu_q, cu_k, window_left,
                                                     window_right)
        if m_block * self.tile_m < seq.seqlen_q:  # varlen: tiles past the sequence are skipped
            state, q_state = self.load_tile_blocks(
                tma_q, tma_k, tma_v, mQ, mK, mV, sQ, sK, sV, pipe_q, pipe_k, pipe_v, m_block,
                head, head // (schedule[1] // heads_kv), batch, seq, mask, state, q_state)
        return state, q_state

    @cute.jit
    def load_tile_blocks(self, tma_q, tma_k, tma_v, mQ, mK, mV, sQ, sK, sV, pipe_q, pipe_k, pipe_v,
                         m_block, head, head_kv, batch, seq, mask, state, q_state):
        """TMA loads of one tile inside its sequence: Q, then K and V blocks."""
        one = cute.make_layout(1)
        gQ = cute.local_tile(self._rows(mQ, seq.offset_q, head, batch), (self.tile_m, self.head_dim), (m_block, 0))
        gK = cute.local_tile(self._rows(mK, seq.offset_k, head_kv, batch), (self.tile_n, self.head_dim), (None, 0))
        gV = cute.local_tile(self._rows(mV, seq.offset_k, head_kv, batch), (self.tile_n, self.head_dim), (None, 0))
        tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        tKsK, tKgK = cpasync.tma_partition(tma_k, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_v, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        n_min, n_max = mask.block_range()
        n = n_max - 1
        pipe_k.producer_acquire(state)
        cute.copy(tma_k, tKgK[None, n], tKsK[None, state.index], tma_bar_ptr=pipe_k.producer_get_barrier(state))
        pipe_q.producer_acquire(q_state)
        cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        q_state.advance()
        for _ in range(n - n_min):
            v_state = state.clone()
            state.advance()
            pipe_k.producer_acquire(state)
            cute.copy(tma_k, tKgK[None, n - 1], tKsK[None, state.index],
                      tma_bar_ptr=pipe_k.producer_get_barrier(state))
            pipe_v.producer_acquire(v_state)
            cute.copy(tma_v, tVgV[None, n], tVsV[None, v_state.index],
                      tma_bar_ptr=pipe_v.producer_get_barrier(v_state))
            n -= 1
        pipe_v.producer_acquire(state)
        cute.copy(tma_v, tVgV[None, n], tVsV[None, state.index], tma_bar_ptr=pipe_v.producer_get_barrier(state))
        state.advance()
        return state, q_state

    @cute.jit
    def mma(self, tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, sO, tma_o, mO, mLSE, pipe_q, pipe_k,
            pipe_v, schedule, seqlen_q_static, seqlen_k_static, cu_q, cu_k, window_left,
            window_right, scale_log2, softcap_prescale, tidx):
        """MMA warpgroups, tile after tile: 64 query rows each over the tile's key blocks, then
        the epilogue."""
        cfg = self.config
        wg = cute.arch.make_warp_uniform(tidx // 128)
        # V as the (D, tile_n) B operand of O += P V (MN-major).
        sVt = cute.composition(sV, cute.make_ordered_layout(
            (self.head_dim, self.tile_n, cfg.stages), order=(1, 0, 2)))
        wg_pv = tiled_mma_pv.get_slice(0)  # operand descriptors of the warpgroup
        if const_expr(self.mma_wgs == 2):
            # Q's and K's descriptors from the slice of the warpgroup's first thread of a tiled
            # MMA over both MMA warpgroups (rather than the warpgroup's rows of Q cut out
            # first): the compiler then ORs each k-step into Q's descriptor and keeps it out of
            # the loop (3-4% fewer instructions per key block). Three warpgroups (160
            # registers each) gain little from it and spill with softcap and a mask.
            qk_wgs = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
                Float32, (2, 1, 1), tiler_mn=(64, self.tile_n))
            tSrQ = qk_wgs.make_fragment_A(qk_wgs.get_slice(wg * 128).partition_A(sQ))
            tSrK = qk_wgs.make_fragment_B(qk_wgs.get_slice(wg * 128).partition_B(sK))
        else:
            wg_qk = tiled_mma_qk.get_slice(0)
            tSrQ = tiled_mma_qk.make_fragment_A(wg_qk.partition_A(
                cute.local_tile(sQ, (64, self.head_dim), (wg, 0))))
            tSrK = tiled_mma_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrV = tiled_mma_pv.make_fragment_B(wg_pv.partition_B(sVt))
        thr_qk = tiled_mma_qk.get_slice(tidx % 128)
        acc_o = cute.make_rmem_tensor(wg_pv.partition_shape_C((64, self.head_dim)), Float32)
        tOrP = tiled_mma_pv.make_fragment_A(wg_pv.partition_shape_A((64, self.tile_n)))
        softmax = OnlineSoftmax(scale_log2, 2)
        carried_scale = cute.make_rmem_tensor(2, Float32)  # rescale_early: the pending row scale
        if const_expr(self.pingpong):
            if wg == 0:  # warpgroup 0 issues first
                cute.arch.barrier_arrive(barrier_id=int(AttentionBarrier.MMA_TURN),
                                         number_of_threads=256)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        for tile in range(cute.arch.block_idx()[0], self.tile_slots(schedule), cute.arch.grid_dim()[0]):
            state, q_state = self.mma_tile(
                tile, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, tOrP, acc_o, softmax,
                carried_scale, thr_qk, sO, tma_o, mO, mLSE, pipe_q, pipe_k, pipe_v, schedule,
                seqlen_q_static, seqlen_k_static, cu_q, cu_k, window_left, window_right,
                softcap_prescale, wg, tidx, state, q_state)
        if const_expr(cfg.persistent and not cfg.varlen):
            if tidx < 32:  # the last tile's O store has read the buffer before the CTA exits
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def mma_tile(self, tile, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, tOrP, acc_o, softmax,
                 carried_scale, thr_qk, sO, tma_o, mO, mLSE, pipe_q, pipe_k, pipe_v, schedule,
                 seqlen_q_static, seqlen_k_static, cu_q, cu_k, window_left, window_right,
                 softcap_prescale, wg, tidx, state, q_state):
        """One tile: the key blocks, then the epilogue; returns the advanced pipeline states."""
        m_block, head, batch, seq, mask = self._tile(tile, schedule, seqlen_q_static,
                                                     seqlen_k_static, cu_q, cu_k, window_left,
                                                     window_right)
        if m_block * self.tile_m < seq.seqlen_q:  # varlen: tiles past the sequence are skipped
            state, q_state = self.mma_tile_blocks(
                tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, tOrP, acc_o, softmax, carried_scale,
                thr_qk, sO, tma_o, mO, mLSE, pipe_q, pipe_k, pipe_v, m_block, head, batch, seq,
                mask, softcap_prescale, wg, tidx, state, q_state)
        return state, q_state

    @cute.jit
    def mma_tile_blocks(self, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, tOrP, acc_o, softmax,
                        carried_scale, thr_qk, sO, tma_o, mO, mLSE, pipe_q, pipe_k, pipe_v,
                        m_block, head, batch, seq, mask, softcap_prescale, wg, tidx, state,
                        q_state):
        """One tile inside its sequence: the key blocks, the softmax's end, the epilogue."""
        cfg = self.config
        acc_o.fill(0.0)
        carried_scale.fill(1.0)
        steps = (tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, tOrP, acc_o, softmax,
                 carried_scale, pipe_k, pipe_v, mask, thr_qk, wg * 64, softcap_prescale, wg)
        n_min, n_max = mask.block_range()
        pipe_q.consumer_wait(q_state)
        state = self.first_block(steps, state, n_max - 1)
        hi = n_max - 1  # blocks [n_min, hi) remain, visited downwards
        if const_expr(cfg.local):
            diagonal = mask.first_block_past_diagonal(n_min)
            for i in range(hi - diagonal):
                state = self.block(steps, state, hi - 1 - i, True)
            hi = cutlass.min(hi, diagonal)
            left_edge = mask.first_block_inside_left_edge(n_min)
            for i in range(hi - left_edge):
                state = self.block(steps, state, hi - 1 - i, False)
            hi = cutlass.min(hi, left_edge)
            for i in range(hi - n_min):
                state = self.block(steps, state, hi - 1 - i, True)
        else:
            for i in range(hi - n_min):
                state = self.block(steps, state, hi - 1 - i, False)
        if const_expr(cfg.persistent):
            pipe_q.consumer_release(q_state)  # the next tile's Q may load now
        q_state.advance()
        state = self.last_pv(steps, state)

        inv_sum = softmax.finish()
        scale_rows(acc_o, inv_sum)
        self.epilogue(acc_o, softmax.row_sum, tiled_mma_pv, sO, tma_o, mO, mLSE, seq,
                      m_block, head, batch, wg, tidx)
        return state, q_state

    @cute.jit
    def scores(self, steps, acc_s, n_block, mask: cutlass.Constexpr, check_seqlen: cutlass.Constexpr):
        """Softcap and masks on a finished S block."""
        tile, thr_qk, row_offset, softcap_prescale = steps[11], steps[12], steps[13], steps[14]
        if const_expr(self.config.softcap):
            for i in cutlass.range(cute.size(acc_s), unroll_full=True):
                acc_s[i] = cute.math.tanh(acc_s[i] * softcap_prescale, fastmath=True)
        if const_expr(mask or check_seqlen):
            tile.apply(acc_s, n_block, thr_qk, row_offset, check_seqlen)

    @cute.jit
    def first_block(self, steps, state, n_block):
        """S of the first block visited (the key tail: always masked), its softmax and P."""
        tiled_mma_qk, tSrQ, tSrK, tOrP, softmax = steps[0], steps[2], steps[3], steps[5], steps[7]
        pipe_k = steps[9]
        acc_s = cute.make_rmem_tensor(tiled_mma_qk.get_slice(0).partition_shape_C((64, self.tile_n)), Float32)
        pipe_k.consumer_wait(state)
        # The warpgroups take turns from the first GEMM on, so that one's first softmax runs
        # under the other's first GEMM.
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=int(AttentionBarrier.MMA_TURN) + self._wg(steps),
                              number_of_threads=256)
        warpgroup_gemm(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, state.index], True)
        if const_expr(self.pingpong):
            cute.arch.barrier_arrive(barrier_id=int(AttentionBarrier.MMA_TURN) + self._next_wg(steps),
                                     number_of_threads=256)
        warpgroup.wait_group(0)
        pipe_k.consumer_release(state)
        self.scores(steps, acc_s, n_block, self.config.local, True)
        softmax.step(acc_s, True)
        convert_pairs(as_operand_a(acc_s), tOrP)
        return state

    @cute.jit
    def block(self, steps, state, n_block, mask: cutlass.Constexpr):
        """S of block n_block issued with P V of the previous block; softmax of S under P V."""
        tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, tOrP = steps[:6]
        acc_o, softmax, carried_scale, pipe_k, pipe_v = steps[6:11]
        v_state = state.clone()
        state.advance()
        acc_s = cute.make_rmem_tensor(tiled_mma_qk.get_slice(0).partition_shape_C((64, self.tile_n)), Float32)
        pipe_k.consumer_wait(state)
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=int(AttentionBarrier.MMA_TURN) + self._wg(steps),
                              number_of_threads=256)
        warpgroup_gemm(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, state.index], True)
        if const_expr(self.rescale_early):
            scale_rows(acc_o, carried_scale)
        pipe_v.consumer_wait(v_state)
        warpgroup_gemm(tiled_mma_pv, acc_o, tOrP, tOrV[None, None, None, v_state.index], False)
        if const_expr(self.pingpong):
            cute.arch.barrier_arrive(barrier_id=int(AttentionBarrier.MMA_TURN) + self._next_wg(steps),
                                     number_of_threads=256)
        warpgroup.wait_group(1)
        pipe_k.consumer_release(state)
        self.scores(steps, acc_s, n_block, mask, False)
        row_scale = softmax.step(acc_s, False)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(v_state)
        convert_pairs(as_operand_a(acc_s), tOrP)
        if const_expr(self.rescale_early):
            carried_scale.store(row_scale.load())
        else:
            scale_rows(acc_o, row_scale)
        return state

    @cute.jit
    def last_pv(self, steps, state):
        """P V of the last block visited."""
        tiled_mma_pv, tOrV, tOrP, acc_o = steps[1], steps[4], steps[5], steps[6]
        carried_scale, pipe_v = steps[8], steps[10]
        if const_expr(self.rescale_early):
            scale_rows(acc_o, carried_scale)
        pipe_v.consumer_wait(state)
        warpgroup_gemm(tiled_mma_pv, acc_o, tOrP, tOrV[None, None, None, state.index], False)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(state)
        state.advance()
        return state

    def _wg(self, steps):
        """This MMA warpgroup's index (0-based), uniform over the warp: carried in ``steps``
        with two MMA warpgroups (measured faster: 1.805 vs 1.88 ms causal at S = 16384), read
        from ``%tid`` with three (160 registers: the carried index spills with softcap and a
        mask)."""
        if const_expr(self.mma_wgs == 2):
            return steps[15]
        return cute.arch.make_warp_uniform(cute.arch.thread_idx()[0] // 128) - 1

    def _next_wg(self, steps):
        wg = self._wg(steps)
        if const_expr(self.mma_wgs == 2):
            return 1 - wg
        return (wg + 1) % self.mma_wgs

    @cute.jit
    def epilogue(self, acc_o, lse, tiled_mma_pv, sO, tma_o, mO, mLSE, seq, m_block, head, batch,
                 wg, tidx):
        """O to 16 bits, through shared memory (Q's buffer, or its own in a persistent CTA) to
        global memory; LSE straight out."""
        cfg = self.config
        r_o = cute.make_rmem_tensor(acc_o.shape, self.dtype)
        convert_pairs(acc_o, r_o)
        epilogue_barrier = int(AttentionBarrier.EPILOGUE)
        if const_expr(cfg.persistent):
            # The previous tile's O has left the buffer: its store warp waits for the TMA's
            # reads here rather than right after issuing the store, so that its warpgroup
            # starts the next tile's GEMMs at once.
            if const_expr(not cfg.varlen):
                if tidx < 32:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=epilogue_barrier, number_of_threads=self.mma_threads)
        store_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.dtype)
        tiled_store = cute.make_tiled_copy_C(store_atom, tiled_mma_pv)
        thr_store = tiled_store.get_slice(tidx % 128)
        sO_rows = cute.local_tile(sO, (64, self.head_dim), (wg, 0))
        cute.copy(tiled_store, thr_store.retile(r_o), thr_store.partition_D(sO_rows))

        # LSE: the thread of each quad that holds column 0 writes its two rows.
        coords = rows_cols(tiled_mma_pv.get_slice(tidx % 128).partition_C(
            cute.make_identity_tensor((64, self.head_dim))))
        if coords[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = m_block * self.tile_m + wg * 64 + coords[r, 0][0]
                if row < seq.seqlen_q:
                    if const_expr(cfg.varlen):
                        mLSE[seq.offset_q + row, head] = lse[r]
                    else:
                        mLSE[row, head, batch] = lse[r]

        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=epilogue_barrier, number_of_threads=self.mma_threads)
        o_rows = self._rows(mO, seq.offset_q, head, batch)
        if const_expr(not cfg.varlen):
            if tidx < 32:
                gO = cute.local_tile(o_rows, (self.tile_m, self.head_dim), (m_block, 0))
                tOsO, tOgO = cpasync.tma_partition(tma_o, 0, cute.make_layout(1),
                                                   cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2))
                cute.copy(tma_o, tOsO, tOgO)
                cute.arch.cp_async_bulk_commit_group()
                if const_expr(not cfg.persistent):
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
        else:
            self.store_rows(sO, o_rows, seq, m_block, tidx)

    @cute.jit
    def store_rows(self, sO, o_rows, seq, m_block, tidx):
        """Varlen: the tile's rows inside the sequence, shared -> global in 16-byte vectors."""
        vec = 128 // self.dtype.width
        threads_per_row = 8 if (self.head_dim // vec) % 8 == 0 else 4
        copy_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        tiled_copy = cute.make_tiled_copy_tv(
            copy_atom,
            cute.make_ordered_layout((self.mma_threads // threads_per_row, threads_per_row), order=(1, 0)),
            cute.make_layout((1, vec)),
        )
        thr_copy = tiled_copy.get_slice(tidx)
        gO = cute.local_tile(o_rows, (self.tile_m, self.head_dim), (m_block, 0))
        tOsO = thr_copy.partition_S(sO)
        tOgO = thr_copy.partition_D(gO)
        tOcO = thr_copy.partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        r_o = cute.make_rmem_tensor_like(tOsO, self.dtype)
        cute.autovec_copy(tOsO, r_o)
        rows_left = seq.seqlen_q - m_block * self.tile_m
        for m in cutlass.range_constexpr(cute.size(tOsO, mode=[1])):
            if tOcO[0, m, 0][0] < rows_left:
                cute.copy(tiled_copy, r_o[None, m, None], tOgO[None, m, None])
