"""NVFP4 weights times bf16 activations on the GEMM's own pipeline (TMA + wgmma), for Hopper.

``out = alpha * x @ dequantize(w)^T (+ bias)`` with w prepared once by ``nvfp4_prepare_weight``
(``prepare_weight`` below: the same codes, regrouped, and the e4m3 scales as bf16). The kernel is
``GemmSm90`` computing the transposed product, ``out^T = W x^T``: the weight's rows fill the
MMA's M (64 per MMA warpgroup), the tokens its N (16 .. 256), so a decode step of a few tokens
and a prefill of thousands run the same kernel with different tiles.

Design:
  - Prepared weight: per 64-row slab and 64 values of K, one 2560-byte chunk -- 2048 bytes of
    codes in the order the MMA warpgroup's threads read them (thread t's 16 bytes at 16 t, one
    32-bit word per k-block of 16) and 512 bytes of the slab's block scales as bf16 times 2^118
    (exact for every e4m3 value, NaN included; 16 bytes per 4-thread row group: the scales of
    its rows g and g + 8 for the 4 k-blocks). The scales take twice their e4m3 bytes (11% more
    bytes in all) so that a k-block's two scales are the multiplies' operands as they are
    instead of ~10 conversions: the kernel is bound by its instruction stream, not by memory.
    A 2-D uint8 tensor holds the chunks as lines of 256 bytes, a slab's 20 lines per 128
    values of K (two chunks, one after the other) side by side along K. A k-tile of 128
    values (8 k-blocks) is one 20 x 256-byte TMA box per slab of that tensor; a k-tile of one
    chunk (4 k-blocks) reads the same memory through a 5-D view (line, slab) x (byte, (chunk
    of the pair, pair)), so both are the GEMM's own producer loads, each with its box.
  - A word of a k-block holds the 8 codes of one thread's wgmma A fragment (rows g and g + 8,
    columns 2c, 2c + 1 and 2c + 8, 2c + 9 of the k-block: lane = 4g + c), fragment register i
    the pair (even column, odd column). Its 32 bits are placed (``WORD_BITS``) so that a bf16
    pair comes out of one mask: the mask 0x81C081C0 keeps each half's sign (bit 15) and
    magnitude (bits 8..6: the bf16 value is the code times 2^-126) of the word itself for
    register 0, of the word rotated by 3 and by 6 bits for registers 1 and 2; register 3's
    bits, which no rotation can place (no four rotations of the mask tile the word), go by one
    integer multiply making three non-overlapping shifted copies: 8 integer operations per
    word (13 for the plain nibble order, the skinny kernel's decode). Then one
    ``mul.bf16x2`` by the row's block scale times 2^118 (one bf16 of the scale word, taken
    twice: ptxas folds the duplication into the multiply's operand): code * scale * 2^-8,
    exact.
  - 8 k-blocks per k-tile (64-row tiles, few tokens): the MMA warpgroups read a stage's codes
    and scales with four 16-byte shared loads per thread and decode its 8 k-blocks into
    registers of their own while the previous k-tile's wgmmas run; then they wait for those
    (they read the A fragment), release their stage, move the decoded values into the A
    fragment (after the wait: a fragment register rewritten while a wgmma reads it would be
    corrupted) and issue 8 register-sourced wgmmas against x's swizzled stage (B from shared
    memory, as the GEMM's).
  - 4 k-blocks per k-tile (128-row tiles, many tokens: a stage of 37 KB instead of 74 at
    128 x 256, five stages instead of two): one wgmma group per k-block, k-block b + 1 decoded
    into its fragment slot while b and b - 1 run, a wait for all but the last two groups after
    each issue, the next k-tile's first k-block decoded under the current one's last, a stage
    released one k-block into the next k-tile; no drain between k-tiles. Clusters of two tiles
    along M share x's k-tiles by TMA multicast.
  - One warpgroup's decode is bound by its own instruction stream (one warp per scheduler), so
    narrow tiles give each SM more of them: two CTAs per SM (``ctas_per_sm``) where there are
    more tiles than SMs, else ``split_k``: two or three MMA warpgroups on one 64-row tile, each
    taking every second or third k-tile into its own accumulator; the others leave their sums in
    their epilogue buffers, warpgroup 0 adds them and stores the tile.
  - Everything else is the GEMM's: persistent tiles, stream-K tail, clusters along M sharing x
    by TMA multicast, the epilogue's TMA stores of ``out^T`` (a column-major view of out), a bias
    per weight row.

Constraints:
  - x bf16 (M, K) and out (M, N) with unit last strides, K and N multiples of 8 (16-byte rows
    for TMA); the weight prepared by ``prepare_weight`` (N and K padded to 64 rows and 128
    values with zero codes and scales)
  - tile M 64 or 128 (one or two MMA warpgroups of 64 rows), tile N 16 .. 256, 4 or 8
    k-blocks per k-tile (one or two chunks), clusters of 1, 2 or 4 along M, no ping-pong, no
    fp8 options
  - ``split_k`` (``warpgroups`` 2 or 3 on a 64-row tile): tile N <= 64, one CTA per SM; with
    stream-K every MMA warpgroup's accumulator takes a workspace slot (warpgroup 0's holds the
    CTA's sum), so a CTA's slot is ``warpgroups * 64 * tile N`` fp32 values
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, const_expr

from ..gemm.config import GemmConfig
from ..gemm.kernel_sm90 import GemmSm90, _load_or
from ..primitives.named_barriers import GemmBarrier

CHUNK_ROWS = 64  # weight rows per chunk: one MMA warpgroup's M
CHUNK_K = 64  # values of K per chunk: 4 k-blocks of 16
K_ALIGN = 128  # K is padded to whole 128-value k-tiles (two chunks)
CODE_BYTES = CHUNK_ROWS * CHUNK_K // 2  # 2048
SCALE_BYTES = CHUNK_ROWS * CHUNK_K // 16 * 2  # 512: bf16 scales
LINE = 256  # bytes per line of a chunk
CHUNK_LINES = (CODE_BYTES + SCALE_BYTES) // LINE  # 10
CHUNK_BYTES = CHUNK_LINES * LINE  # 2560
K_BLOCKS = (4, 8)  # k-blocks of 16 per k-tile: one or two chunks
SCALE_FACTOR = 2.0 ** 118  # the prepared scales' factor (the decoded codes carry 2^-126)
DECODE_EXPONENT = 8  # the decoded values are code * scale * 2^-8
# Where a prepared word keeps its codes' bits: [fragment register i][even, odd column][code bit
# 0 .. 3 (mantissa, exponent, exponent, sign)]. Registers 0 .. 2 are the word rotated right by
# 0 / 3 / 6 bits and masked with DECODE_MASK; register 3 is (word & 0x001B001B) * 0x1084 masked:
# shifts by 2, 7 and 12 (bit 4 -> 6, bits 0, 1 -> 7, 8, bit 3 -> 15), whose copies never overlap.
WORD_BITS = (((6, 7, 8, 15), (22, 23, 24, 31)),
             ((9, 10, 11, 18), (25, 26, 27, 2)),
             ((12, 13, 14, 21), (28, 29, 30, 5)),
             ((4, 0, 1, 3), (20, 16, 17, 19)))
DECODE_MASK = 0x81C081C0  # a bf16 pair's signs and top three exponent / mantissa bits
# ``split_k`` over 2 / 3 MMA warpgroups: (producer, MMA warpgroup) registers (setmaxnreg). The
# CTA's allocation is its threads times the launch's registers (65536 / threads, in steps of 8:
# 168 / 128), and the two together may not ask for more: 128 * 40 + 256 * 232 <= 384 * 168,
# 128 * 40 + 384 * 152 <= 512 * 128. (Four warpgroups fit at 24 / 112 and measured slower.)
SPLIT_REGISTERS = {2: (40, 232), 3: (40, 152)}


# ----------------------------------------------------------------------------- host side


def prepare_weight(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Plain NVFP4 (N, K / 2) codes and (N, K / 16) e4m3 scales (uint8 views) -> the kernel's
    chunks, a uint8 (slabs * 20, k_tiles * 256) tensor (module docstring; N padded to 64 rows and
    K to 128 values with zeros)."""
    n, half_k = codes.shape
    k = half_k * 2
    slabs, chunks = -(-n // CHUNK_ROWS), -(-k // K_ALIGN) * (K_ALIGN // CHUNK_K)
    device = codes.device
    c = torch.zeros(slabs * CHUNK_ROWS, chunks * CHUNK_K // 2, dtype=torch.uint8, device=device)
    c[:n, :half_k] = codes
    s = torch.zeros(slabs * CHUNK_ROWS, chunks * CHUNK_K // 16, dtype=torch.uint8, device=device)
    s[:n, :k // 16] = scales
    # Rows 16 w + 8 h + g of a slab, bytes 8 kb + 4 q + c of a chunk's 32 per row.
    v = c.view(slabs, 4, 2, 8, chunks, 4, 2, 4).permute(0, 4, 5, 1, 3, 7, 6, 2)
    v = v.reshape(slabs, chunks, 4, 4, 8, 4, 4).to(torch.int32)  # ..., kb, w, g, c, i = h + 2 q
    words = torch.zeros(v.shape[:-1], dtype=torch.int64, device=device)
    for i, halves in enumerate(WORD_BITS):
        for half, places in enumerate(halves):
            code = (v[..., i] >> (4 * half)) & 15
            for bit, place in enumerate(places):
                words |= ((code >> bit) & 1).to(torch.int64) << place
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    # (slab, chunk, w, g, c, kb): thread 32 w + 4 g + c's 16 bytes.
    words = words.permute(0, 1, 3, 4, 5, 2).contiguous()
    code_bytes = words.view(torch.uint8).reshape(slabs, chunks, CODE_BYTES)
    wide = (s.view(torch.float8_e4m3fn).float() * SCALE_FACTOR).to(torch.bfloat16).view(torch.uint16)
    # (slab, chunk, w, g, kb, h): a row group's 4 k-blocks in 16 bytes
    sv = wide.view(slabs, 4, 2, 8, chunks, 4).permute(0, 4, 1, 3, 5, 2)
    scale_bytes = sv.contiguous().view(torch.uint8).reshape(slabs, chunks, SCALE_BYTES)
    pairs = chunks // 2  # a slab's 20 lines per 128 values of K: a pair of chunks
    lines = torch.cat((code_bytes, scale_bytes), dim=2).view(slabs, pairs, 2 * CHUNK_LINES, LINE)
    return lines.permute(0, 2, 1, 3).reshape(slabs * 2 * CHUNK_LINES, pairs * LINE).contiguous()


def unprepare_weight(data: torch.Tensor, n: int, k: int) -> tuple:
    """The inverse of ``prepare_weight``: (codes (N, K / 2), scales (N, K / 16)), uint8 (a NaN
    scale comes back as 0x7F)."""
    slabs, pairs = data.shape[0] // (2 * CHUNK_LINES), data.shape[1] // LINE
    chunks = 2 * pairs
    lines = data.view(slabs, 2 * CHUNK_LINES, pairs, LINE).permute(0, 2, 1, 3)
    lines = lines.reshape(slabs, chunks, -1)
    words = lines[..., :CODE_BYTES].contiguous().view(torch.int32).view(slabs, chunks, 4, 8, 4, 4)
    words = words.permute(0, 1, 5, 2, 3, 4)  # slab, chunk, kb, w, g, c
    words = words.to(torch.int64) & 0xFFFFFFFF
    v = torch.zeros(words.shape + (4,), dtype=torch.int64, device=data.device)
    for i, halves in enumerate(WORD_BITS):
        for half, places in enumerate(halves):
            for bit, place in enumerate(places):
                v[..., i] |= ((words >> place) & 1) << (bit + 4 * half)
    v = v.to(torch.uint8)  # slab, chunk, kb, w, g, c, i = h + 2 q
    v = v.view(slabs, chunks, 4, 4, 8, 4, 2, 2).permute(0, 3, 7, 4, 1, 2, 6, 5)
    codes = v.reshape(slabs * CHUNK_ROWS, chunks * CHUNK_K // 2)
    wide = lines[..., CODE_BYTES:].contiguous().view(torch.bfloat16).view(slabs, chunks, 4, 8, 4, 2)
    sv = wide.permute(0, 2, 5, 3, 1, 4).reshape(slabs * CHUNK_ROWS, chunks * CHUNK_K // 16)
    scales = (sv.float() / SCALE_FACTOR).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes[:n, :k // 2].contiguous(), scales[:n, :k // 16].contiguous()


# ----------------------------------------------------------------------------- device side


_DECODE_ROWS = " ".join([
    "{ .reg .b32 p;",
    f"and.b32 p, {{$r0}}, {DECODE_MASK:#x}; mul.rn.bf16x2 {{$w0}}, p, {{$r1}};",
    f"shf.r.wrap.b32 p, {{$r0}}, {{$r0}}, 3; and.b32 p, p, {DECODE_MASK:#x};"
    " mul.rn.bf16x2 {$w1}, p, {$r2};",
    f"shf.r.wrap.b32 p, {{$r0}}, {{$r0}}, 6; and.b32 p, p, {DECODE_MASK:#x};"
    " mul.rn.bf16x2 {$w2}, p, {$r1};",
    f"and.b32 p, {{$r0}}, 0x001B001B; mul.lo.u32 p, p, 0x1084; and.b32 p, p, {DECODE_MASK:#x};"
    " mul.rn.bf16x2 {$w3}, p, {$r2};",
    "}"])


@cute.jit
def decode_rows(word: Int32, top: Int32, bottom: Int32):
    """The four scaled A registers of one k-block from its word (``WORD_BITS``) and the scale
    pairs of rows g (registers 0, 2) and g + 8 (1, 3), bf16 times 2^118 (module docstring)."""
    return cute.arch.inline_ptx(_DECODE_ROWS, write_only_types=[Int32] * 4,
                                read_only_args=[word, top, bottom])


@cute.jit
def _pair(word: Int32, upper: cutlass.Constexpr) -> Int32:
    """(word's low bf16, twice), or its high one: a duplication ptxas folds into the operand of
    the multiply that reads it (``HMUL2 ... R.H0_H0``), no instruction of its own."""
    half = "hi" if const_expr(upper) else "lo"
    return cute.arch.inline_ptx(f"{{ .reg .b16 lo, hi; mov.b32 {{lo, hi}}, {{$r0}};"
                                f" mov.b32 {{$w0}}, {{{half}, {half}}}; }}",
                                write_only_types=[Int32], read_only_args=[word])


def _transposed(t: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 0]))


@cute.jit
def _st_shared_f32(address: Int32, value: Float32):
    cute.arch.inline_ptx("st.shared.f32 [{$r0}], {$r1};", read_only_args=[address, value])


@cute.jit
def _ld_shared_f32(address: Int32) -> Float32:
    return cute.arch.inline_ptx("ld.shared.f32 {$w0}, [{$r0}];", write_only_types=[Float32],
                                read_only_args=[address])


@cute.jit
def load_shared_v4(address: Int32):
    """Four 32-bit words from 16 aligned bytes of shared memory."""
    return cute.arch.inline_ptx("ld.shared.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                                write_only_types=[Int32] * 4, read_only_args=[address])


@cute.jit
def _after_wait(value):
    """A copy of ``value`` made where this call stands in program order (an asm that the
    compiler does not move across the wgmma wait before it), in a register of its own."""
    return cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[type(value)],
                                read_only_args=[value])


class W4A16GemmSm90(GemmSm90):
    """See the module docstring. Arguments as ``GemmSm90``'s: A the prepared weight (2-D
    uint8), then x (M, K) and out (M, N) (B and D transposed); ``mBias`` the per-weight-row
    bias, ``mScaleA`` the global scale (one fp32, ``Epilogue.scalar_scale_a``); alpha 2^8."""

    a_source = cute.nvgpu.warpgroup.OperandSource.RMEM

    def __init__(self, config: GemmConfig):
        if (config.tile_m not in (64, 128) or config.k_blocks not in K_BLOCKS or config.pingpong
                or config.swap_ab or config.pad_k or config.cluster_n != 1
                or config.cluster_m not in (1, 2, 4)
                or config.fp8_promote_every or config.epilogue_mma
                or not config.epilogue.scalar_scale_a or config.epilogue.row_scale
                or config.epilogue.col_scale or config.epilogue.residual
                or config.warpgroups not in (0, *SPLIT_REGISTERS) or config.warpgroups and (
                    config.tile_m != 64 or config.tile_n > 64 or config.ctas_per_sm != 1)):
            raise ValueError(f"unsupported W4A16 configuration {config}: tile M 64 / 128, "
                             f"{' or '.join(map(str, K_BLOCKS))} k-blocks, clusters of 1, 2 or "
                             f"4 along M, no "
                             f"ping-pong, swap, pad_k or fp8 options; a scalar scale for A, at "
                             f"most a bias; 2 or 3 warpgroups only on 64 x <= 64 tiles (split K)")
        # split_k (module docstring): the GEMM is built for one warpgroup per 64-row tile, then
        # given the others.
        self.split_k = config.warpgroups
        super().__init__(dataclasses.replace(config, warpgroups=0) if self.split_k else config)
        # one chunk per k-tile: per-k-block decode and wgmma groups (``interleaved_k_tiles``)
        self.interleave = config.k_blocks * 16 == CHUNK_K and not self.split_k
        if self.split_k:
            self.config, self.num_mma_wg, self.threads = config, self.split_k, config.threads
            self.producer_registers, self.mma_registers = SPLIT_REGISTERS[self.split_k]

    @cute.jit
    def __call__(self, mA, mX, mOut, mC, mBias, mScaleA, mScaleB, mZeroA, mSumB, mWork, mFlags,
                 mSrcA, mSrcB, alpha: Float32, beta: Float32, token: cutlass.Int64, stream):
        """``GemmSm90``'s launch with x (M, K) and out (M, N) in their own order: their
        transposes, the GEMM's B and D, are made here (no views to make per call)."""
        GemmSm90.__call__(self, self.chunk_view(mA), _transposed(mX), _transposed(mOut), mC,
                          mBias, mScaleA, mScaleB, mZeroA, mSumB, mWork, mFlags, mSrcA, mSrcB,
                          alpha, beta, token, stream)

    def chunk_view(self, data: cute.Tensor) -> cute.Tensor:
        """The prepared weight as the GEMM's A: its (rows, bytes) as they are for k-tiles of two
        chunks; for one chunk per k-tile, lines (line, slab) by bytes (byte, (chunk of the pair,
        pair)), so that a k-tile's box holds one chunk of each slab."""
        if const_expr(self.config.k_blocks * 16 == CHUNK_K):
            stride = data.stride[0]
            pair_lines = 2 * CHUNK_LINES
            layout = cute.make_layout(
                ((CHUNK_LINES, data.shape[0] // pair_lines), (LINE, (2, data.shape[1] // LINE))),
                stride=((stride, pair_lines * stride), (1, (CHUNK_LINES * stride, LINE))))
            data = cute.make_tensor(data.iterator, layout)
        return data

    def mma_a_dtype(self, a, b):
        return b.element_type  # the decoded weight: x's dtype

    def a_stage_tiler(self):
        """(lines, bytes): the k-tile's chunks of each of the tile's slabs, slab after slab."""
        chunks = self.config.k_blocks * 16 // CHUNK_K
        return (CHUNK_LINES * chunks * (self.config.tile_m // CHUNK_ROWS), LINE)

    def a_stage_layout(self):
        lines = self.a_tiler[0]
        plain = cute.make_layout((lines, LINE, self.ab_stages), stride=(LINE, 1, lines * LINE))
        return cute.make_composed_layout(cute.make_swizzle(0, 4, 3), 0, plain)  # no swizzle

    def a_operand(self, tiled_mma, sA, sD, row_block, tidx):
        """(the A fragment of one k-tile, this thread's code and scale addresses in stage 0,
        where warpgroup 1 leaves its partial sum with ``split_k``: its epilogue buffers, the
        next warpgroups' in theirs)."""
        frag = tiled_mma.make_fragment_A(
            tiled_mma.get_slice(0).partition_shape_A((CHUNK_ROWS, self.tile_mnk[2])))
        block = 0 if const_expr(self.split_k) else row_block  # split K: one slab for all
        slab_lines = const_expr(self.a_tiler[0] // (self.config.tile_m // CHUNK_ROWS))
        chunk = Int32((sA.iterator + cute.crd2idx((block * slab_lines, 0, 0), sA.layout)).toint())
        partial = None
        if const_expr(self.split_k):
            wg1_buffers = self.config.epi_stages * self.epi_tile[0] * self.epi_tile[1]  # elements
            if const_expr(wg1_buffers * self.d_dtype.width // 8 < 64 * self.config.tile_n * 4):
                raise ValueError(f"split K: warpgroup 1's epilogue buffers cannot hold its "
                                 f"partial sum: {self.config}")
            partial = Int32(sD.iterator.toint()) + wg1_buffers * (self.d_dtype.width // 8) + tidx * 4
        # Thread t's codes at byte 16 t of a chunk, its row group's scales at CODE_BYTES + 16 t / 4
        return frag, chunk + tidx * 16, chunk + CODE_BYTES + (tidx // 4) * 16, partial

    @cute.jit
    def mma_k_tiles(self, tiled_mma, acc, mma_acc, tCrA, tCrB, mainloop, read, release, k_first,
                    k_end, k_tiles, zero: cutlass.Constexpr = True, hand_over=None,
                    nonempty: cutlass.Constexpr = False):
        """``acc`` (+)= the MMAs over k-tiles ``k_first .. k_end - 1`` (module docstring)."""
        frag, codes, scales, partial = tCrA
        if const_expr(zero):
            acc.fill(0.0)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        if const_expr(self.split_k):
            read, release = self.split_k_tiles(tiled_mma, acc, frag, codes, scales, partial,
                                               tCrB, mainloop, read, k_first, k_end)
        elif const_expr(self.interleave):
            read, release = self.interleaved_k_tiles(tiled_mma, acc, frag, codes, scales, tCrB,
                                                     mainloop, read, release, k_first, k_end)
        else:
            for k in range(k_first, k_end):
                self.k_tile(tiled_mma, acc, frag, codes, scales, tCrB, mainloop, read, release,
                            k > k_first)
                read.advance()
                if k > k_first:
                    release.advance()
            cute.nvgpu.warpgroup.wait_group(0)
            if k_end > k_first:
                mainloop.consumer_release(release)
                release.advance()
        return tiled_mma, read, release

    @cute.jit
    def interleaved_k_tiles(self, tiled_mma, acc, frag, codes, scales, tCrB, mainloop, read,
                            release, k_first, k_end):
        """One chunk per k-tile, one wgmma group per k-block: k-block b + 1 decoded into its
        fragment slot while b and b - 1 run (the next k-tile's block 0 under the last block),
        a wait after every issue for all but the last two groups; a stage released at block 1
        of the next k-tile (its groups are retired by then). Returns (read, release) advanced."""
        regs = cute.recast_tensor(frag, Int32)
        words = cute.make_rmem_tensor((4,), Int32)
        pairs = cute.make_rmem_tensor((4,), Int32)
        stage_bytes = const_expr(self.a_tiler[0] * LINE)
        tiles = k_end - k_first
        if tiles > 0:
            mainloop.consumer_wait(read)
            self.load_chunk(words, pairs, codes, scales, read.index * stage_bytes)
            self.decode_block(regs, words, pairs, 0)
        for k in range(tiles):
            stage = read.index
            read.advance()
            for b in cutlass.range_constexpr(4):
                if const_expr(b < 3):
                    self.decode_block(regs, words, pairs, b + 1)
                else:
                    if k + 1 < tiles:
                        mainloop.consumer_wait(read)
                        self.load_chunk(words, pairs, codes, scales, read.index * stage_bytes)
                        self.decode_block(regs, words, pairs, 0)
                cute.nvgpu.warpgroup.fence()
                cute.gemm(tiled_mma, acc, frag[(None, None, b)], tCrB[(None, None, b, stage)], acc)
                cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(2)
                if const_expr(b == 1):
                    if k > 0:
                        mainloop.consumer_release(release)
                        release.advance()
        cute.nvgpu.warpgroup.wait_group(0)
        if tiles > 0:
            mainloop.consumer_release(release)
            release.advance()
        return read, release

    @cute.jit
    def load_chunk(self, words, pairs, codes, scales, offset):
        """This thread's code words and scale pairs of one chunk (k-tile) of a stage."""
        w = load_shared_v4(codes + offset)
        p = load_shared_v4(scales + offset)
        for j in cutlass.range_constexpr(4):
            words[j] = w[j]
            pairs[j] = p[j]

    @cute.jit
    def decode_block(self, regs, words, pairs, b: cutlass.Constexpr):
        """k-block ``b``'s four A registers decoded and moved into its fragment slot (the move
        stays where it stands in program order: after the wait that freed the slot)."""
        r = self.a_registers(words[b], pairs[b])
        for i in cutlass.range_constexpr(4):
            regs[4 * b + i] = _after_wait(r[i])

    @cute.jit
    def split_k_tiles(self, tiled_mma, acc, frag, codes, scales, partial, tCrB, mainloop, read,
                      k_first, k_end):
        """``split_k``: this warpgroup's k-tiles (every ``split_k``-th one) into ``acc``, then
        warpgroup 0 adds the others' sums. Returns (read, release) at the tile's end."""
        wgs = const_expr(self.split_k)
        wg = cute.arch.make_warp_uniform(cute.arch.thread_idx()[0] // 128) - 1
        state = read.clone()  # this warpgroup's next k-tile
        for _ in range(wg):
            state.advance()
        previous = state.clone()  # and its previous one
        mine = (k_end - k_first - wg + wgs - 1) // wgs
        for j in range(mine):
            self.k_tile(tiled_mma, acc, frag, codes, scales, tCrB, mainloop, state, previous, j > 0)
            if j > 0:
                for _ in cutlass.range_constexpr(wgs):
                    previous.advance()
            for _ in cutlass.range_constexpr(wgs):
                state.advance()
        cute.nvgpu.warpgroup.wait_group(0)
        if mine > 0:
            mainloop.consumer_release(previous)
        for _ in range(k_first, k_end):  # past all warpgroups' k-tiles of the tile
            read.advance()
        size = const_expr(cute.size(acc))
        region = const_expr(self.config.epi_stages * self.epi_tile[0] * self.epi_tile[1]
                            * self.d_dtype.width // 8)  # one warpgroup's epilogue buffers
        if wg > 0:
            mine_at = partial + (wg - 1) * region
            for i in cutlass.range_constexpr(size):
                _st_shared_f32(mine_at + i * 512, _after_wait(acc[i]))
        cute.arch.barrier(barrier_id=int(GemmBarrier.SPLIT_K_PARTIAL), number_of_threads=128 * wgs)
        if wg == 0:
            for w in cutlass.range_constexpr(wgs - 1):
                for i in cutlass.range_constexpr(size):
                    acc[i] = _after_wait(acc[i]) + _ld_shared_f32(partial + w * region + i * 512)
        cute.arch.barrier(barrier_id=int(GemmBarrier.SPLIT_K_READ), number_of_threads=128 * wgs)
        return read, read.clone()

    @cute.jit
    def k_tile(self, tiled_mma, acc, frag, codes, scales, tCrB, mainloop, read, previous,
               release_previous):
        """One k-tile from stage ``read``: its codes and scales decoded under the MMAs in flight,
        then (once those are done) stage ``previous`` released where ``release_previous``, the
        decoded values moved into ``frag`` and the k-tile's MMAs issued."""
        regs = cute.recast_tensor(frag, Int32)
        decoded = cute.make_rmem_tensor((cute.size(regs),), Int32)
        mainloop.consumer_wait(read)
        offset = read.index * const_expr(self.a_tiler[0] * LINE)
        chunks = const_expr(self.config.k_blocks * 16 // CHUNK_K)
        words = [load_shared_v4(codes + offset + c * CHUNK_BYTES) for c in range(chunks)]
        pairs = [load_shared_v4(scales + offset + c * CHUNK_BYTES) for c in range(chunks)]
        for kb in cutlass.range_constexpr(self.config.k_blocks):  # under the previous MMAs
            r = self.a_registers(words[kb // 4][kb % 4], pairs[kb // 4][kb % 4])
            for i in cutlass.range_constexpr(4):
                decoded[4 * kb + i] = r[i]
        cute.nvgpu.warpgroup.wait_group(0)
        if release_previous:
            mainloop.consumer_release(previous)
        for i in cutlass.range_constexpr(cute.size(regs)):  # moved only after the wait
            regs[i] = _after_wait(decoded[i])
        self.issue_mmas(tiled_mma, acc, frag, tCrB, read.index)

    @cute.jit
    def issue_mmas(self, tiled_mma, acc, frag, tCrB, stage):
        """The k-tile's register-sourced wgmmas into ``acc``, committed as one group."""
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(self.config.k_blocks):
            cute.gemm(tiled_mma, acc, frag[(None, None, kb)], tCrB[(None, None, kb, stage)], acc)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def a_registers(self, word: Int32, scales: Int32):
        """The four A registers of one k-block: its word of codes decoded, times the scales of
        rows g and g + 8 (the low and high bf16 of ``scales``, each made a pair)."""
        return decode_rows(word, _pair(scales, False), _pair(scales, True))

    @cute.jit
    def epilogue(self, acc, tRS_acc, tRS_coords, tRS_rD, tRS_rOut, tRS_sD, sD, gD, mD, tma_d,
                 tiled_store, store_pipe, mC, mBias, vectors, alpha: Float32,
                 beta: Float32, m, n, l, per_subtile, tiles_done, warp, store_warp, epi_barrier,
                 buffer_base, row_block, next_k_tile=None):
        """The GEMM's epilogue; with ``split_k`` warpgroup 0's alone (it holds the tile's sum)."""
        if row_block == 0 or const_expr(not self.split_k):
            GemmSm90.epilogue(self, acc, tRS_acc, tRS_coords, tRS_rD, tRS_rOut, tRS_sD, sD, gD, mD,
                              tma_d, tiled_store, store_pipe, mC, mBias, vectors, alpha, beta, m,
                              n, l, per_subtile, tiles_done, warp, store_warp, epi_barrier,
                              buffer_base, row_block)

    def _apply_operands(self, frag, coords, offset, row_scales, mC, mBias, mScaleA, mScaleB,
                        alpha: Float32, beta: Float32, row0, col0, rows, cols, l):
        """frag[v] <- alpha * frag[v] + bias[row] (the bias is per weight row: a row of D)."""
        base_r, _ = coords.iterator
        for v in range(cute.size(frag)):
            r, _ = coords.layout(offset + v)
            if r not in row_scales:  # the thread's bias values of the tile, read once
                row = row0 + base_r + r
                row_scales[r] = _load_or(mBias, (row,), row < rows, 0.0)
            frag[v] = frag[v] * alpha + row_scales[r]


def kernel_specs(config: GemmConfig, bias: bool) -> tuple:
    """The kernel's argument specs (``GemmSm90``'s order): prepared weight, x, out, bias
    (fp32, per weight row) where ``bias``, the global scale, the stream-K workspace and flags
    where ``config.stream_k``."""
    from ..runtime import ScalarSpec, StreamSpec, Sym, TensorSpec

    free = lambda dtype, width: TensorSpec(dtype, (Sym(),), (Sym(),), width)  # noqa: E731
    return (TensorSpec.rowmajor("uint8", (Sym(), Sym()), 16),
            TensorSpec.rowmajor("bfloat16", (Sym(), Sym()), 8),
            TensorSpec.rowmajor("bfloat16", (Sym(), Sym()), 8),
            None, free("float32", 4) if bias else None, free("float32", 4), None, None, None,
            TensorSpec("float32", (Sym(),), (1,), 16) if config.stream_k else None,
            TensorSpec("int64", (Sym(),), (1,), 8) if config.stream_k else None,
            None, None, ScalarSpec("float32"), ScalarSpec("float32"), ScalarSpec("int64"),
            StreamSpec())
