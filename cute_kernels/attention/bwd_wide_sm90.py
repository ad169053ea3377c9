"""FlashAttention-2 backward for Hopper (sm_90a) at head dims 192 and 256.

The backward of ``bwd_sm90.py`` keeps each MMA warpgroup's dK and dV for 64 keys over all of
D in registers (D / 2 fp32 values each per thread): past D = 128 they no longer fit beside the
score fragments. Here the two MMA warpgroups split the CTA's keys and compute dK and dV
transposed, so D runs along the MMA's M (any multiple of 64) and a warpgroup's share of the
keys (32 or 48) along N:

  - One CTA per block of ``tile_n`` keys (K and V resident in shared memory), walking the
    query heads of its group and their blocks of 64 queries (``bwd_sm90.py``'s walk, masks
    and producer warp). Q and its LSE come through ``stages`` TMA pipeline stages, dO and D
    through a pipeline of their own (``do_stages`` = 1: the shared memory goes to wider key
    blocks instead).
  - Scores: S = Q K_w^T and dP = dO V_w^T for warpgroup w's tile_n / 2 keys (queries on the
    fragment's rows), P and dS = P (dP - D) in registers, both stored in bf16 / fp16 to a
    queries-contiguous (queries x keys) tile: one per Q stage where they fit, else one (and
    a 256-thread barrier before it is written again).
  - Once its own P and dS are stored (a 128-thread barrier), a warpgroup adds
    dV_w^T += dO^T P_w and dK_w^T += Q^T dS_w (D x its keys, fp32 registers: D tile_n / 256
    values each per thread), releasing dO's stage when dV's GEMM is done and Q's when dK's
    is; after a 256-thread barrier both halves of dS are in, and warpgroup w computes
    dQ = dS K for its half of D's columns into its fp32 tile (thread order, ``dq_accum.py``),
    which the reduce warp adds into the global accumulator by a 1-D bulk reduce
    (``reduce_dq``; in a fixed order with ``deterministic``). Every MMA operand comes from
    shared memory.
  - The kernel is bound by L2 throughput (Nsight Compute: 91% at 64-key blocks with two dO
    stages), and the Q / dO reads and dQ adds per FLOP shrink as the key block grows: head
    dim 192 takes 96-key blocks with two Q stages, 256 64-key blocks with one (measured
    choices: ``config.attention_bwd_config``). dQ added with atomics from registers, which
    would free its tiles' shared memory for wider blocks, ran 0.67x the TMA reduce.
  - At D = 192 the D-contiguous tiles use 32-column (64-byte swizzle) atoms, so a
    warpgroup's 96 columns of K are whole atoms of dQ's MN-major B operand.

Softcap and the masks as ``bwd_sm90.py`` (its ``probabilities_and_gradients`` and
``on_edge``, here with queries on the fragment's rows).

Constraints:
  - head dim 192 or 256; tile_m 64; tile_n 64 or 96; one or two Q stages, one dO stage;
    the tiles within the shared memory (checked when the kernel is built)
  - bf16 or fp16; strides, LSE / D rows and the dQ accumulator as ``bwd_sm90.py``
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.tensor_utils as tensor_utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import warpgroup

from ..primitives.named_barriers import AttentionBwdBarrier
from .bwd_sm90 import FlashAttnBwdSm90, _transposed
from .config import SMEM_BYTES, AttentionBwdConfig
from .dq_accum import dq_split, dq_warpgroups, store_fragment
from .fragments import convert_pairs, rows_cols, warpgroup_gemm

WIDE_HEAD_DIMS = (192, 256)
SMEM_BUDGET = SMEM_BYTES - 4096  # the tiles' share (barriers, LSE / D rows, alignment)


class FlashAttnBwdWideSm90(FlashAttnBwdSm90):
    """See the module docstring. ``__init__`` takes only the compile-time configuration."""

    def __init__(self, config: AttentionBwdConfig):
        d, tn, tm = config.head_dim, config.tile_n, config.tile_m
        if (tm != 64 or config.stages not in (1, 2) or config.do_stages != 1
                or d not in WIDE_HEAD_DIMS or tn not in (64, 96) or config.persistent):
            raise ValueError(f"unsupported backward tiles: {config}")
        self.config = config
        self.persistent = False  # one CTA per key block
        self.splits_kv = False  # a kv head's whole group per CTA (dK^T, dV^T stored directly)
        self.tile_m, self.tile_n, self.head_dim = config.tile_m, tn, d
        self.dq_wgs = dq_warpgroups(d)
        self.dq_by_rows, self.dq_cols = dq_split(d, tm)  # by columns: D / 2 each
        self.wg_keys = tn // 2
        self.queries_on_rows = True
        self.do_stages = self.do_buffers = config.do_stages
        # Shared memory: Q and dO stages, K and V, dQ's fp32 tiles, and P and dS: a buffer per
        # Q stage where that fits, else one.
        fixed = 2 * tm * d * (config.stages + self.do_stages) + 4 * tn * d + 4 * tm * d
        scores = 4 * tm * tn
        if fixed + scores > SMEM_BUDGET:
            raise ValueError(f"backward tiles past the shared memory: {config}")
        self.score_buffers = config.stages if fixed + config.stages * scores <= SMEM_BUDGET else 1

    def _tiles(self, d, tm, tn, st):
        """Shared-memory layouts and tiled MMAs (module docstring)."""
        row_major = tensor_utils.LayoutEnum.ROW_MAJOR
        # swizzle atoms no wider than a warpgroup's share of D (whole atoms of dQ's operand)
        atom_cols = next(c for c in (64, 32, 16) if (d // 2) % c == 0)
        self.sQ_layout = self._smem(self.dtype, row_major, atom_cols, (tm, d, st), (0, 1, 2))
        self.sdO_layout = self._smem(self.dtype, row_major, atom_cols, (tm, d, self.do_stages), (0, 1, 2))
        self.sK_layout = self._smem(self.dtype, row_major, atom_cols, (tn, d), (0, 1))
        # P (index 2 b) and dS (2 b + 1) of buffer b (the pipeline stage's, or the one buffer):
        # queries x keys, queries contiguous (the K-major B operand of dV^T / dK^T, the
        # MN-major A operand of dQ).
        self.sdS_layout = self._smem(self.dtype, tensor_utils.LayoutEnum.COL_MAJOR, tm,
                                     (tm, tn, 2 * self.score_buffers), (1, 0, 2))
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN

        def mma(a_major, b_major, n):
            return sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, a_major, b_major, Float32, (1, 1, 1), tiler_mn=(64, n),
                a_source=warpgroup.OperandSource.SMEM)

        self.mma_s = mma(K, K, self.wg_keys)  # S, dP: tm queries x this warpgroup's keys
        self.mma_kv = mma(MN, K, self.wg_keys)  # dV^T, dK^T: D x this warpgroup's keys
        self.mma_dq = mma(MN, MN, self.dq_cols)  # dQ: tm queries x D / 2

    @cute.jit
    def mma(self, mma_s, mma_kv, mma_dq, sQ, sdO, sK, sV, sPdS, sdQ, sLSE, sD, kv_out, pipe_kv,
            pipe_q, pipe_do, work, scale_log2, softcap_prescale, dk_scale, window_left,
            window_right, tidx, kv_state, state, do_state):
        """MMA warpgroups, one tile: scores, dK and dV for their half of the keys, dQ for their
        half of D. Returns the advanced pipeline states."""
        cfg = self.config
        seq, n_block, head_kv, batch, head0, m_min, m_max, steps = work
        wg = cute.arch.make_warp_uniform(tidx // 128)
        d, tm, tn, st, wk = self.head_dim, self.tile_m, self.tile_n, cfg.stages, self.wg_keys
        do_st, dh = self.do_stages, self.dq_cols
        s_ops, kv_ops, dq_ops = mma_s.get_slice(0), mma_kv.get_slice(0), mma_dq.get_slice(0)
        tSrQ = mma_s.make_fragment_A(s_ops.partition_A(sQ))
        tSrdO = mma_s.make_fragment_A(s_ops.partition_A(sdO))
        tSrK = mma_s.make_fragment_B(s_ops.partition_B(cute.local_tile(sK, (wk, d), (wg, 0))))
        tSrV = mma_s.make_fragment_B(s_ops.partition_B(cute.local_tile(sV, (wk, d), (wg, 0))))
        # dV^T = dO^T P_w, dK^T = Q^T dS_w: (D, queries) views of dO and Q, (keys, queries)
        # views of this warpgroup's P and dS.
        tKrdO = mma_kv.make_fragment_A(kv_ops.partition_A(_transposed(sdO, (d, tm, do_st), (1, 0, 2))))
        tKrQ = mma_kv.make_fragment_A(kv_ops.partition_A(_transposed(sQ, (d, tm, st), (1, 0, 2))))
        nb = 2 * self.score_buffers
        own = cute.local_tile(_transposed(sPdS, (tn, tm, nb), (1, 0, 2)), (wk, tm, nb), (wg, 0, 0))
        tKrPdS = mma_kv.make_fragment_B(kv_ops.partition_B(own))
        tQrdS = mma_dq.make_fragment_A(dq_ops.partition_A(sPdS))
        tQrK = mma_dq.make_fragment_B(dq_ops.partition_B(
            cute.local_tile(_transposed(sK, (d, tn), (1, 0)), (dh, tn), (wg, 0))))
        acc_dv = cute.make_rmem_tensor(kv_ops.partition_shape_C((d, wk)), Float32)
        acc_dk = cute.make_rmem_tensor(kv_ops.partition_shape_C((d, wk)), Float32)
        acc_dv.fill(0.0)
        acc_dk.fill(0.0)
        thr_s = mma_s.get_slice(tidx % 128)
        coords = rows_cols(thr_s.partition_C(cute.make_identity_tensor((tm, wk))))
        tSsLSE = thr_s.partition_C(cute.make_tensor(sLSE.iterator, cute.make_layout((tm, wk, st), stride=(1, 0, tm))))
        tSsD = thr_s.partition_C(cute.make_tensor(sD.iterator, cute.make_layout((tm, wk, do_st), stride=(1, 0, tm))))
        tSsPdS = thr_s.partition_C(cute.local_tile(sPdS, (tm, wk, nb), (0, wg, 0)))
        dq_base = self.dq_store_address(sdQ, wg, tidx)
        dq_empty = int(AttentionBwdBarrier.DQ_EMPTY) + wg
        dq_full = int(AttentionBwdBarrier.DQ_FULL) + wg
        key0 = n_block * tn + wg * wk
        ds_ready = int(AttentionBwdBarrier.DS_READY)
        own_ready = int(AttentionBwdBarrier.OWN_SCORES_READY) + wg
        scores_free = int(AttentionBwdBarrier.SCORES_FREE)

        pipe_kv.consumer_wait(kv_state)
        head, m_block, left = self._first_step(work)
        edge = self.on_edge(key0, m_block * tm, seq, window_left, window_right)  # see bwd_sm90
        for i in range(steps):
            q0 = m_block * tm
            b, db = state.index, do_state.index
            pipe_q.consumer_wait(state)
            pipe_do.consumer_wait(do_state)
            acc_s = cute.make_rmem_tensor(s_ops.partition_shape_C((tm, wk)), Float32)
            acc_dp = cute.make_rmem_tensor(s_ops.partition_shape_C((tm, wk)), Float32)
            warpgroup_gemm(mma_s, acc_s, tSrQ[None, None, None, b], tSrK, True)
            warpgroup_gemm(mma_s, acc_dp, tSrdO[None, None, None, db], tSrV, True)
            lse = self.query_values(tSsLSE[None, None, None, b], acc_s)
            dsum = self.query_values(tSsD[None, None, None, db], acc_dp)
            self.probabilities_and_gradients(acc_s, acc_dp, coords, lse, dsum, scale_log2,
                                             softcap_prescale, key0, q0, seq, window_left,
                                             window_right, edge)
            p = 2 * b if const_expr(self.score_buffers == 2) else 0
            if const_expr(self.score_buffers == 1):
                if i > 0:  # both warpgroups' GEMMs of the previous step are done
                    cute.arch.barrier(barrier_id=scores_free, number_of_threads=256)
            self.store_scores(acc_s, tSsPdS[None, None, None, p])
            self.store_scores(acc_dp, tSsPdS[None, None, None, p + 1])
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=own_ready, number_of_threads=128)
            warpgroup_gemm(mma_kv, acc_dv, tKrdO[None, None, None, db], tKrPdS[None, None, None, p], False)
            warpgroup_gemm(mma_kv, acc_dk, tKrQ[None, None, None, b], tKrPdS[None, None, None, p + 1], False)
            warpgroup.wait_group(1)  # dV done: dO's stage is free for the next step's load
            pipe_do.consumer_release(do_state)
            do_state.advance()
            warpgroup.wait_group(0)  # dK done: so is Q's (dQ reads neither)
            pipe_q.consumer_release(state)
            cute.arch.barrier(barrier_id=ds_ready, number_of_threads=256)
            acc_dq = cute.make_rmem_tensor(dq_ops.partition_shape_C((tm, dh)), Float32)
            warpgroup_gemm(mma_dq, acc_dq, tQrdS[None, None, None, p + 1], tQrK, True)
            warpgroup.wait_group(0)
            cute.arch.barrier(barrier_id=dq_empty, number_of_threads=160)
            store_fragment(acc_dq, dq_base)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=dq_full, number_of_threads=160)
            state.advance()
            head, m_block, left = self._next_step(work, head, m_block, left)
            edge = self.on_edge(key0, m_block * tm, seq, window_left, window_right)
        for j in cutlass.range(cute.size(acc_dk), unroll_full=True):
            acc_dk[j] = acc_dk[j] * dk_scale
        self.store_kv_t(mma_kv, acc_dk, kv_out[0], seq, n_block, head_kv, batch, wg, tidx)
        self.store_kv_t(mma_kv, acc_dv, kv_out[1], seq, n_block, head_kv, batch, wg, tidx)
        kv_state.advance()
        return kv_state, state, do_state

    @cute.jit
    def store_kv_t(self, mma_kv, acc, mOut, seq, n_block, head_kv, batch, wg, tidx):
        """This warpgroup's keys of dK or dV from their transposed (D x keys) fragment, in the
        output dtype, keys past the sequence left alone."""
        out = cute.make_rmem_tensor(acc.shape, self.dtype)
        convert_pairs(acc, out)
        d, tn, wk = self.head_dim, self.tile_n, self.wg_keys
        rows = self._rows(mOut, seq.offset_k, head_kv, batch)
        block = cute.local_tile(rows, (tn, d), (n_block, 0))
        mine = cute.local_tile(_transposed(block, (d, tn), (1, 0)), (d, wk), (0, wg))
        thr = mma_kv.get_slice(tidx % 128)
        tg = thr.partition_C(mine)
        tc = thr.partition_C(cute.make_identity_tensor((d, wk)))
        keys_left = seq.seqlen_k - (n_block * tn + wg * wk)
        for j in cutlass.range(cute.size(out), unroll_full=True):
            if tc[j][1] < keys_left:
                tg[j] = out[j]

    @cute.jit
    def store_scores(self, acc, tSs):
        """P or dS (fp32 fragment) to its queries-contiguous shared tile in the input dtype (one
        16-bit store per value: a thread's adjacent values are adjacent keys)."""
        values = cute.make_rmem_tensor(acc.shape, self.dtype)
        convert_pairs(acc, values)
        cute.autovec_copy(values, tSs)
