"""NVFP4 quantization in one pass, for Hopper (sm_90a).

Each thread owns one block of 16 values of a row (``formats.BLOCK``): it reads them with 16-byte
loads (two for bf16 / fp16, four for fp32), takes the block's amax, forms its e4m3 scale, codes
the 16 values as e2m1 and writes them packed two per byte with one 8-byte store, then writes the
scale byte where the scale layout puts it. Adjacent threads own adjacent blocks, so every load
and store is coalesced; nothing is shared between threads.

The arithmetic is the reference's (``formats.nvfp4_quantize_ref``), operation for operation, so
the output is bit-identical:
  - ``s = amax / 6 / global_scale`` (two IEEE divisions); NaN in the block or in ``s`` gives 0
    (a NaN-propagating max makes the amax of a block holding a NaN NaN, and so ``s``),
    then ``s`` is clamped to [0, 448] and rounded to e4m3 by ``cvt.rn.satfinite.e4m3x2.f32``
    and read back exactly (``cvt.rn.f16x2.e4m3x2``: every e4m3 value is an fp16 value);
  - ``inverse = 1 / (float(scale) * global_scale)``, 0 unless that product is positive;
  - each code from ``q = x * inverse``, rounded to nearest even on e2m1's grid, saturated at 6,
    NaN -> 0, sign bit ``q < 0`` (``e2m1_pair``: fp32 additions do the rounding and an fp16
    conversion of two values at once gives the codes' bits).
Hopper has no e2m1 conversion instruction (the DSL's lowers to one ptxas rejects for sm_90a).

The global scale is read from device memory (a one-element fp32 tensor), so a global scale
computed on the GPU (the default, amax / (6 * 448)) needs no host synchronization.

Constraints:
  - x fp32, fp16 or bf16 (M, K), K a multiple of 16, last dim contiguous, row stride and data
    on 16 bytes; M and K dynamic
  - packed uint8 (M, K / 2) row-major, row stride a multiple of 8 bytes; scales uint8 (the
    e4m3 bytes): "plain" (M, K / 16) row-major, "blocked" flat (rows padded to 128, K / 16
    padded to 4; the padding is the caller's to zero)
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8, const_expr

THREADS = 128
BLOCK = 16
LAYOUTS = ("plain", "blocked")


@cute.jit
def e4m3_scale(value: Float32):
    """(the e4m3 byte, its exact float32 value) of ``value`` in [0, 448], rounded to nearest
    even."""
    byte, decoded = cute.arch.inline_ptx(
        "{ .reg .b16 pair, lo, hi; .reg .b32 halves;"
        " cvt.rn.satfinite.e4m3x2.f32 pair, 0f00000000, {$r0};"
        " cvt.rn.f16x2.e4m3x2 halves, pair;"
        " mov.b32 {lo, hi}, halves;"
        " cvt.f32.f16 {$w1}, lo;"
        " cvt.u32.u16 {$w0}, pair; }",
        write_only_types=[Int32, Float32], read_only_args=[Float32(value)])
    return byte, decoded


@cute.jit
def max_abs_nan(running: Float32, value: Float32) -> Float32:
    """``max(running, |value|)``, NaN if either is NaN (``max.NaN``: one instruction where a
    NaN-ignoring max needs a separate NaN test)."""
    return cute.arch.inline_ptx("{ .reg .f32 a; abs.f32 a, {$r1}; max.NaN.f32 {$w0}, {$r0}, a; }",
                                write_only_types=[Float32], read_only_args=[running, value])


@cute.jit
def e2m1_pair(q0: Float32, q1: Float32) -> Int32:
    """One byte of two e2m1 codes (``q0`` in the low nibble): nearest, ties to even,
    saturating at 6, NaN -> 0, sign bit ``q < 0``.

    Each magnitude is scaled by 2^-14 with saturation (which sends NaN to 0; the scaling is
    exact, so it commutes with the clamp) and clamped to 6 * 2^-14, then rounded to e2m1's
    step -- 2^-15 below 2^-13, 2^-14 below 2^-12, 2^-13 above, i.e. one mantissa bit with
    e2m1's subnormal -- by adding and subtracting ``c = 2^22 * max(2^exponent, 2^-14)``
    (fp32 round-to-nearest-even does the rounding). The result is an fp16 value whose bits
    are the code: 1.0 * 2^-14 is fp16's smallest normal, 0.5 * 2^-14 its subnormal with the top
    mantissa bit, so ``(fp16 bits >> 9) & 7`` is e2m1's exponent and mantissa."""
    return cute.arch.inline_ptx(
        "{ .reg .f32 m0, m1, c0, c1; .reg .b32 e0, e1, w, lo, hi, s0, s1; .reg .pred p0, p1;"
        " abs.f32 m0, {$r0}; mul.rn.sat.f32 m0, m0, 0f38800000; min.f32 m0, m0, 0f39C00000;"
        " abs.f32 m1, {$r1}; mul.rn.sat.f32 m1, m1, 0f38800000; min.f32 m1, m1, 0f39C00000;"
        " mov.b32 e0, m0; and.b32 e0, e0, 0x7F800000; max.u32 e0, e0, 0x38800000;"
        " add.u32 e0, e0, 0x0B000000; mov.b32 c0, e0;"
        " mov.b32 e1, m1; and.b32 e1, e1, 0x7F800000; max.u32 e1, e1, 0x38800000;"
        " add.u32 e1, e1, 0x0B000000; mov.b32 c1, e1;"
        " add.rn.f32 m0, m0, c0; sub.rn.f32 m0, m0, c0;"
        " add.rn.f32 m1, m1, c1; sub.rn.f32 m1, m1, c1;"
        " cvt.rn.f16x2.f32 w, m1, m0;"
        " shr.u32 lo, w, 9; and.b32 lo, lo, 7; shr.u32 hi, w, 21; and.b32 hi, hi, 0x70;"
        " setp.lt.f32 p0, {$r0}, 0f00000000; setp.lt.f32 p1, {$r1}, 0f00000000;"
        " selp.b32 s0, 8, 0, p0; selp.b32 s1, 128, 0, p1;"
        " or.b32 w, lo, hi; or.b32 w, w, s0; or.b32 {$w0}, w, s1; }",
        write_only_types=[Int32], read_only_args=[Float32(q0), Float32(q1)])


