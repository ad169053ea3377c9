"""The attention backward's row passes around the main kernel, for Hopper (sm_90a): one launch
before it and one after.

- ``BwdPrepareSm90`` (before): for every (token, head) row, D = rowsum(dO * O) in fp32 and the
  row's LSE in log2 units (+inf where the LSE is -inf: a row that saw no key), both written
  where the main kernel reads them (rows of a head contiguous, a padded row stride); and the
  fp32 dQ accumulator zeroed, each CTA an equal share of its head's accumulator rows.
  A CTA owns ``rows`` consecutive tokens of one (sequence, head); ``threads_per_row`` consecutive
  threads share a row, each moving 8 values (16 bytes of O / dO) per access, and every thread
  issues its loads for all its rows before it reduces any of them (the row sum by warp
  shuffles), so a thread keeps ``passes`` rows of bytes in flight.
- ``BwdFinishSm90`` (after): dQ = scale * accumulator, converted to dQ's dtype (and the same
  for dK and dV where a split query-head group added them up: blocks of keys for queries). A
  CTA owns one query block of one (sequence, head): its 128 threads load the block's
  accumulator with 16-byte loads (thread t the values MMA thread t added: ``dq_accum.py``),
  write the scaled and converted pairs to their rows of a shared tile, and store the tile's
  rows with 16-byte stores, rows past the sequence left alone.

Tensors (B, S, H, D) for O, dO and dQ (varlen: B = 1, S = the packed tokens), (B, H, S) fp32
for the LSE, its log2 copy and D, all with dynamic strides but a unit last one; the
accumulator (H, R, D) fp32, contiguous (``dq_accum.py``).

Constraints:
  - O, dO and dQ bf16 or fp16; head dim D static per compiled kernel (64, 96, 128, 192, 256),
    rows and batch strides multiples of 8 elements, data on 16 bytes
  - varlen (``cu_seqlens``, int32): O, dO (1, total, H, D), the LSE (1, H, total), its log2
    copy and D (1, H, padded rows): sequence b's rows from ``padded_row_offset``, the tensor at
    least ``total + 4 * batches`` rows wide (the rows between sequences are zeroed)
  - the finish pass's ``tile_m`` and ``varlen`` those of the main kernel that filled the
    accumulator
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..primitives.reduce import add, shuffle_combine
from .bwd_sm90 import padded_row_offset
from .dq_accum import THREADS as WG_THREADS
from .dq_accum import (WG_ROWS, chunk_address, chunk_row, dq_split, dq_warpgroups, fragment_col,
                       fragment_row)
from .mask import Sequence

LOG2_E = math.log2(math.e)
VEC = 8  # values per thread access
THREADS = 128


@dataclass(frozen=True)
class BwdRowsConfig:
    """Compile-time configuration of the prepare pass."""

    head_dim: int
    varlen: bool = False  # packed sequences (``cu_seqlens``)

    label_fields = ("head_dim", "varlen")  # in ``label`` (the self-check's table)

    @property
    def threads_per_row(self) -> int:
        """Threads sharing a row: the row's 16-byte vectors rounded up to a power of two."""
        return 1 << (-(-self.head_dim // VEC) - 1).bit_length()

    @property
    def passes(self) -> int:
        """Rows each thread loads before reducing any (bytes in flight per thread)."""
        return 4

    @property
    def rows(self) -> int:
        """Tokens per CTA."""
        return THREADS // self.threads_per_row * self.passes

    @property
    def label(self) -> str:
        return f"d{self.head_dim}{' varlen' if self.varlen else ''}"


def _vector(t: cute.Tensor, batch, token, head, vector) -> cute.Tensor:
    """8 values, vector ``vector`` of row (batch, token, head) of a (B, S, H, D) tensor."""
    return cute.local_tile(t[batch, token, head, None], (VEC,), (vector,))


class BwdPrepareSm90:
    """D, the LSE in log2 units and a zeroed dQ accumulator. See the module docstring."""

    tensor_cores = False  # plain vector loads and shuffles (the self-check's table)

    def __init__(self, config: BwdRowsConfig):
        self.config = config

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
                 mD: cute.Tensor, mAcc: cute.Tensor, mCuSeqlens: cute.Tensor | None,
                 max_tokens: Int32, stream):
        batches = mCuSeqlens.shape[0] - 1 if const_expr(self.config.varlen) else mO.shape[0]
        self.kernel(mO, mdO, mLSE, mLSE2, mD, mAcc, mCuSeqlens).launch(
            grid=[cute.ceil_div(max_tokens, self.config.rows), mO.shape[2], batches],
            block=[THREADS, 1, 1], stream=stream)

    @cute.jit
    def _inside(self, token, tokens, vector):
        """Is this thread's vector of row ``token`` in the tensor? (Rows of head dims that are
        not a power of two leave the last threads of a row without a vector.)"""
        if const_expr(self.config.threads_per_row * VEC == self.config.head_dim):
            return token < tokens
        return token < tokens and vector * VEC < self.config.head_dim

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
               mD: cute.Tensor, mAcc: cute.Tensor, mCuSeqlens: cute.Tensor | None):
        cfg = self.config
        tidx, _, _ = cute.arch.thread_idx()
        block, head, batch = cute.arch.block_idx()
        blocks, _, batches = cute.arch.grid_dim()
        per_pass = THREADS // cfg.threads_per_row
        token0 = block * cfg.rows + tidx // cfg.threads_per_row
        vector = tidx % cfg.threads_per_row
        # where this sequence's tokens are read (row_batch, first) and its statistics go
        # (first_row): varlen packs the tokens and pads the statistics' rows
        row_batch, first, first_row, tokens = batch, Int32(0), Int32(0), mO.shape[1]
        if const_expr(cfg.varlen):
            row_batch, first = 0, mCuSeqlens[batch]
            tokens = mCuSeqlens[batch + 1] - first
            first_row = padded_row_offset(first, batch)
        passes = const_expr(cfg.passes)
        o = cute.make_rmem_tensor((VEC, passes), mO.element_type)
        do = cute.make_rmem_tensor((VEC, passes), mdO.element_type)
        o.fill(0.0)
        do.fill(0.0)
        for p in cutlass.range_constexpr(passes):  # every load in flight before any sum
            token = token0 + p * per_pass
            if self._inside(token, tokens, vector):
                cute.autovec_copy(_vector(mO, row_batch, first + token, head, vector), o[None, p])
                cute.autovec_copy(_vector(mdO, row_batch, first + token, head, vector), do[None, p])
        self.zero_accumulator(mAcc, head, batch * blocks + block, blocks * batches, tidx)
        for p in cutlass.range_constexpr(passes):
            token = token0 + p * per_pass
            dot = Float32(0.0)
            for i in cutlass.range_constexpr(VEC):
                dot = dot + Float32(o[i, p]) * Float32(do[i, p])
            (dot,) = shuffle_combine((dot,), add, cfg.threads_per_row)
            if token < tokens and vector == 0:
                mD[row_batch, head, first_row + token] = dot
                lse = mLSE[row_batch, head, first + token]
                mLSE2[row_batch, head, first_row + token] = cutlass.select_(
                    lse == -Float32.inf, Float32.inf, lse * LOG2_E)
        if const_expr(cfg.varlen):
            self.zero_gap(mLSE2, mD, mCuSeqlens, batch, head, first_row + tokens, block, tidx)

    @cute.jit
    def zero_gap(self, mLSE2, mD, mCuSeqlens, batch, head, gap, block, tidx):
        """Varlen: zero the rows between this sequence's last statistics row and the next
        sequence's first (after the last sequence: up to the tensor's width). The main kernel
        reads them as masked rows past a sequence, so they must not be NaN; at most 10 rows
        (``padded_row_offset``'s rounding and the launcher's width)."""
        end = mLSE2.shape[2]
        if batch + 1 < mCuSeqlens.shape[0] - 1:
            end = padded_row_offset(mCuSeqlens[batch + 1], batch + 1)
        if block == 0 and tidx < 16 and gap + tidx < end:
            mLSE2[0, head, gap + tidx] = Float32(0.0)
            mD[0, head, gap + tidx] = Float32(0.0)

    @cute.jit
    def zero_accumulator(self, mAcc: cute.Tensor, head, share, shares, tidx):
        """Share ``share`` of ``shares`` equal ranges of head ``head``'s accumulator rows set
        to zero, 16 bytes per store."""
        rows = mAcc.shape[1]
        per = cute.ceil_div(rows, shares)
        first = share * per
        end = cutlass.min(first + per, rows)
        vectors = const_expr(self.config.head_dim // 4)
        zeros = cute.make_rmem_tensor((4,), Float32)
        zeros.fill(0.0)
        for u in cutlass.range(tidx, per * vectors, THREADS, unroll=2):
            row = first + u // vectors
            if row < end:
                dst = cute.local_tile(mAcc[head, row, None], (4,), (u % vectors,))
                cute.autovec_copy(zeros, dst)


@dataclass(frozen=True)
class BwdFinishConfig:
    """Compile-time configuration of the finish pass: the main kernel's head dim, query block
    and varlen-ness (the accumulator's layout, ``dq_accum.py``)."""

    head_dim: int
    tile_m: int
    varlen: bool = False

    label_fields = ("head_dim", "tile_m", "varlen")

    @property
    def label(self) -> str:
        return f"d{self.head_dim} m{self.tile_m}{' varlen' if self.varlen else ''}"


class BwdFinishSm90:
    """dQ = scale * accumulator in dQ's dtype. See the module docstring."""

    tensor_cores = False

    def __init__(self, config: BwdFinishConfig):
        self.config = config
        self.by_rows, self.cols = dq_split(config.head_dim, config.tile_m)
        # tiles of 64 rows each (two at 128 rows: dQ at head dim 64, dK and dV), or of columns
        self.wgs = 2 if self.by_rows else dq_warpgroups(config.head_dim)
        self.quads = WG_ROWS * self.cols // 4 // WG_THREADS  # 16-byte loads per thread and tile
        self.pad = 8  # bf16 / fp16 values after each row of the shared tile: no bank conflicts

    @cute.jit
    def __call__(self, mAcc: cute.Tensor, mdQ: cute.Tensor, scale: Float32,
                 mCuSeqlensQ: cute.Tensor | None, max_seqlen_q: cutlass.Int32, stream):
        cfg = self.config
        batches = mCuSeqlensQ.shape[0] - 1 if const_expr(cfg.varlen) else mdQ.shape[0]
        self.dtype = mdQ.element_type

        @cute.struct
        class Storage:
            tile: cute.struct.Align[cute.struct.MemRange[
                self.dtype, cfg.tile_m * (cfg.head_dim + self.pad)], 16]

        self.storage = Storage
        self.kernel(mAcc, mdQ, scale, mCuSeqlensQ).launch(
            grid=[cute.ceil_div(max_seqlen_q, cfg.tile_m), mdQ.shape[2], batches],
            block=[WG_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mAcc: cute.Tensor, mdQ: cute.Tensor, scale: Float32,
               mCuSeqlensQ: cute.Tensor | None):
        cfg = self.config
        d, tm = cfg.head_dim, cfg.tile_m
        t, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seq = Sequence(batch, mdQ.shape[1], mdQ.shape[1], mCuSeqlensQ, None)
        rows = seq.seqlen_q - m_block * tm
        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        tile = storage.tile.get_tensor(cute.make_layout((tm, d), stride=(d + self.pad, 1)))
        if rows > 0:
            start = chunk_address(mAcc, head, chunk_row(seq, batch, m_block, tm, cfg.varlen))
            src = cute.make_tensor(
                cute.make_ptr(Float32, start, cute.AddressSpace.gmem, assumed_align=16),
                cute.make_layout((4, WG_THREADS, self.quads, self.wgs),
                                 stride=(1, 4, 4 * WG_THREADS, WG_ROWS * self.cols)))
            acc = cute.make_rmem_tensor((4, self.quads, self.wgs), Float32)
            for w in cutlass.range_constexpr(self.wgs):  # every load in flight first
                for k in cutlass.range_constexpr(self.quads):
                    cute.autovec_copy(src[None, t, k, w], acc[None, k, w])
            out = cute.make_rmem_tensor((4, self.quads, self.wgs), self.dtype)
            out.store((acc.load() * scale).to(self.dtype))
            pairs = cute.recast_tensor(out, cutlass.Int32)
            tile_pairs = cute.recast_tensor(tile, cutlass.Int32)
            for w in cutlass.range_constexpr(self.wgs):
                row0 = WG_ROWS * w if const_expr(self.by_rows) else 0
                col0 = 0 if const_expr(self.by_rows) else self.cols * w
                for k in cutlass.range_constexpr(self.quads):
                    for h in cutlass.range_constexpr(2):  # values 4 k + 2 h, + 1: one row
                        v = 4 * k + 2 * h
                        r = row0 + fragment_row(t, v)
                        c = col0 + fragment_col(t, v)
                        tile_pairs[r, c // 2] = pairs[h, k, w]
            cute.arch.sync_threads()
            vectors = d // VEC
            for i in cutlass.range_constexpr(tm * vectors // WG_THREADS):
                u = t + i * WG_THREADS
                r, c = u // vectors, u % vectors
                if r < rows:
                    values = cute.make_rmem_tensor((VEC,), self.dtype)
                    cute.autovec_copy(cute.local_tile(tile[r, None], (VEC,), (c,)), values)
                    token = seq.offset_q + m_block * tm + r
                    out_batch = 0 if const_expr(cfg.varlen) else batch
                    cute.autovec_copy(values, _vector(mdQ, out_batch, token, head, c))
