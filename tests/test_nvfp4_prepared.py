"""The prepared NVFP4 weight layout of the W4A16 wgmma kernel (CPU): round trips, and the
kernel's register decode emulated bit for bit against the reference dequantization."""

import numpy as np
import pytest
import torch

from cute_kernels.quant.formats import nvfp4_dequantize_ref, nvfp4_quantize_ref
from cute_kernels.quant.nvfp4_w4a16_sm90 import (
    CHUNK_LINES,
    CODE_BYTES,
    DECODE_MASK,
    K_ALIGN,
    LINE,
    WORD_BITS,
    prepare_weight,
    unprepare_weight,
)


def _random_nvfp4(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 256, (n, k // 16), dtype=torch.uint8, generator=g)
    scales[scales & 0x7F == 0x7F] = 0x38  # no NaN scales here (they come back as 0x7F)
    return codes, scales


@pytest.mark.parametrize("n,k", [(64, 128), (1, 16), (100, 272), (130, 4096), (64, 144)])
def test_prepare_round_trip_and_padding(n, k):
    codes, scales = _random_nvfp4(n, k, n + k)
    data = prepare_weight(codes, scales)
    slabs, tiles = -(-n // 64), -(-k // K_ALIGN)
    assert data.shape == (slabs * 2 * CHUNK_LINES, tiles * LINE) and data.dtype == torch.uint8
    back_codes, back_scales = unprepare_weight(data, n, k)
    assert torch.equal(back_codes, codes) and torch.equal(back_scales, scales)
    # the padding is zeros: the same as preparing the weight padded with zero codes and scales
    padded_codes = torch.zeros(slabs * 64, tiles * 64, dtype=torch.uint8)
    padded_codes[:n, :k // 2] = codes
    padded_scales = torch.zeros(slabs * 64, tiles * 8, dtype=torch.uint8)
    padded_scales[:n, :k // 16] = scales
    assert torch.equal(prepare_weight(padded_codes, padded_scales), data)


def _bf16(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _rotr(word, bits):
    return (word >> np.uint32(bits)) | (word << np.uint32(32 - bits)) if bits else word


def _decode_word(word, s_top, s_bottom):
    """The kernel's decode (``_DECODE_ROWS``) in numpy: four registers of two bf16."""
    mask = np.uint32(DECODE_MASK)
    raw = [_rotr(word, 0) & mask, _rotr(word, 3) & mask, _rotr(word, 6) & mask,
           np.uint32((int(word & np.uint32(0x001B001B)) * 0x1084) & 0xFFFFFFFF) & mask]
    out = []
    for i, p in enumerate(raw):
        scale = s_top if i % 2 == 0 else s_bottom
        lo, hi = _bf16(p & np.uint32(0xFFFF)), _bf16(p >> np.uint32(16))
        out.append((lo * scale, hi * scale))  # exact products (bf16 mul.rn of exact values)
    return out


def test_word_bits_partition_the_word_and_decode_every_code():
    """Every bit of a word belongs to one code bit, and each register's decode (emulated)
    gives back its two codes' sign and magnitude bits in bf16 places for all 256 pairs."""
    places = [p for halves in WORD_BITS for bits in halves for p in bits]
    assert sorted(places) == list(range(32))
    for i, halves in enumerate(WORD_BITS):
        for lo in range(16):
            for hi in range(16):
                word = 0
                for code, bits in zip((lo, hi), halves):
                    for bit, place in enumerate(bits):
                        word |= ((code >> bit) & 1) << place
                regs = _decode_word(np.uint32(word), np.float32(1), np.float32(1))
                expect = [((c & 8) << 12) | ((c & 7) << 6) for c in (lo, hi)]
                want = [_bf16(np.uint32(e)) for e in expect]
                assert regs[i] == (want[0], want[1]), (i, lo, hi)


def test_kernel_fragments_decode_to_the_reference():
    """Thread t of the MMA warpgroup, k-block kb: its word and scales as the kernel reads them
    (16 bytes at 16 t of the k-block's 64-value chunk, two bf16 scales per k-block at
    2048 + 16 (t / 4)), decoded as the kernel does, land at the wgmma A fragment's (row,
    column) positions; the matrix they form is the reference dequantization (times 2^-8)."""
    n, k = 64, 256
    x = torch.randn(n, k) * 3
    codes, scales, _ = nvfp4_quantize_ref(x, torch.tensor(1.0))
    ref = nvfp4_dequantize_ref(codes, scales, torch.tensor(1.0)).double().numpy()
    data = prepare_weight(codes, scales.view(torch.uint8)).numpy()
    # a k-tile's 20 lines of 256 bytes: its first 64 values' chunk (10 lines), then the next one's
    chunks = data.reshape(1, 2 * CHUNK_LINES, -1, LINE).transpose(0, 2, 1, 3)
    chunks = chunks.reshape(1, -1, CHUNK_LINES * LINE)
    got = np.full((n, k), np.nan)
    for index in range(chunks.shape[1]):
        chunk = chunks[0, index]
        for t in range(128):
            w, lane = t // 32, t % 32
            g, c = lane // 4, lane % 4
            for kb in range(4):
                word = chunk[16 * t + 4 * kb:16 * t + 4 * kb + 4].view(np.uint32)[0]
                at = CODE_BYTES + 16 * (t // 4) + 4 * kb  # the k-block's two bf16 scales
                top, bottom = _bf16(chunk[at:at + 4].view(np.uint16).astype(np.uint32))
                regs = _decode_word(np.uint32(word), top, bottom)
                for i, (lo, hi) in enumerate(regs):
                    h, q = i % 2, i // 2
                    row, col = 16 * w + 8 * h + g, 64 * index + 16 * kb + 8 * q + 2 * c
                    got[row, col], got[row, col + 1] = lo * 2.0 ** 8, hi * 2.0 ** 8
    np.testing.assert_array_equal(got, ref)


def test_prepare_weight_checks_arguments_before_any_kernel():
    import cute_kernels as ck

    packed = torch.zeros(64, 64, dtype=torch.uint8)
    scales = torch.zeros(64, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(ck.DeviceError, match="w_fp4"):
        ck.nvfp4_prepare_weight(packed, scales)
    with pytest.raises(ck.UnsupportedError, match="scale_layout"):
        ck.nvfp4_prepare_weight(packed, scales, scale_layout="swizzled")


@pytest.mark.parametrize("m,n,expected", [
    (1, 8192, (64, 16, 1, 3)),     # 128 tiles: three warpgroups split each tile's K
    (32, 4096, (64, 32, 1, 3)),
    (64, 8192, (64, 64, 1, 2)),    # wider token tiles: two
    (16, 28672, (64, 16, 2, 0)),   # more tiles than SMs: two CTAs per SM instead
    (128, 8192, (64, 128, 1, 0)),
    (4096, 8192, (128, 256, 1, 0)),
    (256, 8192, (128, 128, 1, 0)),  # 128 tiles of 128 tokens fill the SMs, 64 of 256 do not
    (384, 8192, (128, 192, 1, 0)),
    (1024, 4096, (128, 256, 1, 0)),
    (256, 28672, (128, 256, 1, 0)),  # two waves of 256 tokens beat four of 128
])
def test_w4a16_configuration_rule(m, n, expected):
    from cute_kernels.quant.nvfp4_gemm import w4a16_config
    from cute_kernels.quant.nvfp4_w4a16_sm90 import W4A16GemmSm90

    cfg = w4a16_config(m, n, 132, False)
    assert (cfg.tile_m, cfg.tile_n, cfg.ctas_per_sm, cfg.warpgroups) == expected
    kernel = W4A16GemmSm90(cfg)
    assert kernel.threads == 128 * (1 + max(cfg.warpgroups, cfg.tile_m // 64))
    # setmaxnreg never asks for more registers than the launch gives the CTA
    launch = min(65536 // (kernel.threads * cfg.ctas_per_sm) // 8 * 8, 255 // 8 * 8)
    assert 128 * kernel.producer_registers + (kernel.threads - 128) * kernel.mma_registers <= kernel.threads * launch


@pytest.mark.parametrize("m,n,k,stream_k", [
    (32, 4096, 14336, True),    # 64 split tiles over a long K: stream-K over all SMs
    (64, 4096, 14336, True),
    (16, 4096, 14336, False),   # 16 tokens: the split alone
    (32, 4096, 4096, False),    # short K
    (48, 4096, 8192, False),
    (32, 8192, 14336, False),   # tiles fill the SMs
    (4096, 4096, 14336, False),
])
def test_w4a16_stream_k_rule(m, n, k, stream_k):
    from cute_kernels.quant.nvfp4_gemm import _w4a16_workspace, w4a16_config
    from cute_kernels.quant.nvfp4_w4a16_sm90 import W4A16GemmSm90

    cfg = w4a16_config(m, n, 132, False, k)
    assert cfg.stream_k == stream_k
    if stream_k:
        assert cfg.warpgroups in (2, 3) and cfg.max_clusters == 132
        W4A16GemmSm90(cfg)  # a valid configuration
        work, flags = _w4a16_workspace(cfg, "cpu")
        # one slot per CTA: every MMA thread's accumulator (tile N / 2 values)
        assert work.numel() == 132 * 128 * cfg.warpgroups * cfg.tile_n // 2
        assert flags.shape == (132,) and not flags.any()


def test_w4a16_split_beyond_three_warpgroups_is_rejected():
    import dataclasses

    from cute_kernels.quant.nvfp4_gemm import w4a16_config
    from cute_kernels.quant.nvfp4_w4a16_sm90 import W4A16GemmSm90

    cfg = dataclasses.replace(w4a16_config(1, 8192, 132, False), warpgroups=4)
    with pytest.raises(ValueError, match="2 or 3 warpgroups"):
        W4A16GemmSm90(cfg)
