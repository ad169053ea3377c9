"""NVFP4 weights times a few rows of activations (M <= 64), for Hopper (sm_90a).

``out[l, m, n] = alpha * sum_k x[l, m, k] * w[l, n, k] + bias[n]`` with w NVFP4 (e2m1 codes,
two per byte, one e4m3 scale per 16 values along K) and x bf16, fp16 or NVFP4 too. A product
of a few rows is bound by the weight's bytes: this kernel streams them once, at the memory's
rate, and decodes them in registers (Hopper has no FP4 tensor cores, and the DSL's e2m1
conversion lowers to an instruction ptxas rejects for sm_90a).

Design:
  - A CTA owns ``warps * slabs`` 16-row slabs of the weight (each warp its own ``slabs``) and
    one of ``splits`` equal ranges of K; K is walked in steps of 128 values. All warps take
    the same step at once, so the step's rows of x -- the B operand of every warp -- are
    loaded once per CTA and read from shared memory by all of them.
  - A ``stages``-deep cp.async ring feeds shared memory: per step, each lane (g, t) =
    (lane / 4, lane % 4) of a warp copies the 32 codes ``[128 step + 32 t, + 32)`` of rows g
    and g + 8 of each slab (16 bytes each) and the 4-byte words holding their e4m3 scale pairs
    (``scale_index``: the plain and the 128 x 4 blocked layout alike); the CTA's threads copy
    the step's x rows. One wait and one CTA barrier per step; the stage the barrier frees is
    refilled at once, so ``stages - 1`` steps of bytes are always in flight. Out-of-range
    codes, scales and rows of x arrive as zeros (cp.async's source size 0).
  - The MMA is ``mma.sync m16n8k16`` (warp-level, A from registers): weight rows fill its M,
    tokens its N (8 per tile). A reduction over K may take the values in any order, so the
    lane's A fragment slots hold its own 32 codes in the order the decode produces them, and
    its B fragment (x) is gathered in that same order.
  - Decode: for a 32-bit word of 8 codes c0..c7 (c_q in bits 4q..4q+3), ``R_i`` holds c_i and
    c_(i+4) in its two bf16 halves, sign at bit 15 and exponent and mantissa at bits 6..8: the
    bf16 value is the code's value times 2^-126 (fp16: bits 9..11, 2^-14). bf16: the pair is
    masked out of the word (of the word shifted down a byte for i = 2, 3), and one integer
    multiply by ``2^a + 2^(a + 6)`` writes two copies of it that cannot overlap (so nothing
    carries): the first copy's magnitude and the second's sign are what the final mask keeps --
    two logic operations and a multiply per pair, the multiply on the FMA pipe, where the
    shifts-and-masks form ``((v << 6) & 0x01C001C0) | ((v << 12) & 0x80008000)`` (which fp16
    still uses) takes four ALU operations. One ``mul.bf16x2`` by the block scale times 2^118
    (fp16: 2^7) then gives code * scale * 2^-8 (2^-7), exact; the epilogue multiplies by 2^8
    (2^7) and alpha. A pair (c_i, c_(i+4)) is one 32-bit A register; x's matching pair (x_i,
    x_(i+4)) is one byte permute of its natural words. NVFP4 x takes the same decode, once per
    CTA: each thread decodes the pieces of x it copied (after its own cp.async wait, before the
    step's barrier) into one of two shared buffers, in the order the MMA lanes read them (one
    16-byte load per word), instead of every lane of every warp decoding its own copy.
  - Streaming (``prefetch`` > 0; one token tile, one slab, up to 8 rows of x): no ring and no
    barrier in the loop. Each thread issues the loads of its first piece of x, then those of
    its first ``prefetch`` steps of the weight, then the CTA stages x's MMA words for its
    whole range of K in shared memory (NVFP4 x decoded, 16-bit x permuted into pairs; one
    barrier) while the weight is in flight (x's few bytes ahead of it); then each warp walks
    its 16 rows alone: every lane loads its 16 bytes of codes per row and its scale words
    straight into registers (``ld.global.nc``) ``prefetch`` steps ahead, and decodes and
    multiplies the step it loaded ``prefetch`` steps before -- the warps drift freely instead
    of meeting at a barrier every step. A step reads 64 bytes of each row; with ``l2_fetch``
    = 256 the L2 fetches a row's next three steps from memory with the first (fewer, larger
    memory requests: the stream runs nearer the memory's rate), and ``granule`` = 4 starts
    every range of K on such a 256-byte block, so that no fetch reads into a neighbouring
    CTA's range.
  - One range of K (``splits`` = 1): each lane writes its outputs. Several: each CTA adds its
    fp32 partial sums into a workspace (``red.global.add``) and counts itself in its row
    block's counter; the last CTA of the block reads the sums, writes the output, and leaves
    workspace and counter at zero for the next launch.

Tensors: w uint8 (L, N, K / 2) (the packed codes), its scales int16 (L, span) (pairs of e4m3
bytes, either layout, addressed by four coefficients: ``scale_index``); x bf16 / fp16 (L, M, K)
or uint8 (L, M, K / 2) (NVFP4, with scales as w's); out (L, M, N) of any strides; bias (N,) of
out's dtype (zeros for none); alpha fp32 (1,); workspace fp32 (L, M, N) and counters int32
(L, row blocks), zero before the launch and after it. w and x arrive in the caller's own
dtypes (no views to make per call): the kernel only computes byte addresses from them.

Constraints:
  - M <= 8 * token_tiles (the launch's rows of x), K a multiple of 32, every row of w and x on
    16 bytes, scale words on 4 bytes; N, M, K, L and ``splits`` dynamic; tails in N and M
    masked
  - bf16 and NVFP4 x run bf16 MMAs, fp16 x fp16 MMAs (an e2m1 value times an e4m3 scale fits
    either exactly; bf16's decode is the cheaper one); fp32 accumulation
  - one launch at a time per workspace (the caller keeps one per stream)
  - streaming: M <= ``x_rows``, at most ``x_steps`` steps of 128 values per range of K (the
    caller's ``splits`` sees to it; a range is ceil(steps / splits) rounded up to ``granule``
    steps, the last one shorter)
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

X_FORMATS = ("bfloat16", "float16", "nvfp4")
OUT_DTYPES = ("bfloat16", "float16", "float32")

# fp16 pairs, per decoded word i = 0..3: (left shift of the magnitude bits, left shift of the
# sign bit); a negative shift is a right shift.
_FP16_SHIFTS = ((9, 12), (5, 8), (1, 4), (-3, 0))


@dataclass(frozen=True)
class SkinnyConfig:
    """Compile-time configuration (see the module docstring)."""

    token_tiles: int  # 8-token MMA tiles: M <= 8 * token_tiles
    slabs: int  # 16-row weight slabs per warp
    warps: int  # warps per CTA, each on its own slabs
    stages: int  # depth of the cp.async ring
    split: bool  # K cut into ranges over CTAs (partial sums through the workspace)
    x_format: str = "bfloat16"
    out_dtype: str = "bfloat16"
    # Streaming (one token tile, one slab): the weight loaded straight into registers
    # ``prefetch`` steps ahead, no ring; x staged once per CTA for at most ``x_steps`` steps of
    # at most ``x_rows`` rows. 0: the cp.async ring.
    prefetch: int = 0
    x_steps: int = 0
    x_rows: int = 1
    # Streaming: bytes the L2 fetches from memory per miss of a weight load (0: the default
    # sector pair; 128 or 256), and the steps a range of K is a multiple of.
    l2_fetch: int = 0
    granule: int = 1

    @property
    def half(self) -> bool:
        """fp16 MMAs for fp16 x, else bf16 (NVFP4 x included: its decoded values fit bf16
        exactly, and bf16's decode is the cheaper one)."""
        return self.x_format == "float16"

    @property
    def exponent(self) -> int:
        """log2 of the factor the decoded values lack (each decoded operand carries 2^-8 in
        bf16, 2^-7 in fp16; NVFP4 x is decoded too)."""
        if self.x_format == "nvfp4":
            return 16
        return 7 if self.half else 8

    @property
    def decoded_x_words(self) -> int:
        """int32 words of shared memory holding NVFP4 x decoded (two buffers of a step's
        rows), else 0."""
        return 2 * 16 * 32 * self.token_tiles if self.x_format == "nvfp4" else 0


def _shift(reg: str, src: str, amount: int) -> str:
    if amount >= 0:
        return f"shl.b32 {reg}, {src}, {amount};"
    return f"shr.u32 {reg}, {src}, {-amount};"


def decode_ptx(half: bool) -> str:
    """PTX: {$r0} a word of 8 codes, {$r1} the scale pair -> {$w0..$w3} the scaled pairs
    (c_i, c_(i+4)), i = 0..3."""
    mul = "mul.rn.f16x2" if half else "mul.rn.bf16x2"
    if not half:
        # Pairs 0 / 1 from the word, 2 / 3 from the word shifted down a byte; each pair masked,
        # then one integer multiply by 2^a + 2^(a + 6) writes two copies of it that do not
        # overlap (so no carries): the first's magnitude and the second's sign are the bits the
        # last mask keeps.
        lines = ["{ .reg .b32 u, p;", "shr.u32 u, {$r0}, 8;"]
        for i, (src, mask, factor) in enumerate((("{$r0}", "0x000F000F", "0x1040"),
                                                 ("{$r0}", "0x00F000F0", "0x104"),
                                                 ("u", "0x000F000F", "0x1040"),
                                                 ("u", "0x00F000F0", "0x104"))):
            lines.append(f"and.b32 p, {src}, {mask}; mul.lo.u32 p, p, {factor};"
                         f" and.b32 p, p, 0x81C081C0; {mul} {{$w{i}}}, p, {{$r1}};")
        lines.append("}")
        return " ".join(lines)
    lines = ["{ .reg .b32 m, s;"]
    for i, (left, sign) in enumerate(_FP16_SHIFTS):
        lines.append(_shift("m", "{$r0}", left))
        lines.append(_shift("s", "{$r0}", sign) if sign else "mov.b32 s, {$r0};")
        lines.append("and.b32 m, m, 0x0E000E00; and.b32 s, s, 0x80008000; or.b32 m, m, s;")
        lines.append(f"{mul} {{$w{i}}}, m, {{$r1}};")
    lines.append("}")
    return " ".join(lines)


@cute.jit
def decode_word(word: Int32, scale: Int32, half: cutlass.Constexpr):
    """Four registers of two scaled values each from 8 packed codes (module docstring)."""
    return cute.arch.inline_ptx(decode_ptx(half), write_only_types=[Int32] * 4,
                                read_only_args=[word, scale])


@cute.jit
def scale_pairs(word: Int32, shift: Int32, half: cutlass.Constexpr):
    """Two e4m3 scales -- bits ``shift .. shift + 15`` of ``word``, low byte first -> two
    registers, each the scale twice: times 2^118 in bf16, or times 2^7 in fp16 (exact; NaN
    stays NaN)."""
    if const_expr(half):
        return cute.arch.inline_ptx(
            "{ .reg .b32 h, k; .reg .b16 p, lo, hi;"
            " shr.b32 h, {$r0}, {$r1}; cvt.u16.u32 p, h;"
            " cvt.rn.f16x2.e4m3x2 h, p; mov.b32 k, 0x58005800; mul.rn.f16x2 h, h, k;"
            " mov.b32 {lo, hi}, h; mov.b32 {$w0}, {lo, lo}; mov.b32 {$w1}, {hi, hi}; }",
            write_only_types=[Int32, Int32], read_only_args=[word, shift])
    return cute.arch.inline_ptx(
        "{ .reg .b32 h; .reg .b16 p, lo, hi; .reg .f32 f0, f1;"
        " shr.b32 h, {$r0}, {$r1}; cvt.u16.u32 p, h;"
        " cvt.rn.f16x2.e4m3x2 h, p; mov.b32 {lo, hi}, h;"
        " cvt.f32.f16 f0, lo; cvt.f32.f16 f1, hi;"
        " mul.rn.f32 f0, f0, 0f7A800000; mul.rn.f32 f1, f1, 0f7A800000;"
        " cvt.rn.bf16x2.f32 {$w0}, f0, f0; cvt.rn.bf16x2.f32 {$w1}, f1, f1; }",
        write_only_types=[Int32, Int32], read_only_args=[word, shift])


@cute.jit
def copy_async(dst: Int32, src: cutlass.Int64, size: cutlass.Constexpr, valid):
    """cp.async of ``size`` (4 or 16) bytes, global -> shared; zeros where not ``valid``."""
    kind = "cg" if const_expr(size == 16) else "ca"
    cute.arch.inline_ptx(
        f"cp.async.{kind}.shared.global [{{$r0}}], [{{$r1}}], {size}, {{$r2}};",
        read_only_args=[dst, src, cutlass.select_(valid, Int32(size), Int32(0))])


@cute.jit
def load_v4(address: cutlass.Int64, valid, l2_fetch: cutlass.Constexpr = 0):
    """16 bytes from global memory (read-only path, no L1 allocation; with ``l2_fetch`` the L2
    fetches that many bytes around them on a miss) as four words; zeros where not ``valid``
    (nothing read)."""
    size = f".L2::{l2_fetch}B" if const_expr(l2_fetch) else ""
    return cute.arch.inline_ptx(
        "{ .reg .pred p; setp.ne.b32 p, {$r1}, 0;"
        " mov.b32 {$w0}, 0; mov.b32 {$w1}, 0; mov.b32 {$w2}, 0; mov.b32 {$w3}, 0;"
        f" @p ld.global.nc.L1::no_allocate{size}.v4.b32"
        " {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}]; }",
        write_only_types=[Int32] * 4,
        read_only_args=[address, cutlass.select_(valid, Int32(1), Int32(0))])


@cute.jit
def load_b32(address: cutlass.Int64, valid) -> Int32:
    """A word from global memory (read-only path); zero where not ``valid``."""
    return cute.arch.inline_ptx(
        "{ .reg .pred p; setp.ne.b32 p, {$r1}, 0; mov.b32 {$w0}, 0;"
        " @p ld.global.nc.b32 {$w0}, [{$r0}]; }",
        write_only_types=[Int32], read_only_args=[address, cutlass.select_(valid, Int32(1), Int32(0))])


@cute.jit
def red_add(address: cutlass.Int64, value: Float32):
    """``*address += value`` in global memory (fp32, relaxed, no return)."""
    cute.arch.inline_ptx("red.global.add.f32 [{$r0}], {$r1};", read_only_args=[address, value])


@cute.jit
def load_cg(address: cutlass.Int64) -> Float32:
    """An fp32 load from L2 (bypassing the SM's L1)."""
    return cute.arch.inline_ptx("ld.global.cg.f32 {$w0}, [{$r0}];", write_only_types=[Float32],
                                read_only_args=[address])


@cute.jit
def store_cg(address: cutlass.Int64, value: Float32):
    cute.arch.inline_ptx("st.global.cg.f32 [{$r0}], {$r1};", read_only_args=[address, value])


@cute.jit
def scale_index(row, chunk, coefficients):
    """Where the scale pair of ``row``'s codes ``[32 chunk, + 32)`` sits (in int16 units):
    ``(row / 128) A + (row % 32) B + ((row % 128) / 32) C + (chunk / 2) D + chunk % 2``.
    Plain (row stride S pairs): A, B, C, D = 128 S, S, 32 S, 2. Blocked (128-row x 4-column
    tiles of 512 bytes, row tiles outer, scale (r, c) at byte (r % 32) 16 + (r / 32) 4 + c of
    its tile; T column tiles): 256 T, 8, 2, 256."""
    a, b, c, d = coefficients
    return ((row // 128) * a + (row % 32) * b + ((row % 128) // 32) * c + (chunk // 2) * d
            + chunk % 2)


@cute.jit
def scale_word(tensor: cute.Tensor, l, pair):
    """(global address of the 4-byte word holding scale pair ``pair`` of batch ``l``, the pair's
    bit shift in it): the parity is counted from the tensor's start, since a batch of an odd
    number of pairs starts mid-word."""
    index = cute.crd2idx((l, pair), tensor.layout)
    return cutlass.Int64((tensor.iterator + (index - index % 2)).toint()), Int32(index % 2) * 16


@cute.jit
def interleave(lo: Int32, hi: Int32, upper: cutlass.Constexpr) -> Int32:
    """(lo's low half, hi's low half), or the upper halves: x's natural pairs -> (x_i, x_(i+4))."""
    selector = 0x7632 if const_expr(upper) else 0x5410
    return cute.arch.inline_ptx(f"prmt.b32 {{$w0}}, {{$r0}}, {{$r1}}, {selector};",
                                write_only_types=[Int32], read_only_args=[lo, hi])


def _regs(kind: str, first: int, count: int) -> str:
    """An inline-PTX vector operand: ``{{$r4}, {$r5}}``."""
    return "{" + ", ".join(f"{{${kind}{i}}}" for i in range(first, first + count)) + "}"


@cute.jit
def mma_16816(acc: cute.Tensor, a0: Int32, a1: Int32, a2: Int32, a3: Int32, b0: Int32, b1: Int32,
              half: cutlass.Constexpr):
    """acc (4 fp32) += A (16 x 16) B (16 x 8), one warp-level MMA."""
    kind = "f16.f16" if const_expr(half) else "bf16.bf16"
    d = cute.arch.inline_ptx(
        f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.f32 {_regs('w', 0, 4)}, {_regs('r', 0, 4)},"
        f" {_regs('r', 4, 2)}, {_regs('r', 6, 4)};",
        write_only_types=[Float32] * 4,
        read_only_args=[a0, a1, a2, a3, b0, b1, acc[0], acc[1], acc[2], acc[3]])
    for i in cutlass.range_constexpr(4):
        acc[i] = d[i]


class SkinnyGemmNvfp4Sm90:
    """See the module docstring. ``config``: a :class:`SkinnyConfig`."""

    tensor_cores = False  # warp-level mma.sync from registers: no wgmma, no TMA (self-check table)

    def __init__(self, config: SkinnyConfig):
        if (config.x_format not in X_FORMATS or config.out_dtype not in OUT_DTYPES
                or config.token_tiles not in (1, 2, 4, 8) or config.slabs not in (1, 2)
                or config.warps not in (2, 4, 8) or config.stages not in (2, 4, 8)
                or config.l2_fetch not in (0, 128, 256) or config.granule < 1
                or config.prefetch and (config.token_tiles != 1 or config.slabs != 1
                                        or config.x_rows not in (1, 2, 4, 8) or config.x_steps < 1)):
            raise ValueError(f"unsupported configuration {config}: x_format in {X_FORMATS}, "
                             f"out_dtype in {OUT_DTYPES}, 1 / 2 / 4 / 8 token tiles, 1 / 2 "
                             f"slabs, 2 / 4 / 8 warps, 2 / 4 / 8 stages, l2_fetch 0 / 128 / 256, "
                             f"granule >= 1; streaming (prefetch > 0) with one token tile, one "
                             f"slab, x_rows 1 / 2 / 4 / 8 and x_steps >= 1")
        self.config = config
        self.x_fp4 = config.x_format == "nvfp4"
        # int32 words per stage: weights (4 per lane, row half, slab, warp), their scale words,
        # x (bf16 / fp16: 16 per lane and token tile; NVFP4: 4, and a scale word)
        self.w_words = 4 * 32 * 2 * config.slabs * config.warps
        self.ws_words = 32 * 2 * config.slabs * config.warps
        self.x_words = (4 if self.x_fp4 else 16) * 32 * config.token_tiles
        self.xs_words = 32 * config.token_tiles if self.x_fp4 else 0

    def smem_bytes(self) -> int:
        """Shared memory of one CTA: the ring, and NVFP4 x's decoded buffers (streaming: x's
        MMA words for the CTA's range of K)."""
        if self.config.prefetch:
            return 256 * self.config.x_rows * self.config.x_steps + 16
        return 4 * (self.config.stages * (self.w_words + self.ws_words + self.x_words + self.xs_words)
                    + self.config.decoded_x_words)

    @cute.jit
    def __call__(self, mW: cute.Tensor, mSW: cute.Tensor, mX: cute.Tensor, mSX, mOut: cute.Tensor,
                 mBias: cute.Tensor, mAlpha: cute.Tensor, mWork: cute.Tensor, mCount: cute.Tensor,
                 splits: Int32, wa: Int32, wb: Int32, wc: Int32, wd: Int32, xa: Int32, xb: Int32,
                 xc: Int32, xd: Int32, stream):
        cfg = self.config
        rows = 16 * cfg.slabs * cfg.warps
        body = self.stream_kernel if const_expr(cfg.prefetch) else self.kernel
        body(mW, mSW, mX, mSX, mOut, mBias, mAlpha, mWork, mCount, splits,
             (wa, wb, wc, wd), (xa, xb, xc, xd)).launch(
            grid=[cute.ceil_div(mW.shape[1], rows), splits, mW.shape[0]],
            block=[32 * cfg.warps, 1, 1], stream=stream)

    @cute.kernel
    def stream_kernel(self, mW: cute.Tensor, mSW: cute.Tensor, mX: cute.Tensor, mSX,
                      mOut: cute.Tensor, mBias: cute.Tensor, mAlpha: cute.Tensor,
                      mWork: cute.Tensor, mCount: cute.Tensor, splits: Int32, w_coefficients,
                      x_coefficients):
        """Streaming: x's MMA words for the CTA's range of K staged in shared memory once
        (one barrier), then each warp walks its 16 rows alone, every lane loading its codes
        and scale words ``prefetch`` steps ahead into registers."""
        cfg = self.config
        ahead, warps, x_rows = const_expr(cfg.prefetch), const_expr(cfg.warps), const_expr(cfg.x_rows)
        half = const_expr(cfg.half)
        tidx, _, _ = cute.arch.thread_idx()
        block, split, l = cute.arch.block_idx()
        warp, lane = tidx // 32, tidx % 32
        g, t = lane // 4, lane % 4
        k_chunks = mW.shape[2] // 16
        steps = (k_chunks + 3) // 4
        granule = const_expr(cfg.granule)
        per_split = ((steps + splits - 1) // splits + granule - 1) // granule * granule
        first = split * per_split
        count = cutlass.max(cutlass.min(per_split, steps - first), 0)
        row0 = block * (16 * warps)
        rows, m = mW.shape[1], mX.shape[1]

        smem = cutlass.memory.SmemAllocator()
        # (pair, row of x, lane's chunk t, word q, step): lane (g, t)'s 16 bytes of word q
        sXD = smem.allocate_tensor(Int32, cute.make_layout((4, x_rows, 4, 4, cfg.x_steps)), 16)
        last = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
        w_src, ws_src, w_shift = [], [], []
        for h in cutlass.range_constexpr(2):
            r = cutlass.min(row0 + 16 * warp + 8 * h + g, rows - 1)
            w_src.append(_global(mW, (l, r, 16 * t)))
            address, shift = scale_word(mSW, l, scale_index(r, t, w_coefficients))
            ws_src.append(address)
            w_shift.append(shift)
        w_d = w_coefficients[3]
        words = cute.make_rmem_tensor((4, 2, ahead), Int32)
        scales = cute.make_rmem_tensor((2, ahead), Int32)
        acc = cute.make_rmem_tensor((4, 1, 1, 2), Float32)
        acc.fill(0.0)
        # this thread's first piece of x, then the first steps' weight loads, in flight while
        # x is staged
        raw = self.load_x_piece(mX, mSX, l, first, k_chunks, m, x_coefficients, tidx,
                                count * 4 * x_rows)
        for j in cutlass.range_constexpr(ahead):
            self.load_step(words, scales, j, w_src, ws_src, w_d, first, j, count, k_chunks, t)
        self.stage_x(mX, mSX, sXD, l, first, count, k_chunks, m, x_coefficients, tidx, raw)
        cute.arch.barrier()
        for s0 in cutlass.range(0, count, ahead):
            for j in cutlass.range_constexpr(ahead):
                if s0 + j < count:
                    self.stream_step(acc, words, scales, j, sXD, s0 + j, w_shift, g, t, m, half)
                    self.load_step(words, scales, j, w_src, ws_src, w_d, first, s0 + j + ahead,
                                   count, k_chunks, t)
        for v in cutlass.range_constexpr(cute.size(acc) // 2):
            acc[v] = acc[v] + acc[v + cute.size(acc) // 2]
        self.finish(acc, mOut, mBias, mAlpha, mWork, mCount, last, splits, l, block, row0, warp,
                    lane, tidx)

    @cute.jit
    def load_x_piece(self, mX, mSX, l, first, k_chunks, m, x_coefficients, piece, total):
        """The raw words of x's piece ``piece`` of the range (a (step, chunk t, row of x): 32
        values), zeros where it is past ``total`` or x's end: NVFP4 its 16 bytes of codes and
        scale word, 16-bit its four 16-byte groups."""
        x_rows = const_expr(self.config.x_rows)
        step, rest = piece // (4 * x_rows), piece % (4 * x_rows)
        tt, token = rest // x_rows, rest % x_rows
        chunk = (first + step) * 4 + tt
        ok = piece < total and token < m and chunk < k_chunks
        src_token = cutlass.select_(token < m, token, 0)
        src_chunk = cutlass.select_(chunk < k_chunks, chunk, 0)
        if const_expr(self.x_fp4):
            codes = load_v4(_global(mX, (l, src_token, 16 * src_chunk)), ok)
            address, shift = scale_word(mSX, l, scale_index(src_token, src_chunk, x_coefficients))
            return tuple(codes) + (load_b32(address, ok), shift)
        words = ()
        for q in cutlass.range_constexpr(4):
            words += tuple(load_v4(_global(mX, (l, src_token, 32 * src_chunk + 8 * q)), ok))
        return words

    @cute.jit
    def store_x_piece(self, sXD, raw, piece):
        """Piece ``piece``'s 32 values in the order the lanes (row, t) feed them to the MMA
        (NVFP4: decoded; 16-bit: pairs (x_i, x_(i+4)) by byte permutes)."""
        half = const_expr(self.config.half)
        x_rows = const_expr(self.config.x_rows)
        step, rest = piece // (4 * x_rows), piece % (4 * x_rows)
        tt, token = rest // x_rows, rest % x_rows
        if const_expr(self.x_fp4):
            x0, x1 = scale_pairs(raw[4], raw[5], half)
            for q in cutlass.range_constexpr(4):
                d = decode_word(raw[q], x0 if q < 2 else x1, half)
                for p in cutlass.range_constexpr(4):
                    sXD[p, token, tt, q, step] = d[p]
        else:
            for q in cutlass.range_constexpr(4):
                n = raw[4 * q:4 * q + 4]
                sXD[0, token, tt, q, step] = interleave(n[0], n[2], False)
                sXD[1, token, tt, q, step] = interleave(n[0], n[2], True)
                sXD[2, token, tt, q, step] = interleave(n[1], n[3], False)
                sXD[3, token, tt, q, step] = interleave(n[1], n[3], True)

    @cute.jit
    def stage_x(self, mX, mSX, sXD, l, first, count, k_chunks, m, x_coefficients, tidx, raw):
        """x's MMA words for steps first .. first + count - 1 (``store_x_piece``; rows past x's
        last are never read); ``raw``: this thread's first piece, loaded earlier."""
        total = count * 4 * self.config.x_rows
        threads = const_expr(32 * self.config.warps)
        if tidx < total:
            self.store_x_piece(sXD, raw, tidx)
        for piece in cutlass.range(tidx + threads, total, threads):
            self.store_x_piece(sXD, self.load_x_piece(mX, mSX, l, first, k_chunks, m,
                                                      x_coefficients, piece, total), piece)

    @cute.jit
    def load_step(self, words, scales, j, w_src, ws_src, w_d, first, step, count, k_chunks, t):
        """Register slot ``j`` <- this lane's codes (rows g, g + 8) and scale words of step
        ``step`` of the range (zeros past the range or K's end)."""
        valid = step < count and (first + step) * 4 + t < k_chunks
        at = cutlass.Int64(first + step)
        for h in cutlass.range_constexpr(2):
            v = load_v4(w_src[h] + at * 64, valid, self.config.l2_fetch)
            for q in cutlass.range_constexpr(4):
                words[q, h, j] = v[q]
            scales[h, j] = load_b32(ws_src[h] + at * (4 * w_d), valid)

    @cute.jit
    def stream_step(self, acc, words, scales, j, sXD, step, w_shift, g, t, m, half: cutlass.Constexpr):
        """The MMAs of one step from register slot ``j`` and x's staged words."""
        pairs = cute.make_rmem_tensor((2, 2), Int32)  # block, row half
        for h in cutlass.range_constexpr(2):
            s0, s1 = scale_pairs(scales[h, j], w_shift[h], half)
            pairs[0, h] = s0
            pairs[1, h] = s1
        for q in cutlass.range_constexpr(4):
            xf = cute.make_rmem_tensor((4,), Int32)
            xf.fill(0)
            if g < m:
                cute.autovec_copy(sXD[None, g, t, q, step], xf)
            top = decode_word(words[q, 0, j], pairs[q // 2, 0], half)
            bottom = decode_word(words[q, 1, j], pairs[q // 2, 1], half)
            for kb in cutlass.range_constexpr(2):
                mma_16816(acc[None, 0, 0, kb], top[2 * kb], bottom[2 * kb], top[2 * kb + 1],
                          bottom[2 * kb + 1], xf[2 * kb], xf[2 * kb + 1], half)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mSW: cute.Tensor, mX: cute.Tensor, mSX, mOut: cute.Tensor,
               mBias: cute.Tensor, mAlpha: cute.Tensor, mWork: cute.Tensor, mCount: cute.Tensor,
               splits: Int32, w_coefficients, x_coefficients):
        cfg = self.config
        stages, warps = const_expr(cfg.stages), const_expr(cfg.warps)
        tidx, _, _ = cute.arch.thread_idx()
        block, split, l = cute.arch.block_idx()
        warp, lane = tidx // 32, tidx % 32
        k_chunks = mW.shape[2] // 16  # 32-value chunks along K (16 bytes of codes)
        steps = (k_chunks + 3) // 4
        per_split = (steps + splits - 1) // splits
        first = split * per_split
        count = cutlass.max(cutlass.min(per_split, steps - first), 0)
        row0 = block * (16 * cfg.slabs * warps)

        smem = cutlass.memory.SmemAllocator()
        sW = smem.allocate_tensor(Int32, cute.make_layout((4, 32, 2, cfg.slabs, warps, stages)), 16)
        sWS = smem.allocate_tensor(Int32, cute.make_layout((32, 2, cfg.slabs, warps, stages)), 16)
        x_width = const_expr(4 if self.x_fp4 else 16)
        sX = smem.allocate_tensor(Int32, cute.make_layout((4, 32, x_width // 4, cfg.token_tiles, stages)), 16)
        sXS = sXD = None
        if const_expr(self.x_fp4):
            sXS = smem.allocate_tensor(Int32, cute.make_layout((32, cfg.token_tiles, stages)), 16)
            # decoded x, (pair, lane, word, tile, buffer): a lane's 4 pairs of a word in 16 bytes
            sXD = smem.allocate_tensor(Int32, cute.make_layout((4, 32, 4, cfg.token_tiles, 2)), 16)
        last = smem.allocate_tensor(Int32, cute.make_layout(1), 4)  # split: the block's last CTA

        # Two accumulators per slab and tile (even and odd k-blocks): two chains of MMAs.
        acc = cute.make_rmem_tensor((4, cfg.token_tiles, cfg.slabs, 2), Float32)
        acc.fill(0.0)
        plan = self.lane_plan(mW, mSW, mX, mSX, sW, sWS, sX, sXS, l, row0, k_chunks,
                              w_coefficients, x_coefficients, warp, lane, tidx)
        for p in cutlass.range_constexpr(stages - 1):
            if p < count:
                self.issue(plan, first + p, p, k_chunks)
            cute.arch.cp_async_commit_group()
        if const_expr(self.x_fp4):
            self.clear_absent_x(plan, sXD)
        for s in cutlass.range(count):
            cute.arch.cp_async_wait_group(stages - 2)
            if const_expr(self.x_fp4):
                self.decode_x(plan, sX, sXS, sXD, s % stages, s % 2)
            cute.arch.barrier()
            ahead = s + stages - 1
            if ahead < count:
                self.issue(plan, first + ahead, ahead % stages, k_chunks)
            cute.arch.cp_async_commit_group()
            self.step(acc, plan, sW, sWS, sX, sXD, s % stages, s % 2, warp, lane)
        cute.arch.cp_async_wait_group(0)
        for v in cutlass.range_constexpr(cute.size(acc) // 2):
            acc[v] = acc[v] + acc[v + cute.size(acc) // 2]
        self.finish(acc, mOut, mBias, mAlpha, mWork, mCount, last, splits, l, block, row0, warp,
                    lane, tidx)

    @cute.jit
    def lane_plan(self, mW, mSW, mX, mSX, sW, sWS, sX, sXS, l, row0, k_chunks, w_coefficients,
                  x_coefficients, warp, lane, tidx):
        """Everything of this thread's copies and reads that does not change from step to
        step: source addresses at step 0 (a step adds 64 bytes of codes, 256 or 64 bytes of x
        and ``4 D`` bytes of scale words, ``scale_index``), shared-memory addresses in stage
        0, and which half of each scale word is this lane's pair."""
        cfg = self.config
        g, t = lane // 4, lane % 4
        rows, m = mW.shape[1], mX.shape[1]
        w_src, w_dst, ws_src, ws_dst, w_shift = [], [], [], [], []
        for j in cutlass.range_constexpr(cfg.slabs):
            for h in cutlass.range_constexpr(2):
                r = cutlass.min(row0 + 16 * (warp * cfg.slabs + j) + 8 * h + g, rows - 1)
                w_src.append(_global(mW, (l, r, 16 * t)))
                w_dst.append(_shared(sW, (0, lane, h, j, warp, 0)))
                address, shift = scale_word(mSW, l, scale_index(r, t, w_coefficients))
                ws_src.append(address)
                ws_dst.append(_shared(sWS, (lane, h, j, warp, 0)))
                w_shift.append(shift)
        x_src, x_dst, x_in, x_ok, x_group, xs_src, xs_dst = [], [], [], [], [], [], []
        x_lane, x_tile, x_shift = [], [], []  # NVFP4 x: where each piece sits, its scale's half
        threads = const_expr(32 * cfg.warps)
        if const_expr(self.x_fp4):
            pieces = const_expr(8 * cfg.token_tiles * 4)  # (token, t): 16 bytes and a scale word
            for base in cutlass.range_constexpr(0, pieces, threads):
                piece = base + tidx
                token, tt = piece // 4, piece % 4
                ok = piece < pieces and token < m
                src_token = cutlass.select_(ok, token, 0)
                x_src.append(_global(mX, (l, src_token, 16 * tt)))
                x_dst.append(_shared(sX, (0, (token % 8) * 4 + tt, 0, token // 8, 0)))
                x_in.append(piece < pieces)
                x_ok.append(ok)
                x_group.append(tt)
                address, shift = scale_word(mSX, l, scale_index(src_token, tt, x_coefficients))
                xs_src.append(address)
                xs_dst.append(_shared(sXS, ((token % 8) * 4 + tt, token // 8, 0)))
                x_lane.append((token % 8) * 4 + tt)
                x_tile.append(token // 8)
                x_shift.append(shift)
        else:
            pieces = const_expr(8 * cfg.token_tiles * 16)  # (token, 8-value group)
            for base in cutlass.range_constexpr(0, pieces, threads):
                piece = base + tidx
                token, group = piece // 16, piece % 16
                ok = piece < pieces and token < m
                x_src.append(_global(mX, (l, cutlass.select_(ok, token, 0), group * 8)))
                x_dst.append(_shared(sX, (0, (token % 8) * 4 + group // 4, group % 4, token // 8, 0)))
                x_in.append(piece < pieces)
                x_ok.append(ok)
                x_group.append(group // 4)
        return (w_src, w_dst, ws_src, ws_dst, w_shift, x_src, x_dst, x_in, x_ok, x_group, xs_src,
                xs_dst, (x_lane, x_tile, x_shift), lane % 4, w_coefficients[3], x_coefficients[3])

    @cute.jit
    def decode_x(self, plan, sX, sXS, sXD, stage, buf):
        """NVFP4 x: each thread decodes the pieces of ring stage ``stage`` it copied itself
        (after its own cp.async wait, before the step's barrier) into decoded buffer ``buf``,
        in the order the MMA lanes read them -- once per CTA instead of once per warp."""
        half = const_expr(self.config.half)
        x_in, x_ok = plan[7], plan[8]
        x_lane, x_tile, x_shift = plan[12]
        for e in cutlass.range_constexpr(len(x_in)):
            if x_in[e] and x_ok[e]:
                x0, x1 = scale_pairs(sXS[x_lane[e], x_tile[e], stage], x_shift[e], half)
                for q in cutlass.range_constexpr(4):
                    d = decode_word(sX[q, x_lane[e], 0, x_tile[e], stage], x0 if q < 2 else x1, half)
                    for p in cutlass.range_constexpr(4):
                        sXD[p, x_lane[e], q, x_tile[e], buf] = d[p]

    @cute.jit
    def clear_absent_x(self, plan, sXD):
        """Zeros, once, in both decoded buffers for the tile rows past x's last row (never
        decoded)."""
        x_in, x_ok = plan[7], plan[8]
        x_lane, x_tile, _ = plan[12]
        for e in cutlass.range_constexpr(len(x_in)):
            if x_in[e] and not x_ok[e]:
                for b in cutlass.range_constexpr(2):
                    for q in cutlass.range_constexpr(4):
                        for p in cutlass.range_constexpr(4):
                            sXD[p, x_lane[e], q, x_tile[e], b] = Int32(0)

    @cute.jit
    def issue(self, plan, step, stage, k_chunks):
        """cp.async of step ``step`` into ring stage ``stage``: this lane's codes and scale words
        of its warp's rows, and this thread's share of the step's x rows."""
        (w_src, w_dst, ws_src, ws_dst, _, x_src, x_dst, x_in, x_ok, x_group, xs_src, xs_dst, _,
         t, w_d, x_d) = plan
        step64 = cutlass.Int64(step)
        valid = step * 4 + t < k_chunks
        w_stage = const_expr(4 * self.w_words)  # bytes per stage of each ring
        ws_stage = const_expr(4 * self.ws_words)
        x_stage = const_expr(4 * self.x_words)
        xs_stage = const_expr(4 * self.xs_words)
        for e in cutlass.range_constexpr(len(w_src)):
            copy_async(w_dst[e] + stage * w_stage, w_src[e] + step64 * 64, 16, valid)
            copy_async(ws_dst[e] + stage * ws_stage, ws_src[e] + step64 * (4 * w_d), 4, valid)
        x_step = const_expr(64 if self.x_fp4 else 256)  # bytes of one row of x per step
        for e in cutlass.range_constexpr(len(x_src)):
            if x_in[e]:  # a piece of the step's x (threads past the last have none)
                ok = x_ok[e] and step * 4 + x_group[e] < k_chunks
                copy_async(x_dst[e] + stage * x_stage, x_src[e] + step64 * x_step, 16, ok)
                if const_expr(self.x_fp4):
                    copy_async(xs_dst[e] + stage * xs_stage, xs_src[e] + step64 * (4 * x_d), 4, ok)

    @cute.jit
    def step(self, acc, plan, sW, sWS, sX, sXD, stage, buf, warp, lane):
        """The MMAs of one step from ring stage ``stage`` (NVFP4 x: decoded buffer ``buf``):
        word q of the lane's 32 codes (block q / 2) is two k-blocks, for every slab and token
        tile."""
        cfg = self.config
        half = const_expr(cfg.half)
        slabs, tiles = const_expr(cfg.slabs), const_expr(cfg.token_tiles)
        w_shift = plan[4]
        words = cute.make_rmem_tensor((4, 2, slabs), Int32)
        pairs = cute.make_rmem_tensor((2, 2, slabs), Int32)  # block, row half, slab
        for j in cutlass.range_constexpr(slabs):
            for h in cutlass.range_constexpr(2):
                cute.autovec_copy(sW[None, lane, h, j, warp, stage], words[None, h, j])
                s0, s1 = scale_pairs(sWS[lane, h, j, warp, stage], w_shift[2 * j + h], half)
                pairs[0, h, j] = s0
                pairs[1, h, j] = s1
        for q in cutlass.range_constexpr(4):
            xf = cute.make_rmem_tensor((4, tiles), Int32)
            for i in cutlass.range_constexpr(tiles):
                if const_expr(self.x_fp4):
                    cute.autovec_copy(sXD[None, lane, q, i, buf], xf[None, i])
                else:
                    natural = cute.make_rmem_tensor((4,), Int32)
                    cute.autovec_copy(sX[None, lane, q, i, stage], natural)
                    xf[0, i] = interleave(natural[0], natural[2], False)
                    xf[1, i] = interleave(natural[0], natural[2], True)
                    xf[2, i] = interleave(natural[1], natural[3], False)
                    xf[3, i] = interleave(natural[1], natural[3], True)
            for j in cutlass.range_constexpr(slabs):
                top = decode_word(words[q, 0, j], pairs[q // 2, 0, j], half)
                bottom = decode_word(words[q, 1, j], pairs[q // 2, 1, j], half)
                for kb in cutlass.range_constexpr(2):
                    for i in cutlass.range_constexpr(tiles):
                        mma_16816(acc[None, i, j, kb], top[2 * kb], bottom[2 * kb], top[2 * kb + 1],
                                  bottom[2 * kb + 1], xf[2 * kb, i], xf[2 * kb + 1, i], half)

    @cute.jit
    def finish(self, acc, mOut, mBias, mAlpha, mWork, mCount, last, splits, l, block, row0, warp,
               lane, tidx):
        """The outputs: straight from the accumulators (one range of K), or through the
        workspace, written by the block's last CTA (module docstring)."""
        cfg = self.config
        g, t = lane // 4, lane % 4
        rows, m = mOut.shape[2], mOut.shape[1]
        alpha = mAlpha[0] * Float32(float(2 ** cfg.exponent))
        # Where the MMA left each of this lane's sums: C fragment rows g, g + 8 of each slab,
        # columns (tokens) 2 t, 2 t + 1 of each tile.
        for j in cutlass.range_constexpr(cfg.slabs):
            for i in cutlass.range_constexpr(cfg.token_tiles):
                for v in cutlass.range_constexpr(4):
                    row = row0 + 16 * (warp * cfg.slabs + j) + g + 8 * (v // 2)
                    token = 8 * i + 2 * t + v % 2
                    if row < rows and token < m:
                        if const_expr(cfg.split):
                            red_add(_global(mWork, (l, token, row)), acc[v, i, j, 0])
                        else:
                            value = acc[v, i, j, 0] * alpha + mBias[row].to(Float32)
                            mOut[l, token, row] = value.to(mOut.element_type)
        if const_expr(cfg.split):
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier()
            if tidx == 0:
                arrived = cute.arch.atomic_add(_pointer(mCount, (l, block)), Int32(1),
                                               sem="acq_rel", scope="gpu")
                last[0] = cutlass.select_(arrived == splits - 1, Int32(1), Int32(0))
            cute.arch.barrier()
            if last[0] == 1:
                cute.arch.fence_acq_rel_gpu()
                cta_rows = const_expr(16 * cfg.slabs * cfg.warps)
                for e in cutlass.range(tidx, cta_rows * 8 * cfg.token_tiles, 32 * cfg.warps):
                    r, token = e % cta_rows, e // cta_rows
                    row = row0 + r
                    if row < rows and token < m:
                        where = _global(mWork, (l, token, row))
                        value = load_cg(where) * alpha + mBias[row].to(Float32)
                        mOut[l, token, row] = value.to(mOut.element_type)
                        store_cg(where, Float32(0.0))
                if tidx == 0:
                    mCount[l, block] = 0


def _pointer(tensor: cute.Tensor, coord):
    return tensor.iterator + cute.crd2idx(coord, tensor.layout)


def _shared(tensor: cute.Tensor, coord) -> Int32:
    """The shared-memory address of ``tensor[coord]``."""
    return Int32(_pointer(tensor, coord).toint())


def _global(tensor: cute.Tensor, coord) -> cutlass.Int64:
    """The global-memory address of ``tensor[coord]``."""
    return cutlass.Int64(_pointer(tensor, coord).toint())
