"""The attention backward's row passes around the main kernel, for Hopper (sm_90a): one launch
before it and one after, each reading and writing every row once.

- ``BwdPrepareSm90`` (before): for every (token, head) row, D = rowsum(dO * O) in fp32, the
  row's LSE in log2 units (+inf where the LSE is -inf: a row that saw no key), both written
  where the main kernel reads them (rows of a head contiguous, a padded row stride), and the
  row's fp32 dQ accumulator zeroed.
- ``BwdFinishSm90`` (after): dQ = scale * accumulator, converted to dQ's dtype.

A CTA owns ``rows`` consecutive tokens of one (batch, head); ``threads_per_row`` consecutive
threads share a row, each moving 8 values (16 bytes of O / dO / dQ, 32 of the accumulator) per
access, and every thread issues its loads for all its rows before it reduces any of them (the
row sum by warp shuffles), so a thread keeps ``passes`` rows of bytes in flight.

Tensors (B, S, H, D) for O, dO, dQ and the accumulator (varlen: B = 1, S = the packed tokens),
(B, H, S) fp32 for the LSE, its log2 copy and D, all with dynamic strides but a unit last one.

Constraints:
  - O, dO and dQ bf16 or fp16; head dim D static per compiled kernel (64, 96, 128, 192, 256),
    rows and batch strides multiples of 8 elements, data on 16 bytes; the accumulator's too
    (fp32, strides multiples of 4)
  - ``with_lse`` False (varlen): only D is written (the caller lays the rows out)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from ..primitives.reduce import add, shuffle_combine

LOG2_E = math.log2(math.e)
VEC = 8  # values per thread access
THREADS = 128


@dataclass(frozen=True)
class BwdRowsConfig:
    """Compile-time configuration of a row pass."""

    head_dim: int
    with_lse: bool = True  # the prepare pass writes the LSE's log2 copy (False: varlen)

    label_fields = ("head_dim", "with_lse")  # in ``label`` (the self-check's table)

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
        return f"d{self.head_dim}{'' if self.with_lse else ' D only'}"


class _HeadRows:
    """The thread-to-row mapping the two passes share."""

    tensor_cores = False  # plain vector loads and shuffles (the self-check's table)

    def __init__(self, config: BwdRowsConfig):
        self.config = config

    def _launch(self, kernel, tokens, heads, batch, stream):
        kernel.launch(grid=[cute.ceil_div(tokens, self.config.rows), heads, batch],
                      block=[THREADS, 1, 1], stream=stream)

    def _place(self):
        """(token of pass 0, tokens per pass, vector of the row, batch, head) of this thread."""
        cfg = self.config
        tidx, _, _ = cute.arch.thread_idx()
        block, head, batch = cute.arch.block_idx()
        per_pass = THREADS // cfg.threads_per_row
        token = block * cfg.rows + tidx // cfg.threads_per_row
        vector = tidx % cfg.threads_per_row
        return token, per_pass, vector, batch, head

    @cute.jit
    def _inside(self, token, tokens, vector):
        """Is this thread's vector of row ``token`` in the tensor? (Rows of head dims that are
        not a power of two leave the last threads of a row without a vector.)"""
        if const_expr(self.config.threads_per_row * VEC == self.config.head_dim):
            return token < tokens
        return token < tokens and vector * VEC < self.config.head_dim

    @staticmethod
    def _vector(t: cute.Tensor, batch, token, head, vector) -> cute.Tensor:
        """8 values of row (batch, token, head) of a (B, S, H, D) tensor."""
        return cute.local_tile(t[batch, token, head, None], (VEC,), (vector,))


class BwdPrepareSm90(_HeadRows):
    """D, the LSE in log2 units and a zeroed dQ accumulator. See the module docstring."""

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
                 mD: cute.Tensor, mAcc: cute.Tensor, stream):
        self._launch(self.kernel(mO, mdO, mLSE, mLSE2, mD, mAcc), mO.shape[1], mO.shape[2],
                     mO.shape[0], stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor,
               mD: cute.Tensor, mAcc: cute.Tensor):
        cfg = self.config
        token0, per_pass, vector, batch, head = self._place()
        tokens = mO.shape[1]
        passes = const_expr(cfg.passes)
        o = cute.make_rmem_tensor((VEC, passes), mO.element_type)
        do = cute.make_rmem_tensor((VEC, passes), mdO.element_type)
        zeros = cute.make_rmem_tensor((VEC,), Float32)
        zeros.fill(0.0)
        o.fill(0.0)
        do.fill(0.0)
        for p in cutlass.range_constexpr(passes):  # every load in flight before any sum
            token = token0 + p * per_pass
            if self._inside(token, tokens, vector):
                cute.autovec_copy(self._vector(mO, batch, token, head, vector), o[None, p])
                cute.autovec_copy(self._vector(mdO, batch, token, head, vector), do[None, p])
                cute.autovec_copy(zeros, self._vector(mAcc, batch, token, head, vector))
        for p in cutlass.range_constexpr(passes):
            token = token0 + p * per_pass
            dot = Float32(0.0)
            for i in cutlass.range_constexpr(VEC):
                dot = dot + Float32(o[i, p]) * Float32(do[i, p])
            (dot,) = shuffle_combine((dot,), add, cfg.threads_per_row)
            if token < tokens and vector == 0:
                mD[batch, head, token] = dot
                if const_expr(cfg.with_lse):
                    lse = mLSE[batch, head, token]
                    mLSE2[batch, head, token] = cutlass.select_(
                        lse == -Float32.inf, Float32.inf, lse * LOG2_E)


class BwdFinishSm90(_HeadRows):
    """dQ = scale * accumulator in dQ's dtype. See the module docstring."""

    @cute.jit
    def __call__(self, mAcc: cute.Tensor, mdQ: cute.Tensor, scale: Float32, stream):
        self._launch(self.kernel(mAcc, mdQ, scale), mdQ.shape[1], mdQ.shape[2], mdQ.shape[0],
                     stream)

    @cute.kernel
    def kernel(self, mAcc: cute.Tensor, mdQ: cute.Tensor, scale: Float32):
        cfg = self.config
        token0, per_pass, vector, batch, head = self._place()
        tokens = mdQ.shape[1]
        passes = const_expr(cfg.passes)
        acc = cute.make_rmem_tensor((VEC, passes), Float32)
        acc.fill(0.0)
        for p in cutlass.range_constexpr(passes):
            token = token0 + p * per_pass
            if self._inside(token, tokens, vector):
                cute.autovec_copy(self._vector(mAcc, batch, token, head, vector), acc[None, p])
        for p in cutlass.range_constexpr(passes):
            token = token0 + p * per_pass
            out = cute.make_rmem_tensor((VEC,), mdQ.element_type)
            out.store((acc[None, p].load() * scale).to(mdQ.element_type))
            if self._inside(token, tokens, vector):
                cute.autovec_copy(out, self._vector(mdQ, batch, token, head, vector))
