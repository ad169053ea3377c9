"""FlashAttention-2 backward for Hopper (sm_90a): dQ, dK, dV from Q, K, V, dO, the LSE and
D = rowsum(dO * O).

Design:
  - One CTA per key block (tile_n keys of one key / value head of one sequence): K and V are
    loaded once and stay in shared memory; the CTA walks every query head of its group (GQA:
    dK and dV summed over the group in registers, never expanded; or of its run of the group,
    below) and, per head, the query blocks (tile_m rows) that may see its keys. A producer
    warp streams Q and dO blocks through a ``stages``-deep TMA pipeline. Tile order
    (``tile_coords``): each (kv head, sequence) pair's key blocks in turn, so the CTAs that
    run together share its Q and dO in the L2; with a causal mask, groups of pairs key block
    by key block, the longest walks first.
  - Split groups (``kv_splits`` > 1, the op's run-time choice, ``config.bwd_kv_splits``: head
    dims 96 and 128, a causal-like mask, more than ``BWD_SPLIT_ABOVE`` query heads per kv
    head): under a causal mask the walks of one kv head's key blocks differ in length, so
    CTAs that each walk a whole large group drift apart and stop sharing Q, dO and dQ's rows
    in the L2. The group is then cut into runs of heads, one CTA per (key block, run), and
    each CTA adds its dK and dV in fp32 into accumulators (``dq_accum.py``'s layout over
    keys): the MMA warpgroups stage their fragments over Q's, dO's, K's and V's shared memory
    (``stage_kv_sums``), the reduce warp adds them with four 1-D bulk reduces
    (``add_kv_sums``; ``deterministic``: in run order, by a semaphore per key block) and the
    op's finish pass converts them.
  - Persistent CTAs (``config.persistent``: no mask, not deterministic, not varlen, where every
    key block's walk is as long): one CTA per SM takes the tiles in turn (a static stride of
    the grid). Its dK and dV leave through dS's and the dQ tiles' shared memory instead of K's
    and V's, so the MMA warpgroups release K and V after their last step and the producer
    loads the next tile's K, V and first Q / dO stages under the store: a CTA's fixed costs
    (K and V in, the pipeline's fill, dK and dV out) no longer stand between two key blocks.
  - Two MMA warpgroups, 64 keys each, per query block: S^T = K Q^T and dP^T = V dO^T (wgmma,
    shared-memory operands), P^T = exp2(S^T * scale * log2 e - LSE * log2 e) recomputed from
    the forward's LSE (``lse_log2``, +inf for a row that saw no key), dS^T = P^T (dP^T - D),
    then dV += P^T dO and dK += dS^T Q with P^T and dS^T as register A operands (the forward's
    fragment views), accumulated in fp32 registers over all query blocks. The LSE and D of
    each query block arrive in shared memory with its Q and dO (TMA, same pipeline stage);
    each thread reads its queries' values into registers while S^T and dP^T are computed.
  - 128 queries per step at head dim 64 (``tile_m``; 64 elsewhere): half the steps, barriers
    and pipeline waits per FLOP. Its S^T and dP^T fragments (64 values each per thread) next
    to dK and dV leave no room for 32 LSE and 32 D values per thread, so there the two
    accumulators start at -LSE / scale and -D of their query columns instead of 0
    (``lse_in_acc``): the GEMMs leave S^T - LSE / scale and dP^T - D behind, and P^T =
    exp2(S'^T * scale * log2 e), dS^T = P^T dP'^T.
  - Overlap inside a warpgroup: P is computed while the dP GEMM runs, dS^T is stored while the
    dV GEMM runs, and the dQ tile is handed over while the dK GEMM runs.
  - dQ: both warpgroups store their dS^T to a double-buffered shared tile (tile_m x tile_n);
    after one 256-thread barrier each computes its share of dQ over all tile_n keys (dQ = dS K,
    wgmma from shared memory) into its own swizzled fp32 tile, which a dedicated warp adds into
    the fp32 dQ accumulator in global memory with a TMA bulk reduce
    (``cp.reduce.async.bulk ... add``). The share: with 64 queries per step, half of dQ's
    columns (head dim 96: warpgroup 0 all of them); with 128 (head dim 64), 64 query rows over
    the whole head dim. A tile holds its warpgroup's fragment in thread order
    (``dq_accum.py``): 16-byte stores without bank conflicts or address arithmetic, and one
    1-D bulk reduce of contiguous bytes into the accumulator, which keeps that order (the
    finish pass puts the values in their rows).
  - D comes from the preprocess kernel (``preprocess.py``); the op scales and converts the dQ
    accumulator afterwards.
  - dK and dV leave through shared memory (K's and V's tiles, once every GEMM on them is done)
    and a TMA store each (``store_kv_tma``); varlen's partial last block of a sequence, which a
    TMA store would write past, with 32-bit stores of column pairs (``store_kv``).
  - The dS^T stores to their SW128-swizzled tile compute addresses in closed form
    (``store_ds_t``): one XOR per column group instead of the per-element address arithmetic
    the compiler re-derives every step.
  - Masks as the forward's (``mask.py`` semantics and 32-bit keep masks, a row of S^T at a
    time), on the transposed scores, only on the blocks an edge crosses; softcap turns S^T
    into its tanh in place and multiplies dP^T - D by the tanh's derivative before P^T is
    formed (no extra fragment). dK and dQ carry the softmax scale (dK here, dQ in the
    launcher's final scaling of the accumulator).

Tensors arrive in torch order: Q, dO (B, Sq, Hq, D), K, V, dK, dV (B, Sk, Hkv, D), lse_log2
and D (B, Hq, Sq) fp32; varlen: (total, H, D) with int32 ``cu_seqlens``, and lse_log2 and D
(Hq, rows) with sequence b's rows from ``padded_row_offset`` (zeros between sequences). The
dQ accumulator: (Hq, R, D) fp32 in ``dq_accum.py``'s layout.

Constraints:
  - bf16 or fp16 Q, K, V, dO, dK, dV; fp32 dQ accumulator (zeroed by the caller, contiguous,
    on 16 bytes), lse_log2 and D (rows contiguous, other strides multiples of 16 bytes: TMA)
  - persistent only without a mask, ``deterministic`` or varlen (dK / dV staged in dS's and
    the dQ tiles' shared memory, both at least a (tile_n, D) tile at these head dims)
  - head dim 64, 96 or 128 (softcap too); tile_n 128 (two MMA warpgroups of 64 keys);
    tile_m 64, or 128 at head dim 64 without softcap (the S^T, dP^T, dK and dV fragments then
    take 192 of a thread's 240 registers)
  - strides as the forward's (head dim contiguous, the rest multiples of 16 bytes)
  - ``kv_splits`` > 1 only where ``splits_kv`` (masked); its dK / dV accumulators (2 Hkv, R,
    D) fp32, zeroed by the caller, contiguous, on 16 bytes; dK and dV are then left to the
    finish pass
  - dQ (and a split group's dK / dV) is summed with atomic bulk adds: bit-reproducible from
    run to run only with ``deterministic`` (then the reduce warp of each CTA waits on int32
    semaphores, zeroed by the caller, for its turn: (sequence, Hq + Hkv, blocks), one per
    query head and block of tile_m queries (``_rank``), then one per kv head and key block
    (its runs in order))
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
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from ..primitives.named_barriers import AttentionBwdBarrier
from .config import AttentionBwdConfig, kv_splits_supported
from .dq_accum import (bulk_reduce_add, chunk_address, chunk_row, dq_split, dq_warpgroups,
                       store_fragment)
from .fragments import as_operand_a, convert_pairs, rows_cols, warpgroup_gemm
from .mask import Sequence, mask_columns
from .schedule import grouped_rank

PRODUCER_REGISTERS, MMA_REGISTERS = 24, 240
# setmaxnreg moves registers between warpgroups inside the 168 per thread the 384-thread launch
# gets: the MMA warpgroups' increase waits for registers the producer warpgroup's decrease
# released, so a split past this budget hangs the kernel.
assert 128 * PRODUCER_REGISTERS + 256 * MMA_REGISTERS <= 384 * 168
REDUCE_WARP = 1  # of the producer warpgroup; warp 0 loads


@dsl_user_op
def _st_shared(address: Int32, value: Int32, offset: int, *, loc=None, ip=None) -> None:
    """``st.shared.b32`` of ``value`` at byte ``address + offset`` (an immediate)."""
    llvm.inline_asm(
        None,
        [Int32(address).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)],
        f"st.shared.b32 [$0+{offset}], $1;",
        "r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def padded_row_offset(offset_q, batch):
    """Varlen: where sequence ``batch`` (starting at query row ``offset_q``) starts in the LSE and
    D rows: a multiple of 4 (a TMA box of fp32 rows starts on 16 bytes), 4 * (offset_q // 4 +
    batch), so sequences never overlap and ``total_q + 4 * batches`` rows hold them all. The
    prepare pass writes them there (``preprocess.BwdPrepareSm90``)."""
    return (offset_q // 4 + batch) * 4


def _select(t: cute.Tensor, modes) -> cute.Tensor:
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def _transposed(t: cute.Tensor, shape, order) -> cute.Tensor:
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


class FlashAttnBwdSm90:
    """See the module docstring. ``__init__`` takes only the compile-time configuration."""

    # dQ split between the MMA warpgroups by query rows (each: 64 rows, all of D) rather than
    # by columns (each: all tile_m rows, its share of D)
    dq_by_rows = False
    # The S^T and dP^T accumulators start at -LSE / scale and -D (per query column) rather
    # than 0: P = exp2(S^T * scale * log2 e) and dS^T = P^T dP^T then hold no LSE or D in
    # registers next to the two fragments
    lse_in_acc = False

    def __init__(self, config: AttentionBwdConfig):
        if (config.tile_m not in (64, 128) or config.tile_n != 128 or config.stages != 2
                or config.do_stages or config.head_dim not in (64, 96, 128)
                or (config.tile_m == 128 and (config.head_dim != 64 or config.softcap))
                or (config.persistent
                    and (config.local or config.varlen or config.deterministic))):
            raise ValueError(f"unsupported backward tiles: {config}")
        self.config = config
        self.tile_m, self.tile_n, self.head_dim = config.tile_m, config.tile_n, config.head_dim
        # 64 queries per step: dQ's columns split between the two MMA warpgroups (at head dim
        # 96 the halves (48) would cut K's 32-column swizzle atoms, so warpgroup 0 computes all
        # of dQ); 128 queries: its rows (one 64-row MMA each).
        self.lse_in_acc = config.tile_m == 128
        self.dq_wgs = dq_warpgroups(config.head_dim)
        self.dq_by_rows, self.dq_cols = dq_split(config.head_dim, config.tile_m)
        self.wg_keys = 64  # keys per MMA warpgroup's score tile
        self.queries_on_rows = False  # score tiles are S^T: keys on rows, queries on columns
        self.do_stages = config.do_stages  # 0: dO in Q's pipeline stages
        self.do_buffers = config.do_stages or config.stages  # dO / D buffers in shared memory
        self.persistent = config.persistent
        # A kv head's group of query heads may be split over several CTAs (a run-time choice,
        # ``kv_splits``) that add dK and dV into fp32 accumulators (``stage_kv_sums``): with a
        # mask (one CTA per tile). Q's stages and K's tile (tile_m * stages >= 128, tile_n >=
        # 128) each hold a 64 x D fp32 fragment.
        self.splits_kv = kv_splits_supported(config)

    @property
    def dq_tile(self) -> int:
        """fp32 values of one dQ warpgroup's tile (64 rows of its ``dq_cols`` columns)."""
        return 64 * self.dq_cols

    # ------------------------------------------------------------------ host side

    @staticmethod
    def _smem(dtype, layout, major_size, shape, order):
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(layout, dtype, major_size), dtype)
        return cute.tile_to_shape(atom, shape, order=order)

    def _tiles(self, d, tm, tn, st):
        """Shared-memory layouts and tiled MMAs of the main loop."""
        row_major = tensor_utils.LayoutEnum.ROW_MAJOR
        self.sQ_layout = self._smem(self.dtype, row_major, d, (tm, d, st), (0, 1, 2))
        self.sK_layout = self._smem(self.dtype, row_major, d, (tn, d), (0, 1))
        # dS (queries x keys, one buffer per pipeline stage) stored queries-contiguous: the
        # MN-major A operand of dQ = dS K.
        self.sdS_layout = self._smem(self.dtype, tensor_utils.LayoutEnum.COL_MAJOR, tm,
                                     (tm, tn, st), (1, 0, 2))
        mma = lambda b_major, n, a_source: sm90_utils.make_trivial_tiled_mma(  # noqa: E731
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K if a_source != "smem_mn"
            else cute.nvgpu.OperandMajorMode.MN, b_major, Float32, (1, 1, 1), tiler_mn=(64, n),
            a_source=warpgroup.OperandSource.RMEM if a_source == "rmem" else warpgroup.OperandSource.SMEM)
        self.mma_s = mma(cute.nvgpu.OperandMajorMode.K, tm, "smem")  # S^T, dP^T (64 keys x tm)
        self.mma_kv = mma(cute.nvgpu.OperandMajorMode.MN, d, "rmem")  # dV, dK (64 keys x D)
        self.mma_dq = mma(cute.nvgpu.OperandMajorMode.MN, self.dq_cols, "smem_mn")  # dQ tile
        self.sdO_layout = self.sQ_layout

    @cute.jit
    def __call__(self, mQ, mK, mV, mdO, mLSE, mD, mdQ, mdK, mdV, mCuSeqlensQ, mCuSeqlensK, mSem,
                 mdKV, scale_log2: Float32, softcap_prescale: Float32, dk_scale: Float32,
                 window_left: Int32, window_right: Int32, max_seqlen_k: Int32, l2_group: Int32,
                 max_ctas: Int32, kv_splits: Int32, stream):
        cfg = self.config
        self.dtype = mQ.element_type
        varlen = const_expr(cfg.varlen)
        modes = [0, 2, 1] if varlen else [1, 3, 2, 0]  # (rows, D, H[, B])
        q, k, v, do = (_select(t, modes) for t in (mQ, mK, mV, mdO))
        dk, dv = _select(mdK, modes), _select(mdV, modes)
        row_modes = [1, 0] if varlen else [2, 1, 0]  # (rows, H[, B])
        lse, dsum = _select(mLSE, row_modes), _select(mD, row_modes)
        d, tm, tn, st = self.head_dim, self.tile_m, self.tile_n, cfg.stages
        self._tiles(d, tm, tn, st)
        load = cpasync.CopyBulkTensorTileG2SOp()
        one_stage = cute.slice_(self.sQ_layout, (None, None, 0))
        tma_q, tma_tensor_q = cpasync.make_tiled_tma_atom(load, q, one_stage, (tm, d))
        tma_do, tma_tensor_do = cpasync.make_tiled_tma_atom(load, do, one_stage, (tm, d))
        tma_k, tma_tensor_k = cpasync.make_tiled_tma_atom(load, k, self.sK_layout, (tn, d))
        tma_v, tma_tensor_v = cpasync.make_tiled_tma_atom(load, v, self.sK_layout, (tn, d))
        row_tile = cute.make_layout(tm)
        tma_lse, tma_tensor_lse = cpasync.make_tiled_tma_atom(load, lse, row_tile, (tm,))
        tma_dsum, tma_tensor_dsum = cpasync.make_tiled_tma_atom(load, dsum, row_tile, (tm,))
        store = cpasync.CopyBulkTensorTileS2GOp()
        tma_dk, tma_tensor_dk = cpasync.make_tiled_tma_atom(store, dk, self.sK_layout, (tn, d))
        tma_dv, tma_tensor_dv = cpasync.make_tiled_tma_atom(store, dv, self.sK_layout, (tn, d))
        self.qdo_bytes = 2 * cute.size_in_bytes(self.dtype, one_stage) + 2 * tm * 4
        if const_expr(self.do_stages > 0):  # Q and its LSE; dO and its D on their own
            self.qdo_bytes = self.qdo_bytes // 2
        do_st = self.do_buffers
        self.kv_bytes = 2 * cute.size_in_bytes(self.dtype, self.sK_layout)

        @cute.struct
        class Storage:
            bar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            bar_qdo: cute.struct.MemRange[cutlass.Int64, st * 2]
            bar_do: cute.struct.MemRange[cutlass.Int64, do_st * 2]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, tm * st], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, tm * do_st], 128]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.sK_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.sdS_layout)], 1024]
            # one fp32 dQ tile per dQ warpgroup, its fragment in thread order (dq_accum.py)
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, self.dq_wgs * self.dq_tile], 1024]

        self.storage = Storage
        heads, heads_kv = q.shape[2], k.shape[2]
        batches = mCuSeqlensQ.shape[0] - 1 if const_expr(varlen) else q.shape[3]
        blocks = cute.ceil_div(max_seqlen_k, tn)
        grid = (cutlass.min(blocks * heads_kv * kv_splits * batches, max_ctas), 1, 1)
        self.kernel(
            tma_q, tma_tensor_q, tma_do, tma_tensor_do, tma_k, tma_tensor_k, tma_v, tma_tensor_v,
            tma_lse, tma_tensor_lse, tma_dsum, tma_tensor_dsum, mdQ,
            # dK and dV: the tensors (varlen's partial blocks) and their TMA stores
            (dk, dv, tma_dk, tma_tensor_dk, tma_dv, tma_tensor_dv), mCuSeqlensQ, mCuSeqlensK,
            mSem, mdKV, q.shape[0], k.shape[0], heads, heads_kv, scale_log2,
            softcap_prescale, dk_scale, window_left, window_right, blocks, batches, l2_group,
            kv_splits,
            self.sQ_layout, self.sK_layout, self.sdS_layout, self.sdO_layout, self.mma_s,
            self.mma_kv, self.mma_dq,
        ).launch(grid=grid, block=[384, 1, 1], min_blocks_per_mp=1, stream=stream)

    # ------------------------------------------------------------------ device side

    @cute.kernel
    def kernel(self, tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV, tma_lse, mLSE, tma_dsum, mD,
               mdQ, kv_out, mCuSeqlensQ, mCuSeqlensK, mSem, mdKV, seqlen_q_static: Int32,
               seqlen_k_static: Int32, heads: Int32, heads_kv: Int32, scale_log2: Float32,
               softcap_prescale: Float32, dk_scale: Float32, window_left: Int32,
               window_right: Int32, blocks: Int32, batches: Int32, l2_group: Int32,
               kv_splits: Int32,
               sQ_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sdS_layout: cute.ComposedLayout,
               sdO_layout: cute.ComposedLayout,
               mma_s: cute.TiledMma, mma_kv: cute.TiledMma, mma_dq: cute.TiledMma):
        cfg = self.config
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            for atom in (tma_q, tma_do, tma_k, tma_v, tma_lse, tma_dsum):
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
        pipe_do = None
        if const_expr(self.do_stages > 0):
            pipe_do = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.bar_do.data_ptr(), num_stages=self.do_stages,
                producer_group=producer, consumer_group=consumers, tx_count=self.qdo_bytes,
                defer_sync=True)
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sdQ = storage.sdQ.get_tensor(cute.make_layout(self.dq_wgs * self.dq_tile))
        sLSE = storage.sLSE.get_tensor(cute.make_layout((self.tile_m, cfg.stages)))
        sD = storage.sD.get_tensor(cute.make_layout((self.tile_m, self.do_buffers)))
        if const_expr(self.persistent):
            # dK and dV staged for their TMA stores over dS's tiles and the dQ tiles (K's layout;
            # both at least as large), so K and V can take the next tile's blocks meanwhile
            kv_out = kv_out + (
                storage.sdS.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
                storage.sdQ.get_tensor(sK_layout.outer, swizzle=sK_layout.inner, dtype=self.dtype))

        # (key blocks, kv heads, sequences, pair group, CTAs per kv head's group), the query
        # heads, the sequences' lengths, the window
        schedule = (blocks, heads_kv, batches, l2_group, kv_splits, heads, seqlen_q_static,
                    seqlen_k_static, mCuSeqlensQ, mCuSeqlensK, window_left, window_right)
        pipeline_init_wait(cluster_shape_mn=(1, 1))

        if tidx < 128:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp == 0:
                self.load(tma_q, tma_do, tma_k, tma_v, tma_lse, tma_dsum, mQ, mdO, mK, mV,
                          mLSE, mD, sQ, sdO, sK, sV, sLSE, sD, pipe_kv, pipe_qdo, pipe_do, schedule)
            elif warp == REDUCE_WARP:
                self.reduce_dq(mdQ, sdQ, mSem, schedule, mdKV, (sQ, sdO, sK, sV))
        else:
            cute.arch.setmaxregister_increase(MMA_REGISTERS)
            # the split count: a kernel parameter, not a register held over the walk
            self.mma_tiles(mma_s, mma_kv, mma_dq, sQ, sdO, sK, sV, sdS, sdQ, sLSE, sD,
                           kv_out + (kv_splits,), pipe_kv, pipe_qdo, pipe_do, schedule,
                           scale_log2, softcap_prescale, dk_scale, tidx - 128)

    def pipeline_states(self, user):
        """The K / V, Q (and dO where dO has stages of its own) pipelines' first states for the
        producer or the consumers (``user``)."""
        return tuple(pipeline.make_pipeline_state(user, n)
                     for n in (1, self.config.stages, max(self.do_stages, 1)))

    def tile_count(self, schedule):
        """Tiles (key blocks of every kv head and sequence, ``kv_splits`` per kv head) in the
        grid: a CTA takes those from its block index on, every grid-size-th (one unless
        persistent)."""
        blocks, heads_kv, batches, l2_group, kv_splits = schedule[:5]
        if const_expr(self.splits_kv):
            heads_kv = heads_kv * kv_splits
        return blocks * heads_kv * batches

    @cute.jit
    def tile_work(self, tile, schedule):
        """(work, inside): the walk of linear tile ``tile`` (``seq, n_block, head_kv, batch,
        head0, m_min, m_max, steps``: its query heads from ``head0`` on) and whether
        its key block starts inside its sequence (varlen: blocks past a sequence's end are
        skipped). With ``kv_splits`` > 1 a kv head's group of query heads is cut into that many
        runs of ceil(group / kv_splits) heads (the last one shorter), a tile each: the tile
        coordinates' kv head is then (kv head, run)."""
        (blocks, heads_kv, batches, l2_group, kv_splits, heads, seqlen_q_static,
         seqlen_k_static, cu_q, cu_k, window_left, window_right) = schedule
        runs = heads_kv * kv_splits if const_expr(self.splits_kv) else heads_kv
        n_block, run, batch = self.tile_coords(tile, blocks, runs, batches, l2_group)
        seq = Sequence(batch, seqlen_q_static, seqlen_k_static, cu_q, cu_k)
        group = heads // heads_kv
        head_kv, head0, count = run, run * group, group
        if const_expr(self.splits_kv):
            head_kv = run // kv_splits
            per_run = cute.ceil_div(group, kv_splits)
            first = (run - head_kv * kv_splits) * per_run
            head0, count = head_kv * group + first, cutlass.min(per_run, group - first)
        m_min, m_max = self.query_blocks(seq, n_block, window_left, window_right)
        steps = count * cutlass.max(m_max - m_min, 0)
        work = (seq, n_block, head_kv, batch, head0, m_min, m_max, steps)
        return work, n_block * self.tile_n < seq.seqlen_k

    @cute.jit
    def tile_coords(self, tile, blocks, heads_kv, batches, l2_group):
        """(key block, key / value head, sequence) of linear tile ``tile`` of (key blocks, kv
        heads, sequences). Without a mask, each (head, sequence) pair's key blocks in turn: the
        CTAs that run together share the pair's Q and dO in the L2. With one (fixed lengths), the
        low key blocks' walks are the longest (all query blocks past their diagonal, over the
        group's query heads), so the pairs' longest walks would start last and run alone at
        the end: the CTAs go in groups of ``l2_group`` pairs (as many as have their Q and dO
        fit in the L2 together), key block by key block over a group's pairs, longest walks
        first. Not with ``deterministic``, whose adds wait for the higher key blocks
        (``_rank``): those must not be the CTAs still waiting for an SM."""
        cfg = self.config
        if const_expr(cfg.local and not cfg.deterministic and not cfg.varlen):
            return grouped_rank(tile, blocks, heads_kv, batches, l2_group)
        pair = tile // blocks
        batch = pair // heads_kv
        return tile - pair * blocks, pair - batch * heads_kv, batch

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
        """One head of one sequence: (rows, D) of a Q-like tensor, (rows,) of the LSE or D
        (varlen: sequence b's LSE / D rows start at ``padded_row_offset``)."""
        if const_expr(self.config.varlen):
            if const_expr(cute.rank(t) == 2):
                return cute.domain_offset((padded_row_offset(offset, batch),), t[None, head])
            return cute.domain_offset((offset, 0), t[None, None, head])
        if const_expr(cute.rank(t) == 3):
            return t[None, head, batch]
        return t[None, None, head, batch]

    def _rotated(self) -> bool:
        """Deterministic without a mask: key block n starts its walk of every head at query
        block n (mod the count), so that the CTAs reach each query block one step apart, in
        the order its dQ is summed (``_rank``) -- no CTA waits for one that is far behind."""
        return const_expr(self.config.deterministic and not self.config.local)

    def _step(self, work, i):
        """(query head, query block) of step ``i`` of the CTA's walk, by division (the producer
        and reduce warps, with registers too few to carry the walk)."""
        seq, n_block, head_kv, batch, head0, m_min, m_max, steps = work
        count = m_max - m_min
        g = i // count
        r = i - g * count
        if const_expr(self._rotated()):
            r = (r + n_block) % count
        return head0 + g, m_min + r

    def _first_step(self, work):
        """(query head, query block, steps left in this head) of the CTA's first step: it walks
        the query blocks m_min .. m_max - 1 of each query head of its group in turn."""
        seq, n_block, head_kv, batch, head0, m_min, m_max, steps = work
        count = m_max - m_min
        m_block = m_min
        if const_expr(self._rotated()):
            m_block = m_min + n_block % count
        return head0, m_block, count

    def _next_step(self, work, head, m_block, left):
        """The step after (head, m_block), by counting (the MMA warpgroups: no division on
        their path)."""
        seq, n_block, head_kv, batch, head0, m_min, m_max, steps = work
        m_block = m_block + 1
        m_block = cutlass.select_(m_block == m_max, m_min, m_block)
        left = left - 1
        done = left == 0
        return (cutlass.select_(done, head + 1, head), m_block,
                cutlass.select_(done, m_max - m_min, left))

    @cute.jit
    def _rank(self, seq, n_block, m_block, m_min, m_max, window_right):
        """Deterministic: how many key blocks add their share of query block ``m_block``'s dQ
        before this one. Masked (causal, local): in descending key-block order, the order in
        which the CTAs reach it (a later key block starts at a later query block); unmasked:
        in the order of the rotated walks (``_rotated``), or ascending key blocks when there
        are more key blocks than query blocks."""
        tm, tn = self.tile_m, self.tile_n
        n_blocks = cute.ceil_div(seq.seqlen_k, tn)
        rank = n_block
        if const_expr(self.config.local):
            # the last key block whose walk includes m_block (query block m sees keys below
            # (m + 1) * tile_m + Sk - Sq + right)
            reach = (m_block + 1) * tm + seq.seqlen_k - seq.seqlen_q + window_right
            last = cutlass.min(cute.ceil_div(cutlass.max(reach, 1), tn), n_blocks) - 1
            rank = last - n_block
        else:
            count = m_max - m_min
            if n_blocks <= count:
                # key blocks reach m_block in the order of (m_block - n) mod count: the
                # earlier ones are n = m_block, m_block - 1, ... (cyclically) below n_blocks
                t = (m_block - m_min - n_block + count) % count
                m = m_block - m_min
                lo = m - t + 1
                rank = cutlass.max(cutlass.min(m, n_blocks - 1) - cutlass.max(lo, 0) + 1, 0)
                if lo < 0:
                    rank = rank + cutlass.max(n_blocks - (count + lo), 0)
        return rank

    @cute.jit
    def load(self, tma_q, tma_do, tma_k, tma_v, tma_lse, tma_dsum, mQ, mdO, mK, mV, mLSE, mD,
             sQ, sdO, sK, sV, sLSE, sD, pipe_kv, pipe_qdo, pipe_do, schedule):
        """Producer warp, tile after tile: K and V (once the previous tile's MMA warpgroups
        released them), then Q, dO, their LSE and D of every step (dO and D through ``pipe_do``
        where it exists)."""
        kv_state, state, do_state = self.pipeline_states(pipeline.PipelineUserType.Producer)
        for tile in range(cute.arch.block_idx()[0], self.tile_count(schedule), cute.arch.grid_dim()[0]):
            work, inside = self.tile_work(tile, schedule)
            if inside:
                kv_state, state, do_state = self.load_tile(
                    tma_q, tma_do, tma_k, tma_v, tma_lse, tma_dsum, mQ, mdO, mK, mV, mLSE, mD, sQ,
                    sdO, sK, sV, sLSE, sD, pipe_kv, pipe_qdo, pipe_do, work, kv_state, state,
                    do_state)

    @cute.jit
    def load_tile(self, tma_q, tma_do, tma_k, tma_v, tma_lse, tma_dsum, mQ, mdO, mK, mV, mLSE,
                  mD, sQ, sdO, sK, sV, sLSE, sD, pipe_kv, pipe_qdo, pipe_do, work, kv_state, state,
                  do_state):
        """The loads of one tile; returns the advanced pipeline states."""
        seq, n_block, head_kv, batch, head0, m_min, m_max, steps = work
        one = cute.make_layout(1)
        tile_kd = (self.tile_n, self.head_dim)
        gK = cute.local_tile(self._rows(mK, seq.offset_k, head_kv, batch), tile_kd, (n_block, 0))
        gV = cute.local_tile(self._rows(mV, seq.offset_k, head_kv, batch), tile_kd, (n_block, 0))
        tKsK, tKgK = cpasync.tma_partition(tma_k, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_v, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        pipe_kv.producer_acquire(kv_state)
        barrier = pipe_kv.producer_get_barrier(kv_state)
        cute.copy(tma_k, tKgK, tKsK, tma_bar_ptr=barrier)
        cute.copy(tma_v, tVgV, tVsV, tma_bar_ptr=barrier)
        kv_state.advance()
        tile_qd = (self.tile_m, self.head_dim)
        for i in range(steps):
            head, m_block = self._step(work, i)
            gQ = cute.local_tile(self._rows(mQ, seq.offset_q, head, batch), tile_qd, (m_block, 0))
            gdO = cute.local_tile(self._rows(mdO, seq.offset_q, head, batch), tile_qd, (m_block, 0))
            gL = cute.local_tile(self._rows(mLSE, seq.offset_q, head, batch), (self.tile_m,), (m_block,))
            gD = cute.local_tile(self._rows(mD, seq.offset_q, head, batch), (self.tile_m,), (m_block,))
            tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
            tOsO, tOgO = cpasync.tma_partition(tma_do, 0, one, cute.group_modes(sdO, 0, 2), cute.group_modes(gdO, 0, 2))
            tLsL, tLgL = cpasync.tma_partition(tma_lse, 0, one, cute.group_modes(sLSE, 0, 1), cute.group_modes(gL, 0, 1))
            tDsD, tDgD = cpasync.tma_partition(tma_dsum, 0, one, cute.group_modes(sD, 0, 1), cute.group_modes(gD, 0, 1))
            pipe_qdo.producer_acquire(state)
            barrier = pipe_qdo.producer_get_barrier(state)
            cute.copy(tma_q, tQgQ, tQsQ[None, state.index], tma_bar_ptr=barrier)
            cute.copy(tma_lse, tLgL, tLsL[None, state.index], tma_bar_ptr=barrier)
            do_index = state.index
            if const_expr(self.do_stages > 0):
                pipe_do.producer_acquire(do_state)
                barrier = pipe_do.producer_get_barrier(do_state)
                do_index = do_state.index
                do_state.advance()
            cute.copy(tma_do, tOgO, tOsO[None, do_index], tma_bar_ptr=barrier)
            cute.copy(tma_dsum, tDgD, tDsD[None, do_index], tma_bar_ptr=barrier)
            state.advance()
        return kv_state, state, do_state

    @cute.jit
    def reduce_dq(self, mdQ, sdQ, mSem, schedule, mdKV, kv_stage):
        """Reduce warp, tile after tile (``reduce_tile``; a split group's dK and dV after its
        last dQ tile); at the end, the last adds have read their tiles before the CTA exits."""
        for tile in range(cute.arch.block_idx()[0], self.tile_count(schedule), cute.arch.grid_dim()[0]):
            work, inside = self.tile_work(tile, schedule)
            if inside:
                self.reduce_tile(mdQ, sdQ, mSem, work, schedule[-1])
                if const_expr(self.splits_kv):
                    if schedule[4] > 1:
                        self.add_kv_sums(mdKV, kv_stage, mSem, work, schedule)
        cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def reduce_tile(self, mdQ, sdQ, mSem, work, window_right):
        """Add each step's dQ tiles (shared, fp32; one per dQ warpgroup) into the global
        accumulator, each by one 1-D bulk reduce (lane 0) as soon as its warpgroup has written
        it. Deterministic: first wait until the query block's semaphore counts this CTA's rank
        (acquire), and count it up (release) once the adds are complete, so every dQ element
        sums its key blocks in one fixed order. The tiles start each tile free; a persistent
        CTA's MMA warpgroups take the last step's release (their dV goes through the dQ
        tiles' shared memory)."""
        seq, n_block, head_kv, batch, head0, m_min, m_max, steps = work
        lane = cute.arch.lane_idx()
        full, empty = int(AttentionBwdBarrier.DQ_FULL), int(AttentionBwdBarrier.DQ_EMPTY)
        for w in cutlass.range_constexpr(self.dq_wgs):  # the tiles start free
            cute.arch.barrier_arrive(barrier_id=empty + w, number_of_threads=160)
        tile_bytes = self.dq_tile * 4
        src = sdQ.iterator.toint()
        for i in cutlass.range(steps, unroll=1):  # 24 registers: an unrolled walk spills
            head, m_block = self._step(work, i)
            if const_expr(self.config.deterministic):
                flag = mSem.iterator + ((batch * mSem.shape[1] + head) * mSem.shape[2] + m_block)
                if lane == 0:
                    rank = self._rank(seq, n_block, m_block, m_min, m_max, window_right)
                    while cute.arch.load(flag, Int32, sem="acquire", scope="gpu") != rank:
                        pass
                cute.arch.sync_warp()
            dst = chunk_address(mdQ, head, chunk_row(seq, batch, m_block, self.tile_m,
                                                      self.config.varlen))
            for w in cutlass.range_constexpr(self.dq_wgs):
                cute.arch.barrier(barrier_id=full + w, number_of_threads=160)
                bulk_reduce_add(dst + w * tile_bytes, src + w * tile_bytes, tile_bytes, lane == 0)
                cute.arch.cp_async_bulk_commit_group()
            if const_expr(self.config.deterministic):
                self.end_turn(flag)
            for w in cutlass.range_constexpr(self.dq_wgs):
                cute.arch.cp_async_bulk_wait_group(self.dq_wgs - 1 - w, read=True)
                cute.arch.barrier_arrive(barrier_id=empty + w, number_of_threads=160)

    @cute.jit
    def mma_tiles(self, mma_s, mma_kv, mma_dq, sQ, sdO, sK, sV, sdS, sdQ, sLSE, sD, kv_out,
                  pipe_kv, pipe_qdo, pipe_do, schedule, scale_log2, softcap_prescale, dk_scale,
                  tidx):
        """MMA warpgroups, tile after tile (``mma``), the pipeline states carried over."""
        window_left, window_right = schedule[-2], schedule[-1]
        kv_state, state, do_state = self.pipeline_states(pipeline.PipelineUserType.Consumer)
        for tile in range(cute.arch.block_idx()[0], self.tile_count(schedule), cute.arch.grid_dim()[0]):
            work, inside = self.tile_work(tile, schedule)
            if inside:
                kv_state, state, do_state = self.mma(
                    mma_s, mma_kv, mma_dq, sQ, sdO, sK, sV, sdS, sdQ, sLSE, sD, kv_out, pipe_kv,
                    pipe_qdo, pipe_do, work, scale_log2, softcap_prescale, dk_scale, window_left,
                    window_right, tidx, kv_state, state, do_state)

    @cute.jit
    def mma(self, mma_s, mma_kv, mma_dq, sQ, sdO, sK, sV, sdS, sdQ, sLSE, sD, kv_out, pipe_kv,
            pipe_qdo, pipe_do, work, scale_log2, softcap_prescale, dk_scale, window_left, window_right,
            tidx, kv_state, state, do_state):
        """One tile: 64 keys per MMA warpgroup, over every step; then dK and dV out. Returns
        the advanced pipeline states."""
        cfg = self.config
        seq, n_block, head_kv, batch, head0, m_min, m_max, steps = work
        wg = cute.arch.make_warp_uniform(tidx // 128)
        d, tm, st = self.head_dim, self.tile_m, cfg.stages
        sK_w = cute.local_tile(sK, (64, d), (wg, 0))
        sV_w = cute.local_tile(sV, (64, d), (wg, 0))
        sQt = _transposed(sQ, (d, tm, st), (1, 0, 2))  # (D, queries): N-major B operands
        sdOt = _transposed(sdO, (d, tm, st), (1, 0, 2))
        sKt = _transposed(sK, (d, self.tile_n), (1, 0))  # (D, keys)
        s_ops, kv_ops, dq_ops = mma_s.get_slice(0), mma_kv.get_slice(0), mma_dq.get_slice(0)
        tSrK = mma_s.make_fragment_A(s_ops.partition_A(sK_w))
        tSrQ = mma_s.make_fragment_B(s_ops.partition_B(sQ))
        tPrV = mma_s.make_fragment_A(s_ops.partition_A(sV_w))
        tPrdO = mma_s.make_fragment_B(s_ops.partition_B(sdO))
        tVrdO = mma_kv.make_fragment_B(kv_ops.partition_B(sdOt))
        tKrQ = mma_kv.make_fragment_B(kv_ops.partition_B(sQt))
        tVrP = mma_kv.make_fragment_A(kv_ops.partition_shape_A((64, tm)))
        tKrdS = mma_kv.make_fragment_A(kv_ops.partition_shape_A((64, tm)))
        dq_wg = wg if const_expr(self.dq_wgs == 2) else 0  # this warpgroup's dQ tile
        sdS_dq, k_cols = sdS, dq_wg  # dS rows and K^T column block of that tile
        if const_expr(self.dq_by_rows):
            sdS_dq, k_cols = cute.local_tile(sdS, (64, self.tile_n, st), (dq_wg, 0, 0)), 0
        tQrdS = mma_dq.make_fragment_A(dq_ops.partition_A(sdS_dq))
        tQrK = mma_dq.make_fragment_B(dq_ops.partition_B(
            cute.local_tile(sKt, (self.dq_cols, self.tile_n), (k_cols, 0))))
        acc_dv = cute.make_rmem_tensor(kv_ops.partition_shape_C((64, d)), Float32)
        acc_dk = cute.make_rmem_tensor(kv_ops.partition_shape_C((64, d)), Float32)
        acc_dv.fill(0.0)
        acc_dk.fill(0.0)
        thr_s = mma_s.get_slice(tidx % 128)
        # This thread's positions: S^T rows (keys) and columns (queries); its columns' LSE and
        # D (a view broadcast over the keys), dS^T in shared memory, its dQ tile.
        coords = rows_cols(thr_s.partition_C(cute.make_identity_tensor((64, tm))))
        by_query = cute.make_layout((64, tm, st), stride=(0, 1, tm))
        tSsLSE = thr_s.partition_C(cute.make_tensor(sLSE.iterator, by_query))
        tSsD = thr_s.partition_C(cute.make_tensor(sD.iterator, by_query))
        # Shared-memory stores in closed form (module docstring): SW128 XORs address bits 4-6
        # with bits 7-9, a thread's column groups only change bits 4-6 (and bits >= 10), its
        # row fixes bits 7-9, so each group's address is the thread's base XOR a constant.
        lane = tidx % 4
        key = wg * 64 + coords[0, 0][0]  # this thread's first dS^T row (the second is + 8)
        ds_base = sdS.iterator.toint() + key * 128 + 4 * lane + 16 * (key % 8)
        dq_base = self.dq_store_address(sdQ, dq_wg, tidx)
        key0 = n_block * self.tile_n + wg * 64
        ds_ready = int(AttentionBwdBarrier.DS_READY)
        dq_empty, dq_full = int(AttentionBwdBarrier.DQ_EMPTY) + wg, int(AttentionBwdBarrier.DQ_FULL) + wg

        neg_inv_scale = Float32(-1.0) / scale_log2
        pipe_kv.consumer_wait(kv_state)
        head, m_block, left = self._first_step(work)
        # Whether a step's block needs masking, decided at the end of the step before (off
        # the path from S's wait to the exponentials)
        edge = self.on_edge(key0, m_block * tm, seq, window_left, window_right)
        for _ in range(steps):
            q0 = m_block * tm
            b = state.index
            pipe_qdo.consumer_wait(state)
            acc_s = cute.make_rmem_tensor(s_ops.partition_shape_C((64, tm)), Float32)
            acc_dp = cute.make_rmem_tensor(s_ops.partition_shape_C((64, tm)), Float32)
            if const_expr(self.lse_in_acc):
                lse = self.query_values(tSsLSE[None, None, None, b], acc_s)
                self.start_columns(acc_s, lse, neg_inv_scale)
            warpgroup_gemm(mma_s, acc_s, tSrK, tSrQ[None, None, None, b], not self.lse_in_acc)
            if const_expr(self.lse_in_acc):
                dsum = self.query_values(tSsD[None, None, None, b], acc_dp)
                self.start_columns(acc_dp, dsum, Float32(-1.0))
            warpgroup_gemm(mma_s, acc_dp, tPrV, tPrdO[None, None, None, b], not self.lse_in_acc)
            # The LSE and D of this thread's queries into registers while the GEMMs run (read
            # after the waits, their shared-memory latency would follow S on the critical path).
            if const_expr(not self.lse_in_acc):
                lse = self.query_values(tSsLSE[None, None, None, b], acc_s)
                dsum = self.query_values(tSsD[None, None, None, b], acc_dp)
            # P^T (while dP^T is computed), then dS^T; blocks on an edge also mask.
            self.probabilities_and_gradients(acc_s, acc_dp, coords, lse, dsum, scale_log2,
                                             softcap_prescale, key0, q0, seq, window_left,
                                             window_right, edge)
            convert_pairs(as_operand_a(acc_s), tVrP)
            warpgroup_gemm(mma_kv, acc_dv, tVrP, tVrdO[None, None, None, b], False)
            convert_pairs(as_operand_a(acc_dp), tKrdS)
            # dS^T to shared memory (this warpgroup's keys); once both halves are in, this
            # warpgroup's half of dQ = dS K over all the CTA's keys.
            self.store_ds_t(tKrdS, ds_base + b * (tm * self.tile_n * 2))
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=ds_ready, number_of_threads=256)
            if const_expr(self.dq_wgs == 2) or wg == 0:
                acc_dq = cute.make_rmem_tensor(dq_ops.partition_shape_C((64, self.dq_cols)),
                                               Float32)
                warpgroup_gemm(mma_dq, acc_dq, tQrdS[None, None, None, b], tQrK, True)
                warpgroup_gemm(mma_kv, acc_dk, tKrdS, tKrQ[None, None, None, b], False)
                warpgroup.wait_group(1)  # dV and dQ done, dK in flight
                cute.arch.barrier(barrier_id=dq_empty, number_of_threads=160)
                store_fragment(acc_dq, dq_base)
                cute.arch.fence_view_async_shared()
                cute.arch.barrier_arrive(barrier_id=dq_full, number_of_threads=160)
            else:
                warpgroup_gemm(mma_kv, acc_dk, tKrdS, tKrQ[None, None, None, b], False)
            warpgroup.wait_group(0)
            pipe_qdo.consumer_release(state)
            state.advance()
            head, m_block, left = self._next_step(work, head, m_block, left)
            edge = self.on_edge(key0, m_block * tm, seq, window_left, window_right)
        # dK, dV out (softmax scale on dK; dQ's comes with the accumulator's final scaling).
        for j in cutlass.range(cute.size(acc_dk), unroll_full=True):
            acc_dk[j] = acc_dk[j] * dk_scale
        if const_expr(self.persistent):
            # K and V are free for the next tile's loads (every GEMM on them waited for); dK and
            # dV go out through dS's and the dQ tiles' shared memory once the reduce warp's
            # last adds have read the dQ tiles.
            pipe_kv.consumer_release(kv_state)
            if const_expr(self.dq_wgs == 2) or wg == 0:
                cute.arch.barrier(barrier_id=dq_empty, number_of_threads=160)
            self.store_kv_tma(mma_kv, acc_dk, acc_dv, kv_out[6], kv_out[7], kv_out, seq,
                              head_kv, batch, n_block, wg, tidx, staged=True)
        elif const_expr(self.splits_kv):
            if kv_out[-1] > 1:  # other CTAs add to the same key block
                self.stage_kv_sums(acc_dk, acc_dv, (sQ, sdO, sK, sV), wg, tidx)
            else:
                self.store_kv_block(mma_kv, acc_dk, acc_dv, sK, sV, kv_out, seq, head_kv, batch,
                                    n_block, wg, tidx)
        else:
            self.store_kv_block(mma_kv, acc_dk, acc_dv, sK, sV, kv_out, seq, head_kv, batch,
                                n_block, wg, tidx)
        kv_state.advance()
        return kv_state, state, do_state

    @cute.jit
    def store_kv_block(self, mma_kv, acc_dk, acc_dv, sK, sV, kv_out, seq, head_kv, batch,
                       n_block, wg, tidx):
        """dK and dV of a CTA that walked its kv head's whole group: TMA stores through K's and
        V's tiles (``store_kv_tma``), or, for varlen's partial last block of a sequence (which
        a TMA store would write past), 32-bit stores from registers."""
        if const_expr(self.config.varlen):
            if (n_block + 1) * self.tile_n <= seq.seqlen_k:
                self.store_kv_tma(mma_kv, acc_dk, acc_dv, sK, sV, kv_out, seq, head_kv, batch,
                                  n_block, wg, tidx)
            else:
                tile, coord = (64, self.head_dim), (n_block * 2 + wg, 0)
                row0 = n_block * self.tile_n + wg * 64
                for acc, out in ((acc_dk, kv_out[0]), (acc_dv, kv_out[1])):
                    self.store_kv(mma_kv, acc, out, seq, head_kv, batch, tile, coord, row0, tidx)
        else:
            self.store_kv_tma(mma_kv, acc_dk, acc_dv, sK, sV, kv_out, seq, head_kv, batch, n_block,
                              wg, tidx)

    @cute.jit
    def stage_kv_sums(self, acc_dk, acc_dv, kv_stage, wg, tidx):
        """dK and dV of a CTA that walked part of its kv head's group, for the reduce warp to add
        in fp32 into their accumulators (``add_kv_sums``): each warpgroup's two fragments in
        thread order in shared memory (``kv_stage``), free once both warpgroups' GEMMs are
        done."""
        ready = int(AttentionBwdBarrier.DS_READY)
        cute.arch.barrier(barrier_id=ready, number_of_threads=256)  # every GEMM on them done
        t = tidx % 128
        store_fragment(acc_dk, self.kv_stage_address(kv_stage, wg, 0) + t * 16)
        store_fragment(acc_dv, self.kv_stage_address(kv_stage, wg, 1) + t * 16)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(barrier_id=int(AttentionBwdBarrier.KV_STAGED),
                                 number_of_threads=288)

    @cute.jit
    def add_kv_sums(self, mdKV, kv_stage, mSem, work, schedule):
        """Reduce warp: the staged dK and dV fragments (``stage_kv_sums``) added into the fp32
        accumulators (``dq_accum.py``'s layout over keys, dK's heads first; the op's finish
        pass converts them), one 1-D bulk reduce per fragment, read before the CTA exits.
        Deterministic: the runs of a key block add in run order, each waiting until the key
        block's semaphore (after the query heads' in ``mSem``) counts its run and counting it
        up once its adds are complete."""
        seq, n_block, head_kv, batch, head0 = work[:5]
        lane = cute.arch.lane_idx()
        heads_kv = mdKV.shape[0] // 2
        flag = None
        if const_expr(self.config.deterministic):
            kv_splits, heads = schedule[4], schedule[5]
            group = heads // heads_kv
            flag = mSem.iterator + ((batch * mSem.shape[1] + heads + head_kv) * mSem.shape[2]
                                    + n_block)
            if lane == 0:
                run = (head0 - head_kv * group) // cute.ceil_div(group, kv_splits)
                while cute.arch.load(flag, Int32, sem="acquire", scope="gpu") != run:
                    pass
            cute.arch.sync_warp()
        cute.arch.barrier(barrier_id=int(AttentionBwdBarrier.KV_STAGED), number_of_threads=288)
        row = chunk_row(seq, batch, n_block, self.tile_n, self.config.varlen, keys=True)
        for w in cutlass.range_constexpr(2):
            for g in cutlass.range_constexpr(2):
                dst = chunk_address(mdKV, g * heads_kv + head_kv, row + w * 64)
                bulk_reduce_add(dst, self.kv_stage_address(kv_stage, w, g),
                                64 * self.head_dim * 4, lane == 0)
        cute.arch.cp_async_bulk_commit_group()
        if const_expr(self.config.deterministic):
            self.end_turn(flag)

    @cute.jit
    def end_turn(self, flag):
        """Deterministic adds: once this warp's bulk adds are complete, lane 0 counts the
        semaphore at ``flag`` up (release), handing the next adder its turn."""
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        if cute.arch.lane_idx() == 0:
            cute.arch.atomic_add(flag, Int32(1), sem="release", scope="gpu")
        cute.arch.sync_warp()

    def kv_stage_address(self, kv_stage, wg, grad):
        """Shared-memory byte address of warpgroup ``wg``'s staged dK (``grad`` 0) or dV (1)
        fragment: dK over Q's stages (warpgroup 0) or dO's (1), dV over K's tile (0) or V's (1)
        -- each exactly 64 x D fp32 (tile_m * stages = 128, tile_n = 128) or more."""
        sQ, sdO, sK, sV = kv_stage
        first, second = (sQ, sdO) if grad == 0 else (sK, sV)
        if isinstance(wg, int):
            return (first if wg == 0 else second).iterator.toint()
        return cutlass.select_(wg == 0, first.iterator.toint(), second.iterator.toint())

    @cute.jit
    def probabilities_and_gradients(self, acc_s, acc_dp, coords, lse, dsum, scale_log2,
                                    softcap_prescale, key0, q0, seq, window_left, window_right,
                                    mask):
        """P in place of the scores (the S GEMM, the next to last wgmma group, waited for
        first) and dS = P (dP - D) in place of dP (the last group), masked where this
        warpgroup's block is on an edge (``mask``: ``on_edge``). Softcap: S -> tanh(S *
        scale / cap) (P's exponent is that times cap), dP -> (dP - D) times the tanh's
        derivative, then P as without softcap and dS = P dP."""
        if const_expr(self.config.softcap):
            warpgroup.wait_group(1)
            for j in cutlass.range(cute.size(acc_s), unroll_full=True):
                acc_s[j] = cute.math.tanh(acc_s[j] * softcap_prescale, fastmath=True)
            warpgroup.wait_group(0)
            self.score_gradients(acc_s, acc_dp, dsum, softcap=True)
            self.edge_probabilities(acc_s, coords, lse, scale_log2, key0, q0, seq,
                                    window_left, window_right, mask)
            for j in cutlass.range(cute.size(acc_s), unroll_full=True):
                acc_dp[j] = acc_s[j] * acc_dp[j]
        else:
            warpgroup.wait_group(1)
            self.edge_probabilities(acc_s, coords, lse, scale_log2, key0, q0, seq,
                                    window_left, window_right, mask)
            warpgroup.wait_group(0)
            self.score_gradients(acc_s, acc_dp, dsum)

    @cute.jit
    def start_columns(self, acc, values, factor):
        """``lse_in_acc``: a score fragment set to ``factor`` times its query column's value
        before a GEMM adds to it: -LSE / scale (``lse_log2 / -scale_log2``; a row with LSE +inf
        starts at -inf, P = 0) under S^T, -D under dP^T."""
        x = rows_cols(acc)
        queries, keys = self._counts(x)
        for i in cutlass.range_constexpr(queries):
            start = values[i] * factor
            for j in cutlass.range_constexpr(keys):
                r, c = self._element(i, j)
                x[r, c] = start

    @cute.jit
    def query_values(self, view, acc):
        """Registers holding, for each query of this thread's score fragment ``acc``, its value
        in ``view`` (the fragment's partition of the stage's LSE or D, broadcast over the keys),
        loaded here."""
        x = rows_cols(view)
        queries, _ = self._counts(rows_cols(acc))
        values = cute.make_rmem_tensor(queries, Float32)
        for i in cutlass.range_constexpr(queries):
            r0, c0 = self._element(i, 0)
            values[i] = x[r0, c0]
        return values

    @cute.jit
    def store_ds_t(self, tKrdS, base):
        """This thread's dS^T (bf16 pairs of adjacent queries; packed index v1 + 2 j for key row
        + 8 v1 and query columns 8 j + 2 (lane % 4)) into the queries-contiguous dS tile: group
        j at ``base ^ 16 (j % 8)``, the second row 8 rows (1024 bytes) further; queries 64 and
        up (tile_m 128) in the second 64-query half of the tile, tile_n 128-byte key rows on."""
        packed = cute.recast_tensor(tKrdS, Int32)
        half = self.tile_n * 128
        for j in cutlass.range_constexpr(cute.size(packed) // 2):
            address = base ^ (16 * (j % 8))
            _st_shared(address, packed[2 * j], half * (j // 8))
            _st_shared(address, packed[2 * j + 1], half * (j // 8) + 1024)

    def dq_store_address(self, sdQ, dq_wg, tidx):
        """Shared-memory byte address where this thread's dQ values start (``store_fragment``):
        its warpgroup's tile, 16 bytes per thread."""
        return sdQ.iterator.toint() + dq_wg * (self.dq_tile * 4) + (tidx % 128) * 16

    @cute.jit
    def on_edge(self, key0, q0, seq, window_left, window_right):
        """Whether this warpgroup's keys x tile_m queries need any masking: past either
        sequence's end, or (``local``) not wholly inside every query's window."""
        edge = key0 + self.wg_keys > seq.seqlen_k or q0 + self.tile_m > seq.seqlen_q
        if const_expr(self.config.local):
            offset = seq.seqlen_k - seq.seqlen_q
            edge = (edge or key0 + self.wg_keys - 1 > q0 + offset + window_right
                    or key0 < q0 + self.tile_m - 1 + offset - window_left)
        return edge

    @cute.jit
    def edge_probabilities(self, acc_s, coords, lse, scale_log2, key0, q0, seq, window_left,
                           window_right, mask):
        """``probabilities``, the scores masked first where ``mask`` (a run-time flag: the
        block is on an edge) says so."""
        if mask:
            self.mask_scores(acc_s, coords, key0, q0, seq, window_left, window_right)
        self.probabilities(acc_s, lse, scale_log2)

    @cute.jit
    def mask_scores(self, acc_s, coords, key0, q0, seq, window_left, window_right):
        """-inf where key and query may not meet (past either sequence's end, or outside the
        query's window), a row at a time: the row's visible columns are one range, applied as
        32-bit keep masks (``mask.mask_columns``). Query rows past the sequence hold any finite
        LSE (TMA fills zeros past the tensor): they are masked too."""
        s = rows_cols(acc_s)
        col_offset = coords[0, 0][1]
        offset = seq.seqlen_k - seq.seqlen_q
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            if const_expr(self.queries_on_rows):  # a query's row of keys
                q = q0 + coords[r, 0][0]
                lo, hi = Int32(0), seq.seqlen_k
                if const_expr(self.config.local):
                    lo = cutlass.max(lo, q + offset - window_left)
                    hi = cutlass.min(hi, q + offset + window_right + 1)
                hi = hi if q < seq.seqlen_q else lo
                base = key0
            else:  # a key's row of queries
                key = key0 + coords[r, 0][0]
                lo, hi = Int32(0), seq.seqlen_q
                if const_expr(self.config.local):
                    lo = cutlass.max(lo, key - offset - window_right)
                    hi = cutlass.min(hi, key - offset + window_left + 1)
                hi = hi if key < seq.seqlen_k else lo
                base = q0
            mask_columns(s[r, None], lo - base, hi - base, col_offset)

    def _element(self, query: int, key: int):
        """(row, column) in a thread's score fragment of its query index ``query`` and key
        index ``key`` (S^T: keys on rows; ``queries_on_rows``: S)."""
        return (query, key) if self.queries_on_rows else (key, query)

    def _counts(self, s: cute.Tensor):
        """(queries, keys) a thread holds in its score fragment ``s`` (rows, columns)."""
        rows, cols = cute.size(s, mode=[0]), cute.size(s, mode=[1])
        return (rows, cols) if self.queries_on_rows else (cols, rows)

    @cute.jit
    def probabilities(self, acc_s, lse, scale_log2):
        """P = exp2(S * scale * log2 e - LSE * log2 e) in place of the scores (``lse_in_acc``: the
        scores already hold the LSE's term); masked scores (-inf) give 0."""
        s = rows_cols(acc_s)
        queries, keys = self._counts(s)
        for i in cutlass.range_constexpr(queries):
            row_lse = None if const_expr(self.lse_in_acc) else lse[i]
            for j in cutlass.range_constexpr(keys):
                r, c = self._element(i, j)
                score = s[r, c]
                if const_expr(self.lse_in_acc):
                    s[r, c] = cute.math.exp2(score * scale_log2, fastmath=True)
                else:
                    s[r, c] = cute.math.exp2(score * scale_log2 - row_lse, fastmath=True)

    @cute.jit
    def score_gradients(self, acc_x, acc_dp, dsum, softcap: cutlass.Constexpr = False):
        """dS = P (dP - D) in place of dP, ``acc_x`` holding P (``lse_in_acc``: dP already holds
        dP - D); with ``softcap``, (dP - D) (1 - T^2) instead, ``acc_x`` holding T = tanh(S *
        scale / cap) (finite): the capped score's derivative (P is applied afterwards)."""
        x, dp = rows_cols(acc_x), rows_cols(acc_dp)
        queries, keys = self._counts(x)
        for i in cutlass.range_constexpr(queries):
            row_d = None if const_expr(self.lse_in_acc and not softcap) else dsum[i]
            for j in cutlass.range_constexpr(keys):
                r, c = self._element(i, j)
                if const_expr(softcap):
                    dp[r, c] = (dp[r, c] - row_d) * (Float32(1.0) - x[r, c] * x[r, c])
                elif const_expr(self.lse_in_acc):
                    dp[r, c] = x[r, c] * dp[r, c]
                else:
                    dp[r, c] = x[r, c] * (dp[r, c] - row_d)

    @cute.jit
    def store_kv_tma(self, mma_kv, acc_dk, acc_dv, sK, sV, kv_out, seq, head_kv, batch, n_block,
                     wg, tidx, staged: cutlass.Constexpr = False):
        """dK and dV of the CTA's key block out through shared memory (``sK`` and ``sV``: K's
        and V's tiles, free once both warpgroups' last GEMMs are done; ``staged``: the
        persistent CTA's staging tiles, free again for the next tile once the stores have read
        them) and one TMA store each, rows past the tensor's end clipped by the TMA."""
        tma_dk, mdK, tma_dv, mdV = kv_out[2:6]
        d, tn = self.head_dim, self.tile_n
        ready = int(AttentionBwdBarrier.DS_READY)
        cute.arch.barrier(barrier_id=ready, number_of_threads=256)  # every GEMM on K, V done
        thr = mma_kv.get_slice(tidx % 128)
        for acc, s in ((acc_dk, sK), (acc_dv, sV)):
            out = cute.make_rmem_tensor(acc.shape, self.dtype)
            convert_pairs(acc, out)
            cute.autovec_copy(out, thr.partition_C(cute.local_tile(s, (64, d), (wg, 0))))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=ready, number_of_threads=256)
        if cute.arch.make_warp_uniform(tidx // 32) == 0:
            one = cute.make_layout(1)
            for tma, m, s in ((tma_dk, mdK, sK), (tma_dv, mdV, sV)):
                rows = self._rows(m, seq.offset_k, head_kv, batch)
                g = cute.local_tile(rows, (tn, d), (n_block, 0))
                ts, tg = cpasync.tma_partition(tma, 0, one, cute.group_modes(s, 0, 2),
                                               cute.group_modes(g, 0, 2))
                cute.copy(tma, ts, tg)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        if const_expr(staged):
            cute.arch.barrier(barrier_id=ready, number_of_threads=256)

    @cute.jit
    def store_kv(self, mma_kv, acc, mOut, seq, head_kv, batch, tile, coord, row0, tidx):
        """This warpgroup's ``tile`` of dK or dV (at tile coordinate ``coord``, first key row
        ``row0``), in the output dtype, rows past the sequence left alone. A thread holds
        pairs of adjacent columns: one 32-bit store each."""
        out = cute.make_rmem_tensor(acc.shape, self.dtype)
        convert_pairs(acc, out)
        rows = self._rows(mOut, seq.offset_k, head_kv, batch)
        g = cute.local_tile(rows, tile, coord)
        thr = mma_kv.get_slice(tidx % 128)
        tg = cute.recast_tensor(thr.partition_C(g), Int32)
        pairs = cute.recast_tensor(out, Int32)
        tc = thr.partition_C(cute.make_identity_tensor(tile))
        rows_left = seq.seqlen_k - row0
        for j in cutlass.range(cute.size(pairs), unroll_full=True):
            if tc[2 * j][0] < rows_left:
                tg[j] = pairs[j]
