"""NVFP4 -> bf16 / fp16 / fp32 values in one pass, for Hopper (sm_90a).

Each thread owns 32 codes of a row (16 bytes, one vector load) and their two e4m3 scales (one
16-bit load, plain or blocked layout); it decodes them as the skinny GEMM does
(``nvfp4_skinny_sm90.decode_word``: code * scale * 2^-8, exact in bf16), multiplies by
``2^8 * global_scale`` in fp32 (exact for a power-of-two global scale; otherwise the one
rounding of ``(code * scale) * global_scale`` in fp32, as the torch rule) and stores the 32
values in the output dtype (one rounding) with 16-byte stores.

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
            scales = scale_pairs(mS[l, scale_index(row, chunk, coefficients)].to(Int32), Int32(0), False)
            factor = mGlobal[0] * Float32(256.0)
            values = cute.make_rmem_tensor((32,), Float32)
            for q in cutlass.range_constexpr(4):
                decoded = decode_word(words[q], scales[q // 2], False)
                for p in cutlass.range_constexpr(4):
                    lo, hi = bf16_pair_to_f32(decoded[p])
                    values[8 * q + p] = lo * factor
                    values[8 * q + p + 4] = hi * factor
            out = cute.make_rmem_tensor((32,), mOut.element_type)
            out.store(values.load().to(mOut.element_type))
            store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), mOut.element_type,
                                        num_bits_per_copy=128)
            cute.copy(store, out, cute.local_tile(mOut[l, row, None], (32,), (chunk,)))
