"""FlashAttention-2 backward for Hopper (sm_90a): dQ, dK, dV from Q, K, V, dO, the LSE and
D = rowsum(dO * O).

Design:
  - One CTA per key block (tile_n keys of one key / value head of one sequence): K and V are
    loaded once and stay in shared memory; the CTA walks every query head of its group (GQA:
    dK and dV summed over the group in registers, never expanded) and, per head, the query
    blocks (tile_m rows) that may see its keys. A producer warp streams Q and dO blocks through
    a ``stages``-deep TMA pipeline.
  - Two MMA warpgroups, 64 keys each, per query block: S^T = K Q^T and dP^T = V dO^T (wgmma,
    shared-memory operands), P^T = exp2(S^T * scale * log2 e - LSE * log2 e) recomputed from
    the forward's LSE (``lse_log2``, +inf for a row that saw no key), dS^T = P^T (dP^T - D),
    then dV += P^T dO and dK += dS^T Q with P^T and dS^T as register A operands (the forward's
    fragment views), accumulated in fp32 registers over all query blocks.
  - dQ: each warpgroup stores its dS^T to shared memory and computes its keys' share of
    dQ = dS K (wgmma with dS from shared memory); the shares are summed in a shared fp32 tile,
    and a dedicated warp adds the tile into the fp32 dQ accumulator in global memory with a TMA
    bulk reduce (``cp.reduce.async.bulk.tensor ... add``). Named barriers hand the tile between
    the two warpgroups and the reduce warp.
  - Masks as the forward's (``mask.py`` semantics), on the transposed scores; softcap
    multiplies dS by the tanh derivative. dK and dQ carry the softmax scale (dK here, dQ in the
    launcher's final scaling of the accumulator).

Tensors arrive in torch order: Q, dO, dQ_accum (fp32) (B, Sq, Hq, D), K, V, dK, dV
(B, Sk, Hkv, D), lse_log2 and D (B, Hq, Sq) fp32; varlen: (total, H, D) and (Hq, total_q) with
int32 ``cu_seqlens``.

Constraints:
  - bf16 or fp16 Q, K, V, dO, dK, dV; fp32 dQ_accum (zeroed by the caller), lse_log2 and D
  - head dim 64, 96 or 128 (softcap: 64); tile_m 64, tile_n 128 (two MMA warpgroups of 64
    keys)
  - strides as the forward's (head dim contiguous, the rest multiples of 16 bytes)
  - dQ is summed with atomic bulk adds: not bit-reproducible from run to run
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.memory
import cutlass.tensor_utils as tensor_utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from ..primitives.named_barriers import AttentionBwdBarrier
from .config import AttentionBwdConfig
from .fragments import as_operand_a, convert_pairs, rows_cols, warpgroup_gemm
from .mask import Sequence

PRODUCER_REGISTERS, MMA_REGISTERS = 24, 240
REDUCE_WARP = 1  # of the producer warpgroup; warp 0 loads


def _select(t: cute.Tensor, modes) -> cute.Tensor:
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def _transposed(t: cute.Tensor, shape, order) -> cute.Tensor:
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


class FlashAttnBwdSm90:
    """See the module docstring. ``__init__`` takes only the compile-time configuration."""

    def __init__(self, config: AttentionBwdConfig):
        if config.tile_m != 64 or config.tile_n != 128 or config.head_dim not in (64, 96, 128):
            raise ValueError(f"unsupported backward tiles: {config}")
        self.config = config
        self.tile_m, self.tile_n, self.head_dim = config.tile_m, config.tile_n, config.head_dim

    # ------------------------------------------------------------------ host side

    def _smem(self, layout, major_size, shape, order):
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(layout, self.dtype, major_size), self.dtype)
        return cute.tile_to_shape(atom, shape, order=order)

    @cute.jit
    def __call__(self, mQ, mK, mV, mdO, mLSE, mD, mdQ, mdK, mdV, mCuSeqlensQ, mCuSeqlensK,
                 scale_log2: Float32, softcap_prescale: Float32, dk_scale: Float32,
                 window_left: Int32, window_right: Int32, max_seqlen_k: Int32, stream):
        cfg = self.config
        self.dtype = mQ.element_type
        varlen = const_expr(cfg.varlen)
        modes = [0, 2, 1] if varlen else [1, 3, 2, 0]  # (rows, D, H[, B])
        q, k, v, do, dq = (_select(t, modes) for t in (mQ, mK, mV, mdO, mdQ))
        dk, dv = _select(mdK, modes), _select(mdV, modes)
        row_modes = [1, 0] if varlen else [2, 1, 0]  # (rows, H[, B])
        lse, dsum = _select(mLSE, row_modes), _select(mD, row_modes)
        d, tm, tn, st = self.head_dim, self.tile_m, self.tile_n, cfg.stages
        row_major = tensor_utils.LayoutEnum.ROW_MAJOR
        self.sQ_layout = self._smem(row_major, d, (tm, d, st), (0, 1, 2))
        self.sK_layout = self._smem(row_major, d, (tn, d), (0, 1))
        # dS (queries x keys) stored queries-contiguous: the MN-major A operand of dQ = dS K.
        self.sdS_layout = self._smem(tensor_utils.LayoutEnum.COL_MAJOR, tm, (tm, tn), (1, 0))
        self.sdQ_layout = cute.make_ordered_layout((tm, d), order=(1, 0))
        mma = lambda b_major, n, a_source: sm90_utils.make_trivial_tiled_mma(  # noqa: E731
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K if a_source != "smem_mn"
            else cute.nvgpu.OperandMajorMode.MN, b_major, Float32, (1, 1, 1), tiler_mn=(64, n),
            a_source=warpgroup.OperandSource.RMEM if a_source == "rmem" else warpgroup.OperandSource.SMEM)
        self.mma_s = mma(cute.nvgpu.OperandMajorMode.K, tm, "smem")  # S^T, dP^T (64 keys x tm)
        self.mma_kv = mma(cute.nvgpu.OperandMajorMode.MN, d, "rmem")  # dV, dK (64 keys x D)
        # dQ share (tm x D), in column halves at head dim 128 (fewer live registers: the dV and
        # dK accumulators hold 128 per thread already).
        self.dq_parts = 2 if d == 128 else 1
        self.mma_dq = mma(cute.nvgpu.OperandMajorMode.MN, d // self.dq_parts, "smem_mn")
        load = cpasync.CopyBulkTensorTileG2SOp()
        one_stage = cute.slice_(self.sQ_layout, (None, None, 0))
        tma_q, tma_tensor_q = cpasync.make_tiled_tma_atom(load, q, one_stage, (tm, d))
        tma_do, tma_tensor_do = cpasync.make_tiled_tma_atom(load, do, one_stage, (tm, d))
        tma_k, tma_tensor_k = cpasync.make_tiled_tma_atom(load, k, self.sK_layout, (tn, d))
        tma_v, tma_tensor_v = cpasync.make_tiled_tma_atom(load, v, self.sK_layout, (tn, d))
        tma_dq, tma_tensor_dq = cpasync.make_tiled_tma_atom(
            cpasync.CopyReduceBulkTensorTileS2GOp(), dq, self.sdQ_layout, (tm, d))
        self.qdo_bytes = 2 * cute.size_in_bytes(self.dtype, one_stage)
        self.kv_bytes = 2 * cute.size_in_bytes(self.dtype, self.sK_layout)

        @cute.struct
        class Storage:
            bar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            bar_qdo: cute.struct.MemRange[cutlass.Int64, st * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.sK_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.sdS_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(self.sdQ_layout)], 1024]

        self.storage = Storage
        heads, heads_kv = q.shape[2], k.shape[2]
        batches = mCuSeqlensQ.shape[0] - 1 if const_expr(varlen) else q.shape[3]
        grid = (cute.ceil_div(max_seqlen_k, tn), heads_kv, batches)
        self.kernel(
            tma_q, tma_tensor_q, tma_do, tma_tensor_do, tma_k, tma_tensor_k, tma_v, tma_tensor_v,
            tma_dq, tma_tensor_dq, lse, dsum, dk, dv, mCuSeqlensQ, mCuSeqlensK, q.shape[0],
            k.shape[0], heads, heads_kv, scale_log2, softcap_prescale, dk_scale, window_left,
            window_right, self.sQ_layout, self.sK_layout, self.sdS_layout, self.mma_s,
            self.mma_kv, self.mma_dq,
        ).launch(grid=grid, block=[384, 1, 1], min_blocks_per_mp=1, stream=stream)

    # ------------------------------------------------------------------ device side

    @cute.kernel
    def kernel(self, tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV, tma_dq, mdQ, mLSE, mD, mdK,
               mdV, mCuSeqlensQ, mCuSeqlensK, seqlen_q_static: Int32, seqlen_k_static: Int32,
               heads: Int32, heads_kv: Int32, scale_log2: Float32, softcap_prescale: Float32,
               dk_scale: Float32, window_left: Int32, window_right: Int32,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sdS_layout: cute.ComposedLayout, mma_s: cute.TiledMma, mma_kv: cute.TiledMma,
               mma_dq: cute.TiledMma):
        cfg = self.config
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            for atom in (tma_q, tma_do, tma_k, tma_v, tma_dq):
                cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, 8)  # the MMA warps
        pipe_kv = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bar_kv.data_ptr(), num_stages=1, producer_group=producer,
            consumer_group=consumers, tx_count=self.kv_bytes, defer_sync=True)
        pipe_qdo = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bar_qdo.data_ptr(), num_stages=cfg.stages,
            producer_group=producer, consumer_group=consumers, tx_count=self.qdo_bytes,
            defer_sync=True)
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sdQ = storage.sdQ.get_tensor(cute.make_ordered_layout((self.tile_m, self.head_dim), order=(1, 0)))

        n_block, head_kv, batch = cute.arch.block_idx()
        seq = Sequence(batch, seqlen_q_static, seqlen_k_static, mCuSeqlensQ, mCuSeqlensK)
        group = heads // heads_kv
        m_min, m_max = self.query_blocks(seq, n_block, window_left, window_right)
        steps = group * cutlass.max(m_max - m_min, 0)
        work = (seq, n_block, head_kv, batch, group, m_min, m_max, steps)
        pipeline_init_wait(cluster_shape_mn=(1, 1))

        if n_block * self.tile_n < seq.seqlen_k:  # varlen: key blocks past the sequence exit
            if tidx < 128:
                cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
                if warp == 0:
                    self.load(tma_q, tma_do, tma_k, tma_v, mQ, mdO, mK, mV, sQ, sdO, sK, sV,
                              pipe_kv, pipe_qdo, work)
                elif warp == REDUCE_WARP:
                    self.reduce_dq(tma_dq, mdQ, sdQ, work)
            else:
                cute.arch.setmaxregister_increase(MMA_REGISTERS)
                self.mma(mma_s, mma_kv, mma_dq, sQ, sdO, sK, sV, sdS, sdQ, mLSE, mD, mdK, mdV,
                         pipe_kv, pipe_qdo, work, scale_log2, softcap_prescale, dk_scale,
                         window_left, window_right, tidx - 128)

    @cute.jit
    def query_blocks(self, seq, n_block, window_left, window_right):
        """(m_min, m_max): the query blocks whose rows may see a key of block ``n_block``
        (query i sees key j when i + Sk - Sq - left <= j <= i + Sk - Sq + right)."""
        m_max = cute.ceil_div(seq.seqlen_q, self.tile_m)
        m_min = Int32(0)
        if const_expr(self.config.local):
            offset = seq.seqlen_k - seq.seqlen_q
            first = cutlass.max(n_block * self.tile_n - offset - window_right, 0)
            m_min = first // self.tile_m
            past = cutlass.max((n_block + 1) * self.tile_n - offset + window_left, 0)
            m_max = cutlass.min(m_max, cute.ceil_div(past, self.tile_m))
        return m_min, m_max

    def _rows(self, t, offset, head, batch):
        if const_expr(self.config.varlen):
            return cute.domain_offset((offset, 0), t[None, None, head])
        return t[None, None, head, batch]

    def _step(self, work, i):
        """(query head, query block) of step ``i`` of the CTA's walk."""
        seq, n_block, head_kv, batch, group, m_min, m_max, steps = work
        count = m_max - m_min
        g = i // count
        return head_kv * group + g, m_min + i - g * count

    @cute.jit
    def load(self, tma_q, tma_do, tma_k, tma_v, mQ, mdO, mK, mV, sQ, sdO, sK, sV, pipe_kv,
             pipe_qdo, work):
        """Producer warp: K and V once, then Q and dO of every step."""
        seq, n_block, head_kv, batch, group, m_min, m_max, steps = work
        one = cute.make_layout(1)
        tile_kd = (self.tile_n, self.head_dim)
        gK = cute.local_tile(self._rows(mK, seq.offset_k, head_kv, batch), tile_kd, (n_block, 0))
        gV = cute.local_tile(self._rows(mV, seq.offset_k, head_kv, batch), tile_kd, (n_block, 0))
        tKsK, tKgK = cpasync.tma_partition(tma_k, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_v, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_kv.producer_acquire(kv_state)
        barrier = pipe_kv.producer_get_barrier(kv_state)
        cute.copy(tma_k, tKgK, tKsK, tma_bar_ptr=barrier)
        cute.copy(tma_v, tVgV, tVsV, tma_bar_ptr=barrier)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.config.stages)
        tile_qd = (self.tile_m, self.head_dim)
        for i in range(steps):
            head, m_block = self._step(work, i)
            gQ = cute.local_tile(self._rows(mQ, seq.offset_q, head, batch), tile_qd, (m_block, 0))
            gdO = cute.local_tile(self._rows(mdO, seq.offset_q, head, batch), tile_qd, (m_block, 0))
            tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
            tOsO, tOgO = cpasync.tma_partition(tma_do, 0, one, cute.group_modes(sdO, 0, 2), cute.group_modes(gdO, 0, 2))
            pipe_qdo.producer_acquire(state)
            barrier = pipe_qdo.producer_get_barrier(state)
            cute.copy(tma_q, tQgQ, tQsQ[None, state.index], tma_bar_ptr=barrier)
            cute.copy(tma_do, tOgO, tOsO[None, state.index], tma_bar_ptr=barrier)
            state.advance()

    @cute.jit
    def reduce_dq(self, tma_dq, mdQ, sdQ, work):
        """Reduce warp: add each step's dQ tile (shared, fp32) into the global accumulator."""
        seq, n_block, head_kv, batch, group, m_min, m_max, steps = work
        full, empty = int(AttentionBwdBarrier.DQ_FULL), int(AttentionBwdBarrier.DQ_EMPTY)
        cute.arch.barrier_arrive(barrier_id=empty, number_of_threads=160)  # the tile starts free
        one = cute.make_layout(1)
        for i in range(steps):
            head, m_block = self._step(work, i)
            gdQ = cute.local_tile(self._rows(mdQ, seq.offset_q, head, batch),
                                  (self.tile_m, self.head_dim), (m_block, 0))
            tsdQ, tgdQ = cpasync.tma_partition(tma_dq, 0, one, cute.group_modes(sdQ, 0, 2), cute.group_modes(gdQ, 0, 2))
            cute.arch.barrier(barrier_id=full, number_of_threads=160)
            cute.copy(tma_dq, tsdQ, tgdQ)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier_arrive(barrier_id=empty, number_of_threads=160)
        cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def mma(self, mma_s, mma_kv, mma_dq, sQ, sdO, sK, sV, sdS, sdQ, mLSE, mD, mdK, mdV, pipe_kv,
            pipe_qdo, work, scale_log2, softcap_prescale, dk_scale, window_left, window_right,
            tidx):
        """MMA warpgroups: 64 keys each, over every step; then dK and dV out."""
        cfg = self.config
        seq, n_block, head_kv, batch, group, m_min, m_max, steps = work
        wg = cute.arch.make_warp_uniform(tidx // 128)
        d, tm, st = self.head_dim, self.tile_m, cfg.stages
        sK_w = cute.local_tile(sK, (64, d), (wg, 0))
        sV_w = cute.local_tile(sV, (64, d), (wg, 0))
        sQt = _transposed(sQ, (d, tm, st), (1, 0, 2))  # (D, queries): N-major B operands
        sdOt = _transposed(sdO, (d, tm, st), (1, 0, 2))
        sKt_w = _transposed(sK_w, (d, 64), (1, 0))
        sdS_w = cute.local_tile(sdS, (tm, 64), (0, wg))  # (queries, this warpgroup's keys)
        s_ops, kv_ops, dq_ops = mma_s.get_slice(0), mma_kv.get_slice(0), mma_dq.get_slice(0)
        tSrK = mma_s.make_fragment_A(s_ops.partition_A(sK_w))
        tSrQ = mma_s.make_fragment_B(s_ops.partition_B(sQ))
        tPrV = mma_s.make_fragment_A(s_ops.partition_A(sV_w))
        tPrdO = mma_s.make_fragment_B(s_ops.partition_B(sdO))
        tVrdO = mma_kv.make_fragment_B(kv_ops.partition_B(sdOt))
        tKrQ = mma_kv.make_fragment_B(kv_ops.partition_B(sQt))
        tVrP = mma_kv.make_fragment_A(kv_ops.partition_shape_A((64, tm)))
        tKrdS = mma_kv.make_fragment_A(kv_ops.partition_shape_A((64, tm)))
        tQrdS = mma_dq.make_fragment_A(dq_ops.partition_A(sdS_w))
        dn = d // self.dq_parts
        tQrK = [mma_dq.make_fragment_B(dq_ops.partition_B(cute.local_tile(sKt_w, (dn, 64), (h, 0))))
                for h in range(self.dq_parts)]
        acc_dv = cute.make_rmem_tensor(kv_ops.partition_shape_C((64, d)), Float32)
        acc_dk = cute.make_rmem_tensor(kv_ops.partition_shape_C((64, d)), Float32)
        acc_dv.fill(0.0)
        acc_dk.fill(0.0)
        thr_s = mma_s.get_slice(tidx % 128)
        # This thread's positions: S^T rows (keys) and columns (queries), dS^T in shared memory,
        # the dQ share in the shared fp32 tile.
        coords = rows_cols(thr_s.partition_C(cute.make_identity_tensor((64, tm))))
        sdS_t = _transposed(sdS_w, (64, tm), (1, 0))  # (keys, queries) view of dS
        tSsdS = thr_s.partition_C(sdS_t)
        tQsdQ = [mma_dq.get_slice(tidx % 128).partition_C(cute.local_tile(sdQ, (tm, dn), (0, h)))
                 for h in range(self.dq_parts)]
        key0 = n_block * self.tile_n + wg * 64

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_kv.consumer_wait(kv_state)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, st)
        for i in range(steps):
            head, m_block = self._step(work, i)
            q0 = m_block * tm
            pipe_qdo.consumer_wait(state)
            acc_s = cute.make_rmem_tensor(s_ops.partition_shape_C((64, tm)), Float32)
            acc_dp = cute.make_rmem_tensor(s_ops.partition_shape_C((64, tm)), Float32)
            warpgroup_gemm(mma_s, acc_s, tSrK, tSrQ[None, None, None, state.index], True)
            warpgroup_gemm(mma_s, acc_dp, tPrV, tPrdO[None, None, None, state.index], True)
            warpgroup.wait_group(0)
            # P^T and dS^T in place of S^T and dP^T, one pass; blocks on an edge also mask.
            mask = self.on_edge(key0, q0, seq, window_left, window_right)
            rows = (self._query_rows(mLSE, seq, head, batch), self._query_rows(mD, seq, head, batch))
            if mask:
                self.probabilities(acc_s, acc_dp, coords, rows, scale_log2, softcap_prescale,
                                   key0, q0, seq, window_left, window_right, True)
            else:
                self.probabilities(acc_s, acc_dp, coords, rows, scale_log2, softcap_prescale,
                                   key0, q0, seq, window_left, window_right, False)
            convert_pairs(as_operand_a(acc_s), tVrP)
            warpgroup_gemm(mma_kv, acc_dv, tVrP, tVrdO[None, None, None, state.index], False)
            convert_pairs(as_operand_a(acc_dp), tKrdS)
            warpgroup_gemm(mma_kv, acc_dk, tKrdS, tKrQ[None, None, None, state.index], False)
            # dS^T to shared memory (this warpgroup's keys), then its share of dQ = dS K.
            cute.autovec_copy(tKrdS, as_operand_a(tSsdS))
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=int(AttentionBwdBarrier.DS_READY) + wg, number_of_threads=128)
            for h in cutlass.range_constexpr(self.dq_parts):
                acc_dq = cute.make_rmem_tensor(dq_ops.partition_shape_C((tm, dn)), Float32)
                warpgroup_gemm(mma_dq, acc_dq, tQrdS, tQrK[h], True)
                warpgroup.wait_group(0)
                if const_expr(h == 0):
                    pipe_qdo.consumer_release(state)
                self.add_dq_share(acc_dq, tQsdQ[h], wg, h == 0, h == self.dq_parts - 1)
            state.advance()
        # dK, dV out (softmax scale on dK; dQ's comes with the accumulator's final scaling).
        for j in cutlass.range(cute.size(acc_dk), unroll_full=True):
            acc_dk[j] = acc_dk[j] * dk_scale
        self.store_kv(mma_kv, acc_dk, mdK, seq, n_block, head_kv, batch, wg, tidx)
        self.store_kv(mma_kv, acc_dv, mdV, seq, n_block, head_kv, batch, wg, tidx)

    def _query_rows(self, t, seq, head, batch):
        """One head's per-query values (LSE or D) of this sequence, indexed by query row."""
        if const_expr(self.config.varlen):
            return cute.domain_offset((seq.offset_q,), t[None, head])
        return t[None, head, batch]

    @cute.jit
    def add_dq_share(self, acc_dq, tQsdQ, wg, first: cutlass.Constexpr, last: cutlass.Constexpr):
        """Sum the two warpgroups' dQ shares (one column part of them) in the shared fp32 tile
        and hand it to the reduce warp: warpgroup 0 writes once the reduce warp has read the
        previous tile, warpgroup 1 adds its share (the two hold the same positions) and, after
        the last part, releases the tile."""
        half = int(AttentionBwdBarrier.DQ_HALF)
        if wg == 0:
            if const_expr(first):
                cute.arch.barrier(barrier_id=int(AttentionBwdBarrier.DQ_EMPTY), number_of_threads=160)
            cute.autovec_copy(acc_dq, tQsdQ)
            if const_expr(last):
                cute.arch.barrier_arrive(barrier_id=half, number_of_threads=256)
        else:
            if const_expr(first):
                cute.arch.barrier(barrier_id=half, number_of_threads=256)
            for j in cutlass.range(cute.size(acc_dq), unroll_full=True):
                tQsdQ[j] = tQsdQ[j] + acc_dq[j]
            if const_expr(last):
                cute.arch.fence_view_async_shared()
                cute.arch.barrier_arrive(barrier_id=int(AttentionBwdBarrier.DQ_FULL), number_of_threads=160)

    @cute.jit
    def on_edge(self, key0, q0, seq, window_left, window_right):
        """Whether this warpgroup's 64 keys x tile_m queries need any masking: past either
        sequence's end, or (``local``) not wholly inside every query's window."""
        edge = key0 + 64 > seq.seqlen_k or q0 + self.tile_m > seq.seqlen_q
        if const_expr(self.config.local):
            offset = seq.seqlen_k - seq.seqlen_q
            edge = (edge or key0 + 63 > q0 + offset + window_right
                    or key0 < q0 + self.tile_m - 1 + offset - window_left)
        return edge

    @cute.jit
    def probabilities(self, acc_s, acc_dp, coords, rows, scale_log2, softcap_prescale, key0, q0,
                      seq, window_left, window_right, mask: cutlass.Constexpr):
        """P^T = exp2(S^T * scale * log2 e - LSE * log2 e) into ``acc_s`` and dS^T = P^T (dP^T - D)
        (times 1 - tanh^2 with softcap) into ``acc_dp``; with ``mask``, -inf scores where key
        (row) and query (column) may not meet."""
        s, dp = rows_cols(acc_s), rows_cols(acc_dp)
        offset = seq.seqlen_k - seq.seqlen_q
        lse_rows, d_rows = rows
        if const_expr(self.config.softcap):  # in place first: no third value live per score
            for j in cutlass.range(cute.size(acc_s), unroll_full=True):
                acc_s[j] = cute.math.tanh(acc_s[j] * softcap_prescale, fastmath=True)
        for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
            # This column's query: its LSE (+inf past the sequence, so P = 0) and D.
            q = q0 + coords[0, c][1]
            row = cutlass.min(q, seq.seqlen_q - 1)
            lse = lse_rows[row]
            dsum = d_rows[row]
            if q >= seq.seqlen_q:
                lse = Float32.inf
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                key = key0 + coords[r, 0][0]
                capped = s[r, c]
                score = capped
                if const_expr(mask):
                    ok = key < seq.seqlen_k and q < seq.seqlen_q
                    if const_expr(self.config.local):
                        ok = ok and key <= q + offset + window_right and key >= q + offset - window_left
                    score = score if ok else -Float32.inf
                p = cute.math.exp2(score * scale_log2 - lse, fastmath=True)
                ds = p * (dp[r, c] - dsum)
                if const_expr(self.config.softcap):
                    ds = ds * (Float32(1.0) - capped * capped)  # the unmasked tanh: finite
                s[r, c] = p
                dp[r, c] = ds

    @cute.jit
    def store_kv(self, mma_kv, acc, mOut, seq, n_block, head_kv, batch, wg, tidx):
        """This warpgroup's 64 key rows of dK or dV, in the output dtype, rows past the
        sequence left alone."""
        out = cute.make_rmem_tensor(acc.shape, self.dtype)
        convert_pairs(acc, out)
        rows = self._rows(mOut, seq.offset_k, head_kv, batch)
        g = cute.local_tile(rows, (64, self.head_dim), (n_block * 2 + wg, 0))
        thr = mma_kv.get_slice(tidx % 128)
        tg = thr.partition_C(g)
        tc = thr.partition_C(cute.make_identity_tensor((64, self.head_dim)))
        rows_left = seq.seqlen_k - (n_block * self.tile_n + wg * 64)
        for j in cutlass.range(cute.size(out), unroll_full=True):
            if tc[j][0] < rows_left:
                tg[j] = out[j]
