"""NVFP4 -> bf16 / fp16 / fp32 values in one pass, for Hopper (sm_90a).

Each thread owns 8 codes of a row (one 32-bit load; a warp reads 128 contiguous bytes) and
writes their 8 values (one 16-byte store in bf16 / fp16: a warp writes 512 contiguous bytes);
CTAs run along a row, one row per CTA column of the grid. The codes are decoded as the skinny
GEMM does (``nvfp4_skinny_sm90.decode_word``) with their e4m3 scale (the 16-bit pair of their
32-code chunk, plain or blocked layout). With a global scale of 1 and a bf16 / fp16 output (the
W4A16 GEMM's decoded weights) the values are exact in the output dtype: the decode runs in
that dtype, one ``mul`` by 2^8 (fp16: 2^7) per pair, and byte permutes put the pairs
(c_i, c_(i+4)) in order. Otherwise each value is multiplied by ``2^8 * global_scale`` in fp32
(exact for a power-of-two global scale; else the one rounding of ``(code * scale) *
global_scale`` in fp32, as the torch rule) and rounded once to the output dtype.

Tensors: packed int32 (L, rows, K / 8); scales int16 (L, span) (pairs of e4m3 bytes, either
layout: ``nvfp4_skinny_sm90.scale_index`` and its coefficients); out (L, rows, K); global scale
fp32 (1,).

Constraints:
  - K a multiple of 32; rows of packed and out on 16 bytes; rows, K and L dynamic (K / 8192
    and L below 65536: grid dimensions)
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .nvfp4_skinny_sm90 import decode_word, interleave, scale_index, scale_pairs

THREADS = 128
OUT_DTYPES = ("bfloat16", "float16", "float32")


@cute.jit
def bf16_pair_to_f32(pair: Int32):
    """(low half, high half) of a bf16 pair as fp32 (exact)."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 t; shl.b32 t, {$r0}, 16; mov.b32 {$w0}, t;"
        " and.b32 t, {$r0}, 0xFFFF0000; mov.b32 {$w1}, t; }",
        write_only_types=[Float32, Float32], read_only_args=[pair])


@cute.jit
def unscale_pair(pair: Int32, half: cutlass.Constexpr) -> Int32:
    """A decoded pair (code * scale * 2^-8 in bf16, 2^-7 in fp16) times 2^8 (2^7): exact."""
    if cutlass.const_expr(half):
        return cute.arch.inline_ptx("{ .reg .b32 k; mov.b32 k, 0x58005800; mul.rn.f16x2 {$w0}, {$r0}, k; }",
                                    write_only_types=[Int32], read_only_args=[pair])
    return cute.arch.inline_ptx("{ .reg .b32 k; mov.b32 k, 0x43804380; mul.rn.bf16x2 {$w0}, {$r0}, k; }",
                                write_only_types=[Int32], read_only_args=[pair])


class DequantizeNvfp4Sm90:
    """See the module docstring. ``config``: the output dtype's name."""

    tensor_cores = False  # vector loads, integer decode, vector stores

    def __init__(self, config: str):
        if config not in OUT_DTYPES:
            raise ValueError(f"unsupported output dtype {config!r}; supported: {OUT_DTYPES}")
        self.config = config

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mS: cute.Tensor, mOut: cute.Tensor, mGlobal: cute.Tensor,
                 sa: Int32, sb: Int32, sc: Int32, sd: Int32, stream):
        self.kernel(mQ, mS, mOut, mGlobal, (sa, sb, sc, sd)).launch(
            grid=[mQ.shape[1], cute.ceil_div(mQ.shape[2], THREADS), mQ.shape[0]],
            block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mS: cute.Tensor, mOut: cute.Tensor, mGlobal: cute.Tensor,
               coefficients):
        tidx, _, _ = cute.arch.thread_idx()
        row, column, l = cute.arch.block_idx()
        word = column * THREADS + tidx  # codes [8 word, + 8) of the row
        if word < mQ.shape[2]:
            codes = mQ[l, row, word]
            pair = mS[l, scale_index(row, word // 4, coefficients)].to(Int32)
            shift = (word % 4) // 2 * 8  # the scale of this word's 16-code block
            out = cute.make_rmem_tensor((8,), mOut.element_type)
            if cutlass.const_expr(self.config == "float32"):
                self.scaled(codes, pair, shift, mGlobal[0], out)
            else:
                if mGlobal[0] == Float32(1.0):
                    self.exact(codes, pair, shift, out)
                else:
                    self.scaled(codes, pair, shift, mGlobal[0], out)
            store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), mOut.element_type,
                                        num_bits_per_copy=128)
            per_store = cutlass.const_expr(4 if self.config == "float32" else 8)  # values per 16 B
            for h in cutlass.range_constexpr(8 // per_store):
                cute.copy(store, cute.local_tile(out, (per_store,), (h,)),
                          cute.local_tile(mOut[l, row, None], (per_store,), (word * (8 // per_store) + h,)))

    @cute.jit
    def exact(self, codes, pair, shift, out):
        """8 values of a global scale 1 in bf16 / fp16: decoded in the output dtype."""
        half = cutlass.const_expr(self.config == "float16")
        scale = scale_pairs(pair, shift, half)[0]
        decoded = list(decode_word(codes, scale, half))
        for p in cutlass.range_constexpr(4):
            decoded[p] = unscale_pair(decoded[p], half)
        words = cute.recast_tensor(out, Int32)
        for p in cutlass.range_constexpr(2):
            # pairs (c_i, c_(i+4)), (c_(i+1), c_(i+5)) -> (c_i, c_(i+1)), (c_(i+4), c_(i+5))
            words[p] = interleave(decoded[2 * p], decoded[2 * p + 1], False)
            words[p + 2] = interleave(decoded[2 * p], decoded[2 * p + 1], True)

    @cute.jit
    def scaled(self, codes, pair, shift, global_scale, out):
        """8 values times ``2^8 * global_scale`` in fp32, one rounding to the output dtype."""
        scale = scale_pairs(pair, shift, False)[0]
        factor = global_scale * Float32(256.0)
        values = cute.make_rmem_tensor((8,), Float32)
        decoded = decode_word(codes, scale, False)
        for p in cutlass.range_constexpr(4):
            lo, hi = bf16_pair_to_f32(decoded[p])
            values[p] = lo * factor
            values[p + 4] = hi * factor
        out.store(values.load().to(out.element_type))