class QuantizeNvfp4Sm90:
    """Packed e2m1 codes and e4m3 block scales of x. See the module docstring. ``config``: the
    scale layout, "plain" or "blocked"."""

    tensor_cores = False  # plain vector loads and comparisons (the self-check's table)

    def __init__(self, config: str):
        if config not in LAYOUTS:
            raise ValueError(f"scale layout {config!r}; supported: {LAYOUTS}")
        self.config = config

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mScale: cute.Tensor, mGlobal: cute.Tensor,
                 stream):
        blocks = mX.shape[0] * (mX.shape[1] // BLOCK)
        self.kernel(mX, mQ, mScale, mGlobal).launch(
            grid=[cute.ceil_div(blocks, THREADS), 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mScale: cute.Tensor, mGlobal: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        per_row = mX.shape[1] // BLOCK
        block = bidx * THREADS + tidx
        if block < mX.shape[0] * per_row:
            row = block // per_row
            column = block - row * per_row
            gX = cute.local_tile(mX, (1, BLOCK), (row, column))
            rX = cute.make_rmem_tensor_like(gX)
            cute.autovec_copy(gX, rX)
            x = rX.load().to(Float32)
            values = cute.make_rmem_tensor_like(rX, Float32)
            values.store(x)
            amax = Float32(0.0)  # NaN if a value is NaN (max.NaN), so s is NaN and becomes 0
            for i in cutlass.range_constexpr(BLOCK):
                amax = max_abs_nan(amax, values[i])
            global_scale = mGlobal[0]
            s = amax / Float32(6.0) / global_scale
            s = cutlass.select_(s != s, Float32(0.0), s)
            s = cute.arch.fmin(cute.arch.fmax(s, Float32(0.0)), Float32(448.0))
            byte, decoded = e4m3_scale(s)
            denominator = decoded * global_scale
            inverse = cutlass.select_(denominator > Float32(0.0), Float32(1.0) / denominator,
                                      Float32(0.0))
            gQ = cute.local_tile(mQ, (1, BLOCK // 2), (row, column))
            rQ = cute.make_rmem_tensor_like(gQ)
            for j in cutlass.range_constexpr(BLOCK // 2):
                rQ[j] = e2m1_pair(values[2 * j] * inverse, values[2 * j + 1] * inverse).to(Uint8)
            cute.autovec_copy(rQ, gQ)
            if const_expr(self.config == "plain"):
                mScale[row, column] = byte.to(Uint8)
            else:
                column_tiles = (per_row + 3) // 4
                tile = (row // 128) * column_tiles + column // 4
                within = row % 128
                index = tile * 512 + (within % 32) * 16 + (within // 32) * 4 + column % 4
                mScale[index] = byte.to(Uint8)
