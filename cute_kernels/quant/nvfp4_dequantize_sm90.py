"""NVFP4 -> bf16 / fp16 / fp32 values in one pass, for Hopper (sm_90a).

Each thread owns 32 codes of a row (16 bytes, one vector load) and their two e4m3 scales (one
16-bit load, plain or blocked layout); it decodes them as the skinny GEMM does
(``nvfp4_skinny_sm90.decode_word``: code * scale * 2^-8, exact in bf16), multiplies by
``2^8 * global_scale`` in fp32 (exact for a power-of-two global scale; otherwise the one
rounding of ``(code * scale) * global_scale`` in fp32, as the torch rule) and stores the 32
values in the output dtype (one rounding) with 16-byte stores. With a global scale of 1 and a
bf16 / fp16 output (the W4A16 GEMM's decoded weights) the values are exact in the output dtype
already: the decode runs in that dtype, one ``mul`` by 2^8 (fp16: 2^7) per pair, and byte
permutes put the pairs (c_i, c_(i+4)) back in order -- no fp32 at all.

Tensors: packed int32 (L, rows, K / 8); scales int16 (L, span) (pairs of e4m3 bytes, either
layout: ``nvfp4_skinny_sm90.scale_index`` and its coefficients); out (L, rows, K); global scale
fp32 (1,).

Constraints:
  - K a multiple of 32; rows of packed and out on 16 bytes; rows, K and L dynamic
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .nvfp4_skinny_sm90 import decode_word, scale_index, scale_pairs

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


@cute.jit
def _pair(a: Int32, b: Int32, upper: cutlass.Constexpr) -> Int32:
    """(a's low half, b's low half), or the upper halves: pairs (c_i, c_(i+4)), (c_(i+1),
    c_(i+5)) -> (c_i, c_(i+1)) or (c_(i+4), c_(i+5))."""
    selector = 0x7632 if cutlass.const_expr(upper) else 0x5410
    return cute.arch.inline_ptx(f"prmt.b32 {{$w0}}, {{$r0}}, {{$r1}}, {selector};",
                                write_only_types=[Int32], read_only_args=[a, b])


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
        chunks = mQ.shape[1] * (mQ.shape[2] // 4)
        self.kernel(mQ, mS, mOut, mGlobal, (sa, sb, sc, sd)).launch(
            grid=[cute.ceil_div(chunks, THREADS), 1, mQ.shape[0]], block=[THREADS, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mS: cute.Tensor, mOut: cute.Tensor, mGlobal: cute.Tensor,
               coefficients):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, l = cute.arch.block_idx()
        per_row = mQ.shape[2] // 4  # 32-value chunks per row
        item = bidx * THREADS + tidx
        if item < mQ.shape[1] * per_row:
            row, chunk = item // per_row, item % per_row
            words = cute.make_rmem_tensor((4,), Int32)
            atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Int32, num_bits_per_copy=128)
            cute.copy(atom, cute.local_tile(mQ[l, row, None], (4,), (chunk,)), words)
            out = cute.make_rmem_tensor((32,), mOut.element_type)
            scale_word = mS[l, scale_index(row, chunk, coefficients)].to(Int32)
            if cutlass.const_expr(self.config == "float32"):
                self.scaled(words, scale_word, mGlobal[0], out)
            else:
                if mGlobal[0] == Float32(1.0):
                    self.exact(words, scale_word, out)
                else:
                    self.scaled(words, scale_word, mGlobal[0], out)
            store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), mOut.element_type,
                                        num_bits_per_copy=128)
            cute.copy(store, out, cute.local_tile(mOut[l, row, None], (32,), (chunk,)))

    @cute.jit
    def exact(self, words, scale_word, out):
        """32 values of a global scale 1 in bf16 / fp16: decoded in the output dtype."""
        half = cutlass.const_expr(self.config == "float16")
        scales = scale_pairs(scale_word, Int32(0), half)
        pairs = cute.recast_tensor(out, Int32)
        for q in cutlass.range_constexpr(4):
            decoded = list(decode_word(words[q], scales[q // 2], half))
            for p in cutlass.range_constexpr(4):
                decoded[p] = unscale_pair(decoded[p], half)
            for p in cutlass.range_constexpr(2):
                pairs[4 * q + p] = _pair(decoded[2 * p], decoded[2 * p + 1], False)
                pairs[4 * q + p + 2] = _pair(decoded[2 * p], decoded[2 * p + 1], True)

    @cute.jit
    def scaled(self, words, scale_word, global_scale, out):
        """32 values times ``2^8 * global_scale`` in fp32, one rounding to the output dtype."""
        scales = scale_pairs(scale_word, Int32(0), False)
        factor = global_scale * Float32(256.0)
        values = cute.make_rmem_tensor((32,), Float32)
        for q in cutlass.range_constexpr(4):
            decoded = decode_word(words[q], scales[q // 2], False)
            for p in cutlass.range_constexpr(4):
                lo, hi = bf16_pair_to_f32(decoded[p])
                values[8 * q + p] = lo * factor
                values[8 * q + p + 4] = hi * factor
        out.store(values.load().to(out.element_type))
