"""FlashAttention-2 backward for Hopper (sm_90a) at head dims 192 and 256.

The backward of ``bwd_sm90.py`` keeps each MMA warpgroup's dK and dV over all of D in
registers (D / 2 fp32 values each per thread): past D = 128 they no longer fit beside the
score fragments. Here the two MMA warpgroups split the head dim instead:

  - One CTA per block of 64 keys (K and V resident in shared memory), walking the query heads
    of its group and their blocks of 64 queries, Q / dO / LSE / D streamed by the producer
    warp through the same TMA pipeline as ``bwd_sm90.py`` (its ``load``, walk and masks).
  - Scores: S = Q K^T and dP = dO V^T, each warpgroup for its 32 of the CTA's keys (queries on
    the fragment's rows), P and dS = P (dP - D) in registers, then both in bf16 / fp16 to a
    shared (queries x keys) tile per pipeline stage.
  - After one 256-thread barrier, each warpgroup owns half of D's columns: dV += P^T dO and
    dK += dS^T Q over all 64 keys (fp32 registers, D / 4 values each per thread) and
    dQ = dS K for the step's queries, every operand from shared memory.
  - dQ: at D = 192 into a swizzled fp32 tile per warpgroup, added into the global fp32
    accumulator by the reduce warp's TMA bulk reduce (``reduce_dq``); at D = 256 the shared
    memory is spent (Q, dO: two stages of 32 KB each; K, V 32 KB each; P, dS 32 KB), so each
    thread adds its dQ pairs straight from registers (``red.global.add.v2.f32``).
  - At D = 192 the D-contiguous tiles use 32-column (64-byte swizzle) atoms, so a
    warpgroup's 96 columns are whole atoms of the MN-major operands.

Softcap and the masks as ``bwd_sm90.py`` (its ``probabilities``, ``score_gradients``,
``softcap_gradients`` and ``on_edge``, here with queries on the fragment's rows).

Constraints:
  - head dim 192 or 256; tile_m 64, tile_n 64, two Q / dO stages
  - bf16 or fp16; strides, LSE / D rows and the dQ accumulator as ``bwd_sm90.py``
  - ``deterministic`` only at head dim 192 (dQ's adds at 256 are atomic)
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.tensor_utils as tensor_utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from ..primitives.named_barriers import AttentionBwdBarrier
from .bwd_sm90 import FlashAttnBwdSm90, _transposed
from .config import AttentionBwdConfig
from .fragments import convert_pairs, rows_cols, warpgroup_gemm

WIDE_HEAD_DIMS = (192, 256)


@dsl_user_op
def _red_add_pair(address: Int64, first: Float32, second: Float32, *, loc=None, ip=None) -> None:
    """Atomically add two adjacent fp32 values at global byte ``address`` (8-byte aligned)."""
    llvm.inline_asm(
        None,
        [Int64(address).ir_value(loc=loc, ip=ip), Float32(first).ir_value(loc=loc, ip=ip),
         Float32(second).ir_value(loc=loc, ip=ip)],
        "red.global.add.v2.f32 [$0], {$1, $2};",
        "l,f,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


class FlashAttnBwdWideOld(FlashAttnBwdSm90):
    """See the module docstring. ``__init__`` takes only the compile-time configuration."""

    def __init__(self, config: AttentionBwdConfig):
        if (config.tile_m != 64 or config.tile_n != 64 or config.stages != 2
                or config.head_dim not in WIDE_HEAD_DIMS
                or (config.deterministic and config.head_dim == 256)):
            raise ValueError(f"unsupported backward tiles: {config}")
        self.config = config
        self.tile_m, self.tile_n, self.head_dim = config.tile_m, config.tile_n, config.head_dim
        self.dq_wgs, self.dq_cols = 2, config.head_dim // 2
        self.wg_keys = config.tile_n // 2
        self.queries_on_rows = True
        self.dq_atomic = config.head_dim == 256

    def _tiles(self, d, tm, tn, st):
        """Shared-memory layouts and tiled MMAs (module docstring)."""
        row_major = tensor_utils.LayoutEnum.ROW_MAJOR
        atom_cols = 32 if d == 192 else d  # 192: 32-column atoms (each warpgroup's 96 whole)
        self.sQ_layout = self._smem(self.dtype, row_major, atom_cols, (tm, d, st), (0, 1, 2))
        self.sK_layout = self._smem(self.dtype, row_major, atom_cols, (tn, d), (0, 1))
        # P (index 2 b) and dS (2 b + 1) of pipeline stage b: queries x keys, keys contiguous.
        self.sdS_layout = self._smem(self.dtype, row_major, tn, (tm, tn, 2 * st), (0, 1, 2))
        self.sdQ_layout = self._smem(Float32, row_major, self.dq_cols, (tm, self.dq_cols, 2),
                                     (0, 1, 2))
        self.sdQ_elems = 32 if self.dq_atomic else cute.cosize(self.sdQ_layout)
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN

        def mma(a_major, b_major, n):
            return sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, a_major, b_major, Float32, (1, 1, 1), tiler_mn=(64, n),
                a_source=warpgroup.OperandSource.SMEM)

        self.mma_s = mma(K, K, self.wg_keys)  # S, dP: tm queries x this warpgroup's keys
        self.mma_kv = mma(MN, MN, self.dq_cols)  # dV, dK: tn keys x D / 2
        self.mma_dq = mma(K, MN, self.dq_cols)  # dQ: tm queries x D / 2

    @cute.jit
    def mma(self, mma_s, mma_kv, mma_dq, sQ, sdO, sK, sV, sPdS, sdQ, sLSE, sD, mdQ, mdK, mdV,
            pipe_kv, pipe_qdo, work, scale_log2, softcap_prescale, dk_scale, window_left,
            window_right, tidx):
        """MMA warpgroups: scores for their 32 keys, gradients for their half of D."""
        cfg = self.config
        seq, n_block, head_kv, batch, group, m_min, m_max, steps = work
        wg = cute.arch.make_warp_uniform(tidx // 128)
        d, tm, tn, st, wk, dh = self.head_dim, self.tile_m, self.tile_n, cfg.stages, self.wg_keys, self.dq_cols
        s_ops, kv_ops, dq_ops = mma_s.get_slice(0), mma_kv.get_slice(0), mma_dq.get_slice(0)
        tSrQ = mma_s.make_fragment_A(s_ops.partition_A(sQ))
        tSrdO = mma_s.make_fragment_A(s_ops.partition_A(sdO))
        tSrK = mma_s.make_fragment_B(s_ops.partition_B(cute.local_tile(sK, (wk, d), (wg, 0))))
        tSrV = mma_s.make_fragment_B(s_ops.partition_B(cute.local_tile(sV, (wk, d), (wg, 0))))
        # (keys, queries) views of P and dS: the MN-major A operands of dV and dK.
        sPdSt = _transposed(sPdS, (tn, tm, 2 * st), (1, 0, 2))
        tKrPdS = mma_kv.make_fragment_A(kv_ops.partition_A(sPdSt))
        half = lambda t: cute.local_tile(t, (dh, tm, st), (wg, 0, 0))  # noqa: E731
        tKrdO = mma_kv.make_fragment_B(kv_ops.partition_B(half(_transposed(sdO, (d, tm, st), (1, 0, 2)))))
        tKrQ = mma_kv.make_fragment_B(kv_ops.partition_B(half(_transposed(sQ, (d, tm, st), (1, 0, 2)))))
        tQrdS = mma_dq.make_fragment_A(dq_ops.partition_A(sPdS))
        tQrK = mma_dq.make_fragment_B(dq_ops.partition_B(
            cute.local_tile(_transposed(sK, (d, tn), (1, 0)), (dh, tn), (wg, 0))))
        acc_dv = cute.make_rmem_tensor(kv_ops.partition_shape_C((tn, dh)), Float32)
        acc_dk = cute.make_rmem_tensor(kv_ops.partition_shape_C((tn, dh)), Float32)
        acc_dv.fill(0.0)
        acc_dk.fill(0.0)
        thr_s = mma_s.get_slice(tidx % 128)
        coords = rows_cols(thr_s.partition_C(cute.make_identity_tensor((tm, wk))))
        by_query = cute.make_layout((tm, wk, st), stride=(1, 0, tm))
        tSsLSE = thr_s.partition_C(cute.make_tensor(sLSE.iterator, by_query))
        tSsD = thr_s.partition_C(cute.make_tensor(sD.iterator, by_query))
        tSsPdS = thr_s.partition_C(cute.local_tile(sPdS, (tm, wk, 2 * st), (0, wg, 0)))
        thr_dq = mma_dq.get_slice(tidx % 128)
        if const_expr(not self.dq_atomic):
            tQsdQ = thr_dq.partition_C(sdQ[None, None, wg])
            dq_empty = int(AttentionBwdBarrier.DQ_EMPTY) + wg
            dq_full = int(AttentionBwdBarrier.DQ_FULL) + wg
        key0 = n_block * tn + wg * wk
        ds_ready = int(AttentionBwdBarrier.DS_READY)

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_kv.consumer_wait(kv_state)
        # ``state``: the step being worked on; ``held``: the oldest step whose Q / dO stage is
        # still read (the previous step's dV and dK run under this step's scores).
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, st)
        held = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, st)
        head, m_block, left = self._first_step(work)
        for i in range(steps):
            q0 = m_block * tm
            b = state.index
            pipe_qdo.consumer_wait(state)
            acc_s = cute.make_rmem_tensor(s_ops.partition_shape_C((tm, wk)), Float32)
            acc_dp = cute.make_rmem_tensor(s_ops.partition_shape_C((tm, wk)), Float32)
            warpgroup_gemm(mma_s, acc_s, tSrQ[None, None, None, b], tSrK, True)
            warpgroup_gemm(mma_s, acc_dp, tSrdO[None, None, None, b], tSrV, True)
            lse = rows_cols(tSsLSE[None, None, None, b])
            dsum = rows_cols(tSsD[None, None, None, b])
            mask = self.on_edge(key0, q0, seq, window_left, window_right)
            if const_expr(cfg.softcap):
                warpgroup.wait_group(1)
                for j in cutlass.range(cute.size(acc_s), unroll_full=True):
                    acc_s[j] = cute.math.tanh(acc_s[j] * softcap_prescale, fastmath=True)
                warpgroup.wait_group(0)
                self.softcap_gradients(acc_s, acc_dp, dsum)
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
            if i > 0:  # the previous step's GEMMs are done: its Q and dO are free
                pipe_qdo.consumer_release(held)
                held.advance()
            self.store_scores(acc_s, tSsPdS[None, None, None, 2 * b])
            self.store_scores(acc_dp, tSsPdS[None, None, None, 2 * b + 1])
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=ds_ready, number_of_threads=256)
            acc_dq = cute.make_rmem_tensor(dq_ops.partition_shape_C((tm, dh)), Float32)
            warpgroup_gemm(mma_dq, acc_dq, tQrdS[None, None, None, 2 * b + 1], tQrK, True)
            warpgroup_gemm(mma_kv, acc_dv, tKrPdS[None, None, None, 2 * b], tKrdO[None, None, None, b], False)
            warpgroup_gemm(mma_kv, acc_dk, tKrPdS[None, None, None, 2 * b + 1], tKrQ[None, None, None, b], False)
            warpgroup.wait_group(2)  # dQ done; dV and dK run on under the next step's scores
            if const_expr(self.dq_atomic):
                self.add_dq(mma_dq, acc_dq, mdQ, seq, head, batch, m_block, wg, tidx)
            else:
                cute.arch.barrier(barrier_id=dq_empty, number_of_threads=160)
                cute.autovec_copy(acc_dq, tQsdQ)
                cute.arch.fence_view_async_shared()
                cute.arch.barrier_arrive(barrier_id=dq_full, number_of_threads=160)
            state.advance()
            head, m_block, left = self._next_step(work, head, m_block, left)
        warpgroup.wait_group(0)
        if steps > 0:
            pipe_qdo.consumer_release(held)
        for j in cutlass.range(cute.size(acc_dk), unroll_full=True):
            acc_dk[j] = acc_dk[j] * dk_scale
        tile, coord, row0 = (tn, dh), (n_block, wg), n_block * tn
        self.store_kv(mma_kv, acc_dk, mdK, seq, head_kv, batch, tile, coord, row0, tidx)
        self.store_kv(mma_kv, acc_dv, mdV, seq, head_kv, batch, tile, coord, row0, tidx)

    @cute.jit
    def store_scores(self, acc, tSs):
        """P or dS (fp32 fragment) to its shared tile in the input dtype, pairs of adjacent keys
        as one 32-bit store."""
        values = cute.make_rmem_tensor(acc.shape, self.dtype)
        convert_pairs(acc, values)
        cute.autovec_copy(values, tSs)

    @cute.jit
    def add_dq(self, mma_dq, acc_dq, mdQ, seq, head, batch, m_block, wg, tidx):
        """Head dim 256: this warpgroup's dQ columns of the step's queries added into the fp32
        accumulator from registers, one ``red.global.add.v2.f32`` per pair of adjacent
        columns; rows past the sequence are skipped."""
        rows = self._rows(mdQ, seq.offset_q, head, batch)
        tile = (self.tile_m, self.dq_cols)
        thr = mma_dq.get_slice(tidx % 128)
        tg = thr.partition_C(cute.local_tile(rows, tile, (m_block, wg)))
        tc = thr.partition_C(cute.make_identity_tensor(tile))
        rows_left = seq.seqlen_q - m_block * self.tile_m
        base = tg.iterator.toint()
        for j in cutlass.range_constexpr(cute.size(acc_dq) // 2):
            if tc[2 * j][0] < rows_left:
                address = base + Int64(tg.layout(2 * j)) * 4
                _red_add_pair(address, acc_dq[2 * j], acc_dq[2 * j + 1])
