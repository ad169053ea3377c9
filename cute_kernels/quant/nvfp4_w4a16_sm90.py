"""NVFP4 weights times bf16 activations on the GEMM's own pipeline (TMA + wgmma), for Hopper.

``out = alpha * x @ dequantize(w)^T (+ bias)`` with w prepared once by ``nvfp4_prepare_weight``
(``prepare_weight`` below: the same codes, regrouped, and the e4m3 scales as bf16). The kernel is
``GemmSm90`` computing the transposed product, ``out^T = W x^T``: the weight's rows fill the
MMA's M (64 per MMA warpgroup), the tokens its N (16 .. 256), so a decode step of a few tokens
and a prefill of thousands run the same kernel with different tiles.

Design:
  - Prepared weight: per 64-row slab and 128 values of K, one 5120-byte chunk -- 4096 bytes of
    codes in the order the MMA warpgroup's threads read them (thread t's 16 bytes at 16 t, one
    32-bit word per k-block of 16, two halves of 4 k-blocks each) and 1024 bytes of the slab's
    block scales as bf16 times 2^118 (exact for every e4m3 value, NaN included; two halves of
    16 bytes per 4-thread row group: the scales of its rows g and g + 8 for 4 k-blocks each).
    The scales take twice their e4m3 bytes (11% more bytes in all) so that a k-block's two
    scale registers are two byte permutes instead of ~10 conversions: the kernel is bound by
    its instruction stream, not by memory. The chunk is one 20 x 256-byte TMA box of a 2-D
    uint8 tensor (slab lines x K), so the producer warp's A loads are the GEMM's, with its box.
  - A word of a k-block holds the 8 codes of one thread's wgmma A fragment (rows g and g + 8,
    columns 2c, 2c + 1 and 2c + 8, 2c + 9 of the k-block: lane = 4g + c), nibble i the even
    column and nibble i + 4 the odd one of fragment register i. Decoding it is the skinny
    kernel's (``nvfp4_skinny_sm90``): each register masked out of the word, one integer multiply
    placing sign, exponent and mantissa (the bf16 value is the code times 2^-126), one mask,
    then one ``mul.bf16x2`` by its row's block scale times 2^118 (its bf16 pair, twice, by one
    byte permute): code * scale * 2^-8, exact.
    The epilogue multiplies by 2^8 and the global scale (``alpha``).
  - The MMA warpgroups read a stage's codes and scales with four 16-byte shared loads per
    thread and decode its 8 k-blocks into registers of their own while the previous k-tile's
    wgmmas run; then they wait for those (they read the A fragment), release their stage, move
    the decoded values into the A fragment (after the wait: a fragment register rewritten while
    a wgmma reads it would be corrupted) and issue 8 register-sourced wgmmas against x's
    swizzled stage (B from shared memory, as the GEMM's).
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
  - tile M 64 or 128 (one or two MMA warpgroups of 64 rows), tile N 16 .. 256, 8 k-blocks per
    stage (one chunk), clusters of 1, 2 or 4 along M, no ping-pong, no fp8 options
  - ``split_k`` (``warpgroups`` 2 or 3 on a 64-row tile): tile N <= 64, one CTA per SM, no
    stream-K
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
from .nvfp4_skinny_sm90 import decode_ptx

CHUNK_ROWS = 64  # weight rows per chunk: one MMA warpgroup's M
CHUNK_K = 128  # values of K per chunk: 8 k-blocks of 16
CODE_BYTES = CHUNK_ROWS * CHUNK_K // 2  # 4096
SCALE_BYTES = CHUNK_ROWS * CHUNK_K // 16 * 2  # 1024: bf16 scales
LINE = 256  # bytes per line of the TMA box
CHUNK_LINES = (CODE_BYTES + SCALE_BYTES) // LINE  # 20
SCALE_FACTOR = 2.0 ** 118  # the prepared scales' factor (the decoded codes carry 2^-126)
DECODE_EXPONENT = 8  # the decoded values are code * scale * 2^-8
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
    slabs, tiles = -(-n // CHUNK_ROWS), -(-k // CHUNK_K)
    c = torch.zeros(slabs * CHUNK_ROWS, tiles * CHUNK_K // 2, dtype=torch.uint8, device=codes.device)
    c[:n, :half_k] = codes
    s = torch.zeros(slabs * CHUNK_ROWS, tiles * CHUNK_K // 16, dtype=torch.uint8, device=codes.device)
    s[:n, :k // 16] = scales
    # Rows 16 w + 8 h + g of a slab, bytes 8 kb + 4 q + c of a chunk's 64 per row.
    v = c.view(slabs, 4, 2, 8, tiles, 8, 2, 4).permute(0, 4, 5, 1, 3, 7, 6, 2)
    v = v.reshape(slabs, tiles, 8, 4, 8, 4, 4).to(torch.int32)  # ..., kb, w, g, c, i = h + 2 q
    shifts = torch.arange(4, device=codes.device, dtype=torch.int32) * 4
    words = (((v & 15) << shifts) | ((v >> 4) << (shifts + 16))).sum(-1, dtype=torch.int32)
    # (slab, tile, half, w, g, c, kb % 4): thread 32 w + 4 g + c's 16 bytes per half.
    words = words.view(slabs, tiles, 2, 4, 4, 8, 4).permute(0, 1, 2, 4, 5, 6, 3).contiguous()
    code_bytes = words.view(torch.uint8).reshape(slabs, tiles, CODE_BYTES)
    wide = (s.view(torch.float8_e4m3fn).float() * SCALE_FACTOR).to(torch.bfloat16).view(torch.uint16)
    # (slab, tile, half, w, g, kb % 4, h): a row group's 4 k-blocks of a half in 16 bytes
    sv = wide.view(slabs, 4, 2, 8, tiles, 2, 4).permute(0, 4, 5, 1, 3, 6, 2)
    scale_bytes = sv.contiguous().view(torch.uint8).reshape(slabs, tiles, SCALE_BYTES)
    chunks = torch.cat((code_bytes, scale_bytes), dim=2).view(slabs, tiles, CHUNK_LINES, LINE)
    return chunks.permute(0, 2, 1, 3).reshape(slabs * CHUNK_LINES, tiles * LINE).contiguous()


def unprepare_weight(data: torch.Tensor, n: int, k: int) -> tuple:
    """The inverse of ``prepare_weight``: (codes (N, K / 2), scales (N, K / 16)), uint8 (a NaN
    scale comes back as 0x7F)."""
    slabs, tiles = data.shape[0] // CHUNK_LINES, data.shape[1] // LINE
    chunks = data.view(slabs, CHUNK_LINES, tiles, LINE).permute(0, 2, 1, 3).reshape(slabs, tiles, -1)
    words = chunks[..., :CODE_BYTES].contiguous().view(torch.int32).view(slabs, tiles, 2, 4, 8, 4, 4)
    words = words.permute(0, 1, 2, 6, 3, 4, 5).reshape(slabs, tiles, 8, 4, 8, 4)  # kb, w, g, c
    shifts = torch.arange(4, device=data.device, dtype=torch.int32) * 4
    lo = (words.unsqueeze(-1) >> shifts) & 15
    hi = (words.unsqueeze(-1) >> (shifts + 16)) & 15
    v = (lo | (hi << 4)).to(torch.uint8)  # slab, tile, kb, w, g, c, i = h + 2 q
    v = v.view(slabs, tiles, 8, 4, 8, 4, 2, 2).permute(0, 3, 7, 4, 1, 2, 6, 5)
    codes = v.reshape(slabs * CHUNK_ROWS, tiles * CHUNK_K // 2)
    wide = chunks[..., CODE_BYTES:].contiguous().view(torch.bfloat16).view(slabs, tiles, 2, 4, 8, 4, 2)
    sv = wide.permute(0, 3, 6, 4, 1, 2, 5).reshape(slabs * CHUNK_ROWS, tiles * CHUNK_K // 16)
    scales = (sv.float() / SCALE_FACTOR).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes[:n, :k // 2].contiguous(), scales[:n, :k // 16].contiguous()


# ----------------------------------------------------------------------------- device side


_DECODE_ROWS = decode_ptx(False, row_scales=True)


@cute.jit
def decode_rows(word: Int32, top: Int32, bottom: Int32):
    """The four scaled A registers of one k-block from its word and the scale pairs of rows
    g and g + 8 (bf16 times 2^118; module docstring)."""
    return cute.arch.inline_ptx(_DECODE_ROWS, write_only_types=[Int32] * 4,
                                read_only_args=[word, top, bottom])


@cute.jit
def _pair(word: Int32, upper: cutlass.Constexpr) -> Int32:
    """(word's low bf16, twice), or its high one."""
    selector = 0x3232 if const_expr(upper) else 0x1010
    return cute.arch.inline_ptx(f"prmt.b32 {{$w0}}, {{$r0}}, {{$r0}}, {selector};",
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
        if (config.tile_m not in (64, 128) or config.k_blocks != CHUNK_K // 16 or config.pingpong
                or config.swap_ab or config.pad_k or config.cluster_n != 1
                or config.cluster_m not in (1, 2, 4)
                or config.fp8_promote_every or config.epilogue_mma
                or not config.epilogue.scalar_scale_a or config.epilogue.row_scale
                or config.epilogue.col_scale or config.epilogue.residual
                or config.warpgroups not in (0, *SPLIT_REGISTERS) or config.warpgroups and (
                    config.tile_m != 64 or config.tile_n > 64 or config.stream_k
                    or config.ctas_per_sm != 1)):
            raise ValueError(f"unsupported W4A16 configuration {config}: tile M 64 / 128, "
                             f"{CHUNK_K // 16} k-blocks, clusters of 1, 2 or 4 along M, no "
                             f"ping-pong, swap, pad_k or fp8 options; a scalar scale for A, at "
                             f"most a bias; 2 or 3 warpgroups only on 64 x <= 64 tiles (split K)")
        # split_k (module docstring): the GEMM is built for one warpgroup per 64-row tile, then
        # given the others.
        self.split_k = config.warpgroups
        super().__init__(dataclasses.replace(config, warpgroups=0) if self.split_k else config)
        if self.split_k:
            self.config, self.num_mma_wg, self.threads = config, self.split_k, config.threads
            self.producer_registers, self.mma_registers = SPLIT_REGISTERS[self.split_k]

    @cute.jit
    def __call__(self, mA, mX, mOut, mC, mBias, mScaleA, mScaleB, mZeroA, mSumB, mWork, mFlags,
                 mSrcA, mSrcB, alpha: Float32, beta: Float32, token: cutlass.Int64, stream):
        """``GemmSm90``'s launch with x (M, K) and out (M, N) in their own order: their
        transposes, the GEMM's B and D, are made here (no views to make per call)."""
        GemmSm90.__call__(self, mA, _transposed(mX), _transposed(mOut), mC, mBias, mScaleA,
                          mScaleB, mZeroA, mSumB, mWork, mFlags, mSrcA, mSrcB, alpha, beta, token,
                          stream)

    def mma_a_dtype(self, a, b):
        return b.element_type  # the decoded weight: x's dtype

    def a_stage_tiler(self):
        return (CHUNK_LINES * (self.config.tile_m // CHUNK_ROWS), LINE)

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
        chunk = Int32((sA.iterator + cute.crd2idx((block * CHUNK_LINES, 0, 0), sA.layout)).toint())
        partial = None
        if const_expr(self.split_k):
            wg1_buffers = self.config.epi_stages * self.epi_tile[0] * self.epi_tile[1]  # elements
            if const_expr(wg1_buffers * self.d_dtype.width // 8 < 64 * self.config.tile_n * 4):
                raise ValueError(f"split K: warpgroup 1's epilogue buffers cannot hold its "
                                 f"partial sum: {self.config}")
            partial = Int32(sD.iterator.toint()) + wg1_buffers * (self.d_dtype.width // 8) + tidx * 4
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
        low = load_shared_v4(codes + offset)
        high = load_shared_v4(codes + offset + CODE_BYTES // 2)
        pairs_low = load_shared_v4(scales + offset)
        pairs_high = load_shared_v4(scales + offset + SCALE_BYTES // 2)
        for kb in cutlass.range_constexpr(8):  # under the previous k-tile's MMAs
            word = low[kb] if const_expr(kb < 4) else high[kb - 4]
            r = self.a_registers(word, pairs_low[kb] if const_expr(kb < 4) else pairs_high[kb - 4])
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
        """The k-tile's 8 register-sourced wgmmas into ``acc``, committed as one group."""
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(8):
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
