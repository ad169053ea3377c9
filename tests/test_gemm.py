"""GEMM against float64 references.

Tolerance rule: our max error against the float64 product is at most twice the error of
torch's matmul on the same bf16/fp16 inputs (cuBLAS, fp32 accumulation) plus a floor.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import cute_kernels as ck
from cute_kernels.reference import gemm_ref as ref_mm
from cute_kernels.gemm.config import Epilogue, choose_config

gpu = pytest.mark.gpu


def check(ours, a, b, out_dtype=None, extra=None):
    ref = ref_mm(a, b) if extra is None else extra
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    theirs = (a @ b).to(out_dtype or a.dtype) if extra is None else None
    err = (ours.double() - ref).abs().max().item() if ref.numel() else 0.0
    scale = ref.abs().max().item() if ref.numel() else 1.0
    if theirs is not None and ref.numel():
        bound = 2 * (theirs.double() - ref).abs().max().item() + 1e-3 * scale + 1e-6
    else:
        bound = 1e-2 * scale + 1e-3
    assert err <= bound, (err, bound)


# ---------------------------------------------------------------- no GPU needed


def test_skinny_products_take_transposed_configurations():
    # M <= 16 against >= 2048 weight rows, or M <= 64 where 128-column tiles would leave most
    # SMs idle: D^T = B^T A^T, 64-row tiles as wide as M (rounded to 16), data-parallel.
    from cute_kernels.gemm.op import heuristic_config

    def config(m, n, k, dtype=torch.bfloat16, **extras):
        a, w = torch.empty(m, k, dtype=dtype), torch.empty(n, k, dtype=dtype)
        return heuristic_config(a, w.t(), extras.get("c"), extras.get("bias"), None, None, Epilogue(), False, 132)

    # Stage lengths (k-blocks): 16 for 16-column tiles on at most half the SMs at long K, 8 for
    # up to 48 columns, else 4 (``narrow_tile_k_blocks``).
    for m, n, k, tile_n, k_blocks in ((1, 4096, 4096, 16, 16), (16, 14336, 4096, 16, 8),
                                      (16, 6144, 14336, 16, 8), (16, 4096, 2048, 16, 8),
                                      (16, 4096, 512, 16, 4), (17, 4096, 14336, 32, 8),
                                      (40, 2500, 4096, 48, 8), (64, 4096, 14336, 64, 4)):
        cfg = config(m, n, k)
        assert cfg.swap_ab and (cfg.tile_m, cfg.tile_n, cfg.stream_k, cfg.k_blocks) == (
            64, tile_n, False, k_blocks), (m, n, k, cfg)
    for m, n, k in ((16, 1000, 4096), (64, 8192, 4096), (65, 4096, 14336), (128, 4096, 4096)):
        assert not config(m, n, k).swap_ab, (m, n, k)
    assert not config(16, 4096, 4096, bias=torch.empty(4096)).swap_ab  # a bias runs along N
    assert not config(16, 4096, 4096, dtype=torch.float8_e4m3fn).swap_ab


def test_narrow_tile_choices_are_compiled():
    # Every 64 x 16..64 configuration the heuristic returns (transposed skinny products and a
    # few output columns) is among those the compile tests build and precompile ships.
    from cute_kernels.gemm.op import compile_configurations, heuristic_config

    def key(c):
        return c.tile_m, c.tile_n, c.k_blocks, c.swap_ab, c.stream_k, c.cluster_m

    built = {key(c) for _, c, _ in compile_configurations() if c is not None}
    for m in (1, 5, 16, 17, 40, 64):
        for n in (2048, 4096, 8192, 14336, 128256):
            for k in (64, 512, 1024, 4096, 14336):
                a, w = torch.empty(m, k, dtype=torch.bfloat16), torch.empty(n, k, dtype=torch.bfloat16)
                for b in (w.t(), torch.empty(k, n, dtype=torch.bfloat16)):  # (K, N) both majors
                    cfg = heuristic_config(a, b, None, None, None, None, Epilogue(), False, 132)
                    if cfg.tile_n <= 64:
                        assert key(cfg) in built, (m, n, k, cfg)
                    cfg = choose_config(n, m, k, 1, 2, 132)  # untransposed: N = m output columns
                    assert key(cfg) in built, (n, m, k, cfg)


def test_unaligned_k_choices_are_compiled():
    # The plans of unaligned-K products launch pad_k configurations (the GEMM pads its own
    # operands): every one the heuristic gives them is among those compiled and precompiled.
    from cute_kernels.gemm.op import PAD_FUSE_MAX_BYTES, compile_configurations, heuristic_config, pad_k_config

    built = [c for _, c, _ in compile_configurations() if c is not None and c.pad_k]
    for m in (3, 9, 31, 48, 65, 127, 129, 160, 256, 257, 500, 1500, 2048, 5000, 12000):
        for n in (3, 17, 33, 129, 700, 2047, 3000, 6000, 10240, 14336, 28672):
            for k in (9, 100, 1001, 3001, 6999):
                kp = -(-k // 8) * 8
                if (m + n) * kp * 2 > PAD_FUSE_MAX_BYTES:
                    continue
                a = torch.empty(m, kp, dtype=torch.bfloat16)
                w = torch.empty(n, kp, dtype=torch.bfloat16)
                cfg = heuristic_config(a, w.t(), None, None, None, None, Epilogue(), False, 132)
                assert pad_k_config(cfg) in built, (m, n, k, cfg)


def test_heuristic_covers_shapes():
    assert choose_config(4096, 4096, 4096, 1, 2, 132).tile_n == 256
    small = choose_config(128, 8192, 8192, 1, 2, 132)
    assert small.tile_m * small.tile_n <= 128 * 128
    assert choose_config(64, 64, 64, 1, 2, 132).tile_m == 64


def test_heuristic_fills_the_machine():
    # Skinny problems take the smaller tile so that more SMs get work; the grid is persistent.
    skinny = choose_config(128, 8192, 8192, 1, 2, 132)
    assert (skinny.tile_m, skinny.tile_n, skinny.cluster_m) == (64, 128, 2)  # 128 CTAs in pairs
    assert choose_config(100, 8192, 8192, 1, 2, 132).cluster_m == 2
    assert choose_config(64, 8192, 8192, 1, 2, 132).cluster_m == 1  # one row of tiles
    big = choose_config(8192, 8192, 8192, 1, 2, 132)
    assert big.max_clusters * big.cluster_m <= 132
    fp8 = choose_config(4096, 4096, 4096, 1, 1, 132)
    assert (fp8.tile_n, fp8.fp8_split_n, fp8.fp8_promote_every) == (256, True, 1)  # per column half
    small = choose_config(512, 512, 4096, 1, 1, 132)
    assert (small.tile_n, small.fp8_split_n, small.fp8_promote_every) == (128, False, 1)
    big_fp8 = choose_config(8192, 8192, 8192, 1, 1, 132)  # 20.8 waves of 128 x 192 vs 15.5 of 128 x 256
    assert (big_fp8.tile_n, big_fp8.fp8_split_n, big_fp8.fp8_promote_every, big_fp8.cluster_m) == (192, False, 1, 2)
    fast = choose_config(4096, 4096, 4096, 1, 1, 132, fast_accum=True)
    assert (fast.tile_n, fast.fp8_split_n, fast.fp8_promote_every, fast.cluster_m) == (256, False, 0, 1)
    assert choose_config(4096, 4096, 4096, 1, 2, 132, fast_accum=True) == choose_config(4096, 4096, 4096, 1, 2, 132)
    assert choose_config(8192, 8192, 1024, 1, 2, 132).pingpong  # short K: epilogue hidden
    assert choose_config(8192, 8192, 1024, 1, 2, 132).epi_stages == 3  # a fifth pipeline stage
    assert choose_config(6144, 6144, 1024, 1, 2, 132).pingpong  # 12 waves of 128 x 192 vs 9
    # ... unless its waves round worse than the cooperative 128 x 256's (6 vs 4).
    assert not choose_config(4096, 4096, 1024, 1, 2, 132).pingpong
    assert not choose_config(2048, 8192, 1024, 1, 2, 132).pingpong
    assert not choose_config(4096, 4096, 4096, 1, 2, 132).pingpong
    # Mid-length K: ping-pong where it beats the cooperative tile's waves (its stream-K tail
    # counted) by 5% with the exposed epilogue charged; never beyond PINGPONG_MAX_K.
    assert choose_config(8192, 8192, 2048, 1, 2, 132).pingpong  # 21 waves vs 15.5 + tail
    assert choose_config(8192, 8192, 3072, 1, 2, 132).pingpong
    assert not choose_config(4096, 8192, 2048, 1, 2, 132).pingpong  # 11 vs 8: under the margin
    assert not choose_config(8192, 8192, 4096, 1, 2, 132).pingpong
    assert not choose_config(8192, 8192, 5120, 1, 2, 132).pingpong
    # ... and at K = 4096 where the cooperative tile's stream-K tail cuts tiles into many pieces.
    assert choose_config(4096, 4352, 4096, 1, 2, 132).pingpong  # 8 of 66 in the last wave
    assert choose_config(2048, 4352, 4096, 1, 2, 132).pingpong  # 4 of 66
    assert not choose_config(4096, 4352, 8192, 1, 2, 132).pingpong  # beyond PINGPONG_MAX_K
    # From K = 2048 one wave of ping-pong tiles may do (1.5 vs 2 cooperative waves here).
    assert choose_config(1024, 6144, 4096, 1, 2, 132).pingpong
    assert choose_config(768, 6144, 2048, 1, 2, 132).pingpong
    assert not choose_config(1024, 5120, 1536, 1, 2, 132).pingpong
    # Stream-K tail: bf16 with a last wave at most 75% full, K >= 2048, and at most
    # STREAM_K_MAX_PIECES pieces per tile at K = 4096 (in proportion to K).
    assert choose_config(4096, 4352, 8192, 1, 2, 132).stream_k  # 272 cluster tiles: 8 in the last wave
    assert choose_config(8192, 8192, 8192, 1, 2, 132).stream_k  # 1024: 34 of 66
    assert choose_config(6144, 6144, 8192, 1, 2, 132).stream_k  # 576: 48 of 66
    assert not choose_config(16384, 8192, 8192, 1, 2, 132).stream_k  # 2048: 2 of 66, 33 pieces
    assert not choose_config(16384, 16384, 4096, 1, 2, 132).stream_k  # 4096: 4 of 66 at K = 4096
    assert not choose_config(1024, 4352, 4096, 1, 2, 132).stream_k  # 136 of 132 CTAs
    assert not choose_config(4096, 4096, 4096, 1, 2, 132).stream_k  # 256: 58 of 66
    assert not choose_config(4096, 4352, 1024, 1, 2, 132).stream_k  # short K
    assert not choose_config(4096, 4352, 4096, 1, 1, 132).stream_k  # fp8
    assert not choose_config(1024, 1024, 4096, 1, 2, 132).stream_k  # one partial wave
    # 256 x 160 tiles in pairs along M where their waves round best (config.WIDE_TILE; measured
    # 663 / 661 vs 556 / 605 TFLOP/s for ping-pong at the first two, 743 vs 704 for 128 x 256
    # with a stream-K tail at 5120^2 x 8192, 645 / 479 vs 594 / 429 for 128 x 256 at N = 5000).
    for shape in ((1024, 4352, 4096), (1024, 5120, 2048), (5120, 5120, 8192), (3000, 5000, 2000),
                  (2048, 5000, 1000)):
        cfg = choose_config(*shape, 1, 2, 132)
        assert (cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.epi_stages, cfg.stream_k, cfg.pingpong) == (
            256, 160, 2, 2, False, False), shape
    assert choose_config(3000, 5000, 1000, 1, 2, 132).tile_n == 256  # 3 vs 4 waves at short K: 492 vs 508
    assert choose_config(4096, 4096, 4096, 1, 2, 132).tile_n == 256  # 4 waves 79% vs 97% full
    assert choose_config(4800, 5000, 8192, 1, 2, 132).tile_m == 128  # 19 row tiles of 256: no pairs
    assert choose_config(3000, 5000, 2000, 1, 1, 132).tile_m == 128  # fp8 keeps its tiles
    # 128 < M <= 256: no tail after full waves (it would read a weight slab's two row tiles
    # apart); a single partial wave is still cut along K.
    wide = choose_config(256, 28672, 4096, 1, 2, 132)
    assert (wide.tile_m, wide.tile_n, wide.cluster_m, wide.stream_k) == (128, 160, 2, False)
    for m, n, k in ((256, 14336, 4096), (256, 6144, 4096), (192, 6144, 8192), (256, 10240, 8192)):
        cfg = choose_config(m, n, k, 1, 2, 132)
        clusters = 132 // cfg.cluster_m
        cluster_tiles = -(-m // (cfg.tile_m * cfg.cluster_m)) * -(-n // cfg.tile_n)
        assert not (cfg.stream_k and cluster_tiles > clusters), (m, n, k, cfg)
    assert choose_config(256, 6144, 14336, 1, 2, 132).stream_k  # 96 tiles on 132 SMs
    # fp8 exact runs the next tile's first k-tile under the epilogue where CTAs have two tiles.
    assert fp8.epilogue_mma and big_fp8.epilogue_mma
    assert not choose_config(1000, 2896, 1040, 1, 1, 132).epilogue_mma  # 128 tiles on 132 SMs
    assert not fast.epilogue_mma and not big.epilogue_mma  # no fold: nothing free to run


def test_heuristic_choices_are_valid_launches():
    # Every choice passes the kernel's own checks and launches at most one CTA per SM (catches a
    # field landing in the wrong place, e.g. an uncapped grid under a stream-K tail).
    from cute_kernels.gemm.kernel_sm90 import GemmSm90

    shapes = [(m, n, k) for m in (1, 100, 128, 1000, 4096, 8192) for n in (64, 4352, 8192)
              for k in (64, 1024, 4096, 8192)]
    for m, n, k in shapes:
        for itemsize, fast_accum in ((2, False), (1, False), (1, True)):
            cfg = choose_config(m, n, k, 1, itemsize, 132, fast_accum=fast_accum)
            GemmSm90(cfg)
            assert cfg.swizzle == 8 and cfg.cluster_n == 1, cfg
            assert cfg.max_clusters * cfg.cluster_m <= 132, cfg


def test_tuning_candidates():
    from cute_kernels.gemm.tuning import candidates

    base = choose_config(4096, 4096, 4096, 1, 2, 132)
    found = candidates(base, 4096, 132)
    assert found[0] == base and len(set(found)) == len(found) == 6
    assert any(c.pingpong for c in found)
    assert all(c.max_clusters * c.cluster_m <= 132 for c in found)
    fp8 = choose_config(4096, 4096, 4096, 1, 1, 132)
    fp8_found = candidates(fp8, 4096, 132)
    assert all(c.fp8_split_n == (c.tile_n == 256) and c.fp8_promote_every == 1 for c in fp8_found)
    assert {c.tile_n for c in fp8_found} == {256, 192, 128, 96}
    assert {c.tile_m for c in candidates(choose_config(128, 512, 512, 1, 2, 132), 128, 132)} == {64, 128}
    assert all(c.tile_m == 64 for c in candidates(choose_config(64, 512, 512, 1, 2, 132), 64, 132))
    fast = candidates(choose_config(4096, 4096, 4096, 1, 1, 132, fast_accum=True), 4096, 132, fp8=True)
    assert not any(c.pingpong or c.fp8_split_n or c.fp8_promote_every for c in fast)  # ping-pong spills
    # The stream-K choice belongs to the heuristic's tile and cluster (its tail); the other
    # shapes are timed data-parallel.
    tail = choose_config(4096, 4352, 8192, 1, 2, 132)
    assert [c.stream_k for c in candidates(tail, 4096, 132)] == [True] + [False] * 5


def test_kernel_refuses_a_scale_given_both_ways():
    from cute_kernels.gemm.config import Epilogue, GemmConfig
    from cute_kernels.gemm.kernel_sm90 import GemmSm90

    for epi in (Epilogue(row_scale=True, scalar_scale_a=True), Epilogue(col_scale=True, scalar_scale_b=True)):
        with pytest.raises(ValueError, match="per tensor or per row"):
            GemmSm90(GemmConfig(128, 256, epilogue=epi))
    GemmSm90(GemmConfig(128, 256, epilogue=Epilogue(row_scale=True, scalar_scale_b=True)))


def test_kernel_refuses_epilogue_mma_where_nothing_is_free():
    from cute_kernels.gemm.config import GemmConfig
    from cute_kernels.gemm.kernel_sm90 import GemmSm90

    for cfg in (GemmConfig(128, 256, epilogue_mma=True),  # no fold: one accumulator
                GemmConfig(128, 96, pingpong=True, fp8_promote_every=1, epilogue_mma=True),
                GemmConfig(128, 192, max_clusters=132, stream_k=True, fp8_promote_every=1, epilogue_mma=True)):
        with pytest.raises(ValueError, match="epilogue_mma needs"):
            GemmSm90(cfg)
    GemmSm90(GemmConfig(128, 192, fp8_promote_every=1, epilogue_mma=True))


def test_kernel_refuses_tiles_beyond_the_registers():
    from cute_kernels.gemm.config import GemmConfig
    from cute_kernels.gemm.kernel_sm90 import GemmSm90

    for cfg in (GemmConfig(256, 256), GemmConfig(256, 208), GemmConfig(128, 256, pingpong=True),
                GemmConfig(128, 128, fp8_promote_every=1, pingpong=True), GemmConfig(512, 128),
                GemmConfig(192, 128)):
        with pytest.raises(ValueError, match="tile_m|accumulator"):
            GemmSm90(cfg)
    for cfg in (GemmConfig(256, 192), GemmConfig(256, 192, 1, 2), GemmConfig(128, 192, pingpong=True),
                GemmConfig(128, 256, fp8_promote_every=1, fp8_split_n=True), GemmConfig(256, 96, fp8_promote_every=1)):
        GemmSm90(cfg)


@gpu
@pytest.mark.parametrize("tile", [(64, 256, 1), (128, 192, 2), (128, 128, 1)])
def test_pingpong_schedule(tile):
    # Both warpgroups' tiles, several per CTA, ragged edges, the full epilogue, a poisoned output.
    from cute_kernels.gemm.config import Epilogue, GemmConfig
    from cute_kernels.gemm.op import compiled_gemm, kernel_specs

    tm, tn, cm = tile
    m, n, k = 1000, 2904, 328
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    c = torch.randn(m, n, device="cuda", dtype=torch.float32)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    cfg = GemmConfig(tm, tn, cm, max_clusters=16, pingpong=True,
                     epilogue=Epilogue(bias=True, residual=True, activation="gelu_tanh", alpha=True))
    compiled_gemm(cfg, kernel_specs(a, b, d, c, bias, None, None, cfg))(a, b, d, c, bias, None, None, 0.5, 0.25)
    z = 0.5 * ref_mm(a, b) + 0.25 * c.double() + bias.double()
    check(d, a, b, extra=F.gelu(z, approximate="tanh"))


@gpu
@pytest.mark.parametrize("cluster", [(1, 1), (2, 1), (1, 2)])
@pytest.mark.parametrize("majors", [("row", "row"), ("col", "col")])
def test_256_row_tiles(cluster, majors):
    # 128 rows per MMA warpgroup (two m64 MMAs per k-block): ragged M, N and K, both operand
    # layouts, the full epilogue, several tiles per CTA, a poisoned output.
    from cute_kernels.gemm.config import Epilogue, GemmConfig
    from cute_kernels.gemm.op import compiled_gemm, kernel_specs

    m, n, k = 1000, 2904, 328
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    if majors[0] == "col":
        a = a.t().contiguous().t()
    if majors[1] == "col":
        b = b.t().contiguous().t()
    c = torch.randn(m, n, device="cuda", dtype=torch.float32)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    cfg = GemmConfig(256, 192, *cluster, max_clusters=5,
                     epilogue=Epilogue(bias=True, residual=True, activation="silu", alpha=True))
    compiled_gemm(cfg, kernel_specs(a, b, d, c, bias, None, None, cfg))(a, b, d, c, bias, None, None, 0.5, 0.25)
    check(d, a, b, extra=F.silu(0.5 * ref_mm(a, b) + 0.25 * c.double() + bias.double()))


@gpu
@pytest.mark.parametrize("kind", ["bf16", "bf16-cluster2", "bf16-one-warpgroup", "bf16-256x192-cluster2",
                                  "bf16-256x192-cluster1x2", "fp8-split", "fp8-128x192-cluster2"])
@pytest.mark.parametrize("clusters", [7, 13, 130])
def test_stream_k_tail(kind, clusters):
    # The last partial wave cut along K: 96 tiles of 128 x 256 (1000 x 2896, K = 1040: 17 k-tiles)
    # on 7 or 13 clusters leave a tail whose tiles are split across 2-4 clusters; on 130 clusters
    # (more than there are tiles: one partial wave) every tile is cut, 1-2 pieces each. Ragged M, N and
    # K, the full epilogue (bf16) or per-row / per-column scales (fp8), a poisoned output, two
    # launches (new tokens) and a CUDA graph replayed twice on new inputs (the same token: the
    # flags must have been cleared by the previous replay).
    from cute_kernels.gemm.config import Epilogue, GemmConfig
    from cute_kernels.gemm.op import compiled_gemm, kernel_specs

    m, n, k = 1000, 2896, 1040
    fp8 = kind.startswith("fp8")
    tile = {"bf16": (128, 256, 1), "bf16-cluster2": (128, 256, 2), "bf16-one-warpgroup": (64, 128, 2),
            "bf16-256x192-cluster2": (256, 192, 2), "bf16-256x192-cluster1x2": (256, 192, 1, 2),
            "fp8-split": (128, 256, 1), "fp8-128x192-cluster2": (128, 192, 2)}[kind]
    if fp8:
        epi = Epilogue(row_scale=True, col_scale=True)
        cfg = GemmConfig(*tile, max_clusters=clusters, epilogue=epi, fp8_promote_every=1,
                         fp8_split_n=tile[1] == 256, stream_k=True)
    else:
        epi = Epilogue(bias=True, residual=True, activation="gelu_tanh", alpha=True)
        cfg = GemmConfig(*tile, max_clusters=clusters, epilogue=epi, stream_k=True)

    def inputs():
        if fp8:
            a = (torch.randn(m, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
            b = (torch.randn(n, k, device="cuda") * 0.5).to(torch.float8_e4m3fn).t()
            return a, b, None, None, torch.rand(m, device="cuda") + 0.5, torch.rand(n, device="cuda") + 0.5
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()  # column-major B
        return (a, b, torch.randn(m, n, device="cuda"), torch.randn(n, device="cuda", dtype=torch.bfloat16),
                None, None)

    def expected(a, b, c, bias, sa, sb):
        if fp8:
            return (a.double() @ b.double()) * sa.double().reshape(-1, 1) * sb.double()
        return F.gelu(0.5 * ref_mm(a, b) + 0.25 * c.double() + bias.double(), approximate="tanh")

    def assert_close(d, ops):
        ref = expected(*ops)
        assert (d.double() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()

    ops = inputs()
    d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    launch = compiled_gemm(cfg, kernel_specs(ops[0], ops[1], d, *ops[2:], cfg))
    for _ in range(2):
        d.fill_(float("nan"))
        launch(ops[0], ops[1], d, *ops[2:], 0.5 if not fp8 else 1.0, 0.25)
        assert_close(d, ops)
    static = inputs()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(static[0], static[1], d, *static[2:], 0.5 if not fp8 else 1.0, 0.25)
    for _ in range(2):
        fresh = inputs()
        for dst, src in zip(static, fresh):
            if dst is not None:
                dst.copy_(src)
        d.fill_(float("nan"))
        graph.replay()
        assert_close(d, fresh)


@gpu
@pytest.mark.parametrize("shape", [(100, 200, 64), (16, 4096, 8192), (1, 1000, 3000)])
def test_stream_k_with_more_clusters_than_k_tiles_or_tiles(shape):
    # One partial wave over the whole grid: one tile of one k-tile on 13 clusters (12 empty runs),
    # and decode-sized products cut into many short runs.
    from cute_kernels.gemm.config import GemmConfig
    from cute_kernels.gemm.op import compiled_gemm, kernel_specs

    m, n, k = shape
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    for cfg in (GemmConfig(128, 256, 1, max_clusters=13, stream_k=True),
                GemmConfig(64, 128, 1, max_clusters=132, stream_k=True)):
        d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        launch = compiled_gemm(cfg, kernel_specs(a, b, d, None, None, None, None, cfg))
        for _ in range(2):
            launch(a, b, d, None, None, None, None, 1.0, 0.0)
            check(d, a, b)


@gpu
def test_stream_k_through_the_op():
    # The heuristic's stream-K choice (a last wave 24% full), through ck.gemm and autograd (dB
    # = A^T dC: the same shape, also a stream-K tail), twice (a new token per launch), against
    # float64.
    m, n, k = 8192, 4352, 8192
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert choose_config(m, n, k, 1, 2, sms).stream_k and choose_config(k, n, m, 1, 2, sms).stream_k
    for _ in range(2):
        out = ck.gemm(a, b)
        check(out, a.detach(), b.detach())
    grad = torch.randn_like(out)
    out.backward(grad)
    check(a.grad, grad, b.detach().t())
    check(b.grad, a.detach().t(), grad)


@gpu
@pytest.mark.parametrize("cluster_m", [1, 2])
def test_fp8_column_split_promotion(cluster_m):
    # 128 x 256 tiles folding per column half: ragged M, N and K, per-row / per-column scales, a
    # poisoned output, several tiles per CTA; checked like the kernels next to it (128 x 128
    # folding every 4 k-tiles, so the last window is partial; 128 x 192 folding every k-tile).
    from cute_kernels.gemm.config import Epilogue, GemmConfig
    from cute_kernels.gemm.op import compiled_gemm, kernel_specs

    m, n, k = 1000, 2896, 1040
    a = (torch.randn(m, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, device="cuda") * 0.5).to(torch.float8_e4m3fn).t()
    sa, sb = torch.rand(m, device="cuda") + 0.5, torch.rand(n, device="cuda") + 0.5
    epi = Epilogue(row_scale=True, col_scale=True)
    outs = []
    for cfg in (GemmConfig(128, 256, cluster_m, max_clusters=16, epilogue=epi, fp8_promote_every=1, fp8_split_n=True),
                GemmConfig(128, 128, 1, max_clusters=16, epilogue=epi, fp8_promote_every=4),
                GemmConfig(128, 192, 2, max_clusters=8, epilogue=epi, fp8_promote_every=1)):
        d = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        compiled_gemm(cfg, kernel_specs(a, b, d, None, None, sa, sb, cfg))(a, b, d, None, None, sa, sb, 1.0, 0.0)
        outs.append(d)
    ref = (a.double() @ b.double()) * sa.double().reshape(-1, 1) * sb.double()
    for d in outs:
        assert (d.double() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()


@gpu
@pytest.mark.parametrize("tile", [(128, 256, 1), (128, 256, 2), (128, 192, 2), (64, 128, 2)])
def test_fp8_next_k_tile_under_the_epilogue(tile):
    # epilogue_mma: each tile's epilogue runs the next tile's first k-tile. A small grid gives
    # every CTA many tiles (ragged M, N and K; K of one k-tile too), per-row / per-column scales
    # and a bias, bf16 and fp32 output, a poisoned output: bitwise the same as without it (the
    # same folds in the same order), and within the fp8 tolerance of float64.
    from cute_kernels.gemm.config import Epilogue, GemmConfig
    from cute_kernels.gemm.op import compiled_gemm, kernel_specs

    tm, tn, cm = tile
    epi = Epilogue(bias=True, row_scale=True, col_scale=True)
    for (m, n, k), out_dtype in (((1000, 2896, 1040), torch.bfloat16), ((777, 1000, 112), torch.float32)):
        a = (torch.randn(m, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
        b = (torch.randn(n, k, device="cuda") * 0.5).to(torch.float8_e4m3fn).t()
        sa, sb = torch.rand(m, device="cuda") + 0.5, torch.rand(n, device="cuda") + 0.5
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        outs = []
        for epilogue_mma in (True, False):
            cfg = GemmConfig(tm, tn, cm, max_clusters=max(1, 6 // cm), epilogue=epi, fp8_promote_every=1,
                             fp8_split_n=tn == 256, epilogue_mma=epilogue_mma)
            d = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
            compiled_gemm(cfg, kernel_specs(a, b, d, None, bias, sa, sb, cfg))(a, b, d, None, bias, sa, sb, 1.0, 0.0)
            outs.append(d)
        ref = (a.double() @ b.double()) * sa.double().reshape(-1, 1) * sb.double() + bias.double()
        assert torch.equal(outs[0], outs[1])
        assert (outs[0].double() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()


@gpu
@pytest.mark.parametrize("fast_accum", [False, True])
def test_fp8_configurations(fast_accum):
    # Every configuration fp8 may run (the heuristic's and the tuned candidates; exact: 128 x 256
    # split, 128 x 192, 128 x 128, ping-pong 128 x 96, each folding per k-tile; fast
    # accumulation: no fold, no ping-pong), clusters 1 and 2: ragged M, N and K, per-row /
    # per-column scales, a poisoned output, several tiles per CTA.
    from cute_kernels.gemm.config import Epilogue
    from cute_kernels.gemm.op import compiled_gemm, kernel_specs
    from cute_kernels.gemm.tuning import candidates

    m, n, k = 1000, 2896, 1040
    a = (torch.randn(m, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, device="cuda") * 0.5).to(torch.float8_e4m3fn).t()
    sa, sb = torch.rand(m, device="cuda") + 0.5, torch.rand(n, device="cuda") + 0.5
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = (a.double() @ b.double()) * sa.double().reshape(-1, 1) * sb.double()
    base = choose_config(m, n, k, 1, 1, 132, Epilogue(row_scale=True, col_scale=True), fast_accum=fast_accum)
    found = [dataclasses.replace(c, max_clusters=max(1, 16 // c.cluster_m))
             for c in candidates(base, m, 132, fp8=True)]
    expected = {(256, False), (128, False)} if fast_accum else {(256, False), (192, False), (128, False), (96, True)}
    assert {(c.tile_n, c.pingpong) for c in found} == expected
    assert all(c.fp8_promote_every == (0 if fast_accum else 1) for c in found)
    for cfg in found:
        d.fill_(float("nan"))
        compiled_gemm(cfg, kernel_specs(a, b, d, None, None, sa, sb, cfg))(a, b, d, None, None, sa, sb, 1.0, 0.0)
        err = (d.double() - ref).abs().max().item() / ref.abs().max().item()
        assert err <= 1e-2, (err, cfg)


@gpu
def test_fp8_fast_accum_long_k():
    # The op at K = 16384: fast accumulation's documented accuracy trade, bounded by cuBLAS's.
    a = (torch.randn(512, 16384, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    b = (torch.randn(512, 16384, device="cuda") * 0.5).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    ref = a.double() @ b.double()
    runs = {"exact": lambda: ck.gemm_fp8(a, b, one, one),
            "fast": lambda: ck.gemm_fp8(a, b, one, one, fast_accum=True),
            "cublas fast": lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16, use_fast_accum=True)}
    errs = {name: (run().double() - ref).abs().max().item() / ref.abs().max().item() for name, run in runs.items()}
    assert errs["exact"] <= 1e-2, errs
    # Without promotion the tensor core's own accumulation over K = 16384 loses more (the
    # documented trade); ours stays within twice cuBLAS's fast-accumulation error.
    assert errs["fast"] <= 2 * errs["cublas fast"] + 1e-3, errs


@gpu
def test_tuned_choice_is_correct_and_persists(tmp_path, monkeypatch):
    from cute_kernels.gemm import op, tuning

    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_memory", {})
    a = torch.randn(1536, 520, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(520, 2048, device="cuda", dtype=torch.bfloat16)
    check(ck.gemm(a, b, tuned=True), a, b)
    stored = list(tmp_path.rglob("gemm_tuning.json"))
    assert len(stored) == 1 and len(tuning._memory) == 1
    tuning._memory.clear()
    op._kernels.clear()
    op._plans.clear()
    check(ck.gemm(a, b, tuned=True), a, b)  # read back from disk, no re-timing needed
    assert len(tuning._memory) == 1


def test_cpu_tensor_is_refused():
    with pytest.raises(ck.DeviceError):
        ck.gemm(torch.randn(4, 4, dtype=torch.bfloat16), torch.randn(4, 4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        ck.gemm([[1.0]], torch.randn(1, 1, dtype=torch.bfloat16))


# ---------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize("mnk", [(1, 1, 1), (17, 33, 65), (128, 256, 64), (129, 257, 65), (300, 200, 1000),
                                 (1024, 1024, 1024), (64, 64, 64), (2048, 512, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shapes(mnk, dtype):
    m, n, k = mnk
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype)
    check(ck.gemm(a, b), a, b)


@gpu
def test_issue_one_by_eight_times_eight_by_one():
    a = torch.randn(1, 8, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8, 1, device="cuda", dtype=torch.bfloat16)
    check(ck.gemm(a, b), a, b)


def _odd_strides(t, seed):
    """``t``'s values in a view whose size-1 dims have arbitrary strides (what DLPack, slicing
    and expand produce)."""
    g = torch.Generator().manual_seed(seed)
    stride = [int(torch.randint(1, 50, (1,), generator=g)) if d == 1 else s
              for d, s in zip(t.shape, t.stride())]
    return t.as_strided(t.shape, stride)


@gpu
@pytest.mark.parametrize("m", [0, 1, 2, 17])
@pytest.mark.parametrize("n", [0, 1, 3, 24])
@pytest.mark.parametrize("k", [0, 1, 5, 64])
def test_degenerate_shapes(m, n, k):
    # GEMV-shaped and empty products, both operand layouts, size-1 dims with odd strides, and
    # an output the TMA store cannot write (a column vector): the right answer, never a DSL error.
    for seed, (a_t, b_t) in enumerate(((False, False), (True, False), (False, True), (True, True))):
        a = torch.randn(k, m, device="cuda", dtype=torch.bfloat16).t() if a_t else \
            torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() if b_t else \
            torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        a, b = _odd_strides(a, seed), _odd_strides(b, seed + 7)
        y = ck.gemm(a, b)
        assert y.shape == (m, n)
        check(y, a, b)
        out = torch.full((n, m), float("nan"), device="cuda", dtype=torch.bfloat16).t()
        assert ck.gemm(a, b, out=out) is out
        check(out, a, b)
    a3 = torch.randn(1, m, k, device="cuda", dtype=torch.bfloat16)
    b3 = torch.randn(1, k, n, device="cuda", dtype=torch.bfloat16)
    check(ck.gemm(_odd_strides(a3, 3), _odd_strides(b3, 4)), a3, b3)


@gpu
@pytest.mark.parametrize("a_t", [False, True])
@pytest.mark.parametrize("b_t", [False, True])
def test_layouts_without_copies(a_t, b_t):
    m, n, k = 384, 264, 520
    a = torch.randn(k, m, device="cuda", dtype=torch.bfloat16).t() if a_t else torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() if b_t else torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    check(ck.gemm(a, b), a, b)


@gpu
def test_batched_and_out_dtypes_and_out():
    a = torch.randn(3, 200, 136, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(3, 136, 72, device="cuda", dtype=torch.bfloat16)
    check(ck.gemm(a, b), a, b)
    y = ck.gemm(a[0], b[0], out_dtype=torch.float32)
    assert y.dtype == torch.float32
    assert (y.double() - ref_mm(a[0], b[0])).abs().max().item() < 1e-2
    out = torch.full((200, 72), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert ck.gemm(a[0], b[0], out=out) is out and not out.isnan().any()


@gpu
def test_mid_k_pingpong_through_the_op():
    # The heuristic's ping-pong choice at K = 2048 (23 tile columns, the last two thirds
    # full), through ck.gemm and autograd, into a poisoned output, against float64.
    m, n, k = 4096, 4352, 2048
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert choose_config(m, n, k, 1, 2, sms).pingpong
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    ck.gemm(a.detach(), b.detach(), out=out)
    check(out, a.detach(), b.detach())
    grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    ck.gemm(a, b).backward(grad)
    check(a.grad, grad, b.detach().t())
    check(b.grad, a.detach().t(), grad)


@gpu
@pytest.mark.parametrize("mnk", [(1000, 5000, 1000), (3000, 5000, 2000), (1024, 4352, 4096)])
@pytest.mark.parametrize("weight", [False, True])
def test_wide_tiles_through_the_op(mnk, weight):
    # The heuristic's 256 x 160 tiles (row and column tails: M and N not multiples of the
    # tile), B as (K, N) or as an nn.Linear weight (N, K) transposed, into a poisoned output.
    m, n, k = mnk
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = choose_config(m, n, k, 1, 2, sms)
    assert (cfg.tile_m, cfg.tile_n, cfg.cluster_m) == (256, 160, 2), cfg
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) + 0.5
    b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() if weight
         else torch.randn(k, n, device="cuda", dtype=torch.bfloat16))
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    ck.gemm(a, b, out=out)
    check(out, a, b)


@gpu
@pytest.mark.parametrize("mnk", [(1000, 2904, 64), (4100, 1032, 200)])
def test_persistent_schedule_writes_every_tile_once(mnk):
    # More tiles than SMs, and a last group of tile columns narrower than the others.
    m, n, k = mnk
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    ck.gemm(a, b, out=out)
    check(out, a, b)


@gpu
def test_repeated_calls_use_a_plan_and_stay_correct():
    base = torch.randn(300, 136, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(64, 200, device="cuda", dtype=torch.bfloat16)
    aligned, misaligned = base[:, 8:72], base[:, 1:65]  # same shape and strides
    for a in (aligned, aligned, misaligned, aligned):
        check(ck.gemm(a, b), a, b)
    bias = torch.randn(200, device="cuda", dtype=torch.bfloat16)
    for alpha in (0.5, 1.0, 0.5, -2.0, 1.0):  # alpha = 1 compiles without the multiply
        y = ck.gemm(aligned, b, bias=bias, alpha=alpha, activation="relu")
        check(y, aligned, b, extra=torch.relu(alpha * ref_mm(aligned, b) + bias.double()))


@gpu
def test_repeated_calls_with_out_use_a_plan_where_the_kernel_writes_out():
    # A row-major out the TMA store can write gets a plan (new data, a misaligned out pointer
    # and a column-major out must still come out right); the result is out itself each time.
    from cute_kernels.gemm import op

    op._plans.clear()
    base = torch.empty(96 * 200 + 1, device="cuda", dtype=torch.float16)
    for m, k, n in ((96, 64, 200), (128, 128, 128)):
        for _ in range(3):
            a = torch.rand(m, k, device="cuda", dtype=torch.float16)
            b = torch.rand(k, n, device="cuda", dtype=torch.float16)
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float16)
            assert ck.gemm(a, b, out=out) is out
            check(out, a, b)
    assert any(key[-1] is not None for key in op._plans)
    a = torch.rand(96, 64, device="cuda", dtype=torch.float16)
    b = torch.rand(64, 200, device="cuda", dtype=torch.float16)
    for out in (base[1:].view(96, 200), torch.empty(200, 96, device="cuda", dtype=torch.float16).t()):
        for _ in range(2):
            out.fill_(float("nan"))
            assert ck.gemm(a, b, out=out) is out
            check(out, a, b)


@gpu
def test_unaligned_k_plan_pads_each_call_and_stays_correct():
    # K = 777: neither the activations' rows nor the (N, K) weight's are 16-byte multiples. The
    # first call plans zero-padding along K; later calls (new data, a misaligned pointer, a
    # bias) must still match float64.
    from cute_kernels.gemm import op

    w = torch.randn(1000, 777, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a = torch.randn(333, 777, device="cuda", dtype=torch.bfloat16)
        check(ck.gemm(a, w.t()), a, w.t())
    assert any(plan[-1] is not None for plan in op._plans.values())  # a padding plan
    base = torch.randn(333 * 777 + 1, device="cuda", dtype=torch.bfloat16)
    a = base[1:].view(333, 777)
    check(ck.gemm(a, w.t()), a, w.t())
    bias = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        y = ck.gemm(a, w.t(), bias=bias)
        check(y, a, w.t(), extra=ref_mm(a, w.t()) + bias.double())
    # The padded copies are kept per stream and rewritten by each call: results of earlier
    # calls stay theirs, and a call on another stream gets its own copies.
    pairs = [(torch.randn(333, 777, device="cuda", dtype=torch.bfloat16),
              torch.randn(1000, 777, device="cuda", dtype=torch.bfloat16)) for _ in range(3)]
    outs = [ck.gemm(x, v.t()) for x, v in pairs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = [ck.gemm(x, v.t()) for x, v in pairs]
    torch.cuda.current_stream().wait_stream(side)
    for (x, v), y, z in zip(pairs, outs, on_side):
        check(y, x, v.t())
        check(z, x, v.t())


@gpu
@pytest.mark.parametrize("mnk", [(5, 2048, 777), (333, 1000, 777), (600, 1200, 1001), (100, 64, 7),
                                 (5, 4096, 777), (2000, 3000, 1001), (3000, 5000, 1999), (8192, 16, 4095),
                                 (4096, 4096, 4095)])
def test_unaligned_k_products_pad_in_the_gemm_launch(mnk):
    # Unaligned K through the plan: up to PAD_FUSE_MAX_BYTES of padded copies the GEMM fills the
    # kept copies itself (pad_k: a transposed skinny product, cooperative tiles, K < 8); beyond,
    # a padding kernel first (kept copies up to PAD_KEEP_MAX_BYTES: 3000 x 5000 x 1999; fresh ones
    # beyond: 8192 x 16 x 4095, 4096 x 4096 x 4095).
    # Every call gets new operands, far from zero mean; results of earlier calls stay theirs.
    from cute_kernels.gemm import op

    m, n, k = mnk
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) + 3 for _ in range(3)]
    ys = [ck.gemm(x, w.t()) for x in xs]
    for x, y in zip(xs, ys):
        check(y, x, w.t())
    plan = next(p for key, p in op._plans.items() if key[:2] == (xs[0].shape, w.t().shape))
    assert plan[0] is None and plan[-1] is not None  # launched through the padder
    fused = (m + n) * (-(-k // 8) * 8) * 2 <= op.PAD_FUSE_MAX_BYTES
    assert plan[-1].__name__ == ("run_fused" if fused else "run")  # the padder this size takes
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for x in xs[:2]:
        check(ck.gemm(x, w.t(), bias=bias), x, w.t(), extra=ref_mm(x, w.t()) + bias.double())


@gpu
@pytest.mark.parametrize("lmnk", [(None, 1, 4096, 8192), (None, 16, 2048, 14336), (None, 3, 17000, 512),
                                  (None, 40, 2500, 4096), (None, 64, 4096, 1000), (None, 17, 3000, 520),
                                  (None, 16, 1000, 14336), (None, 64, 8192, 512), (1, 16, 2048, 8192),
                                  (3, 16, 2048, 1024), (2, 1, 2600, 9000), (2, 33, 2048, 256),
                                  (None, 5, 3968, 12296), (None, 1, 4100, 4104)])
def test_skinny_products_run_transposed_and_match(lmnk):
    # M <= 64 against many weight rows: D^T = W x^T on 64 x 16..64 tiles, D written
    # column-major; weights as nn.Linear stores them and as a plain (K, N) matrix, poisoned out;
    # batched products of the same M, N, K but other batch sizes get their own kernels. The
    # last two 2-D shapes stay untransposed (the rule's other side).
    from cute_kernels.gemm import op

    batch, m, n, k = lmnk
    lead = () if batch is None else (batch,)
    a = torch.randn(*lead, m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(*lead, n, k, device="cuda", dtype=torch.bfloat16)
    config = op.heuristic_config(a, w.transpose(-1, -2), None, None, None, None, Epilogue(), False, 132)
    assert config.swap_ab == (lmnk not in ((None, 16, 1000, 14336), (None, 64, 8192, 512)))
    for b in (w.transpose(-1, -2), w.transpose(-1, -2).contiguous()):
        for _ in range(2):  # the second call takes the launch plan
            check(ck.gemm(a, b), a, b)
        out = torch.full((*lead, m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        assert ck.gemm(a, b, out=out) is out
        check(out, a, b)


@gpu
def test_unit_alpha_kernel_refuses_other_alphas():
    from cute_kernels.gemm.config import GemmConfig
    from cute_kernels.gemm.op import compiled_gemm, kernel_specs

    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    d = torch.full((64, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    cfg = GemmConfig(64, 128, max_clusters=132)
    launch = compiled_gemm(cfg, kernel_specs(a, b, d, None, None, None, None, cfg))
    with pytest.raises(ValueError, match="alpha=0.5"):
        launch(a, b, d, None, None, None, None, 0.5, 0.0)
    assert d.isnan().all()
    launch(a, b, d, None, None, None, None, 1.0, 0.0)
    check(d, a, b)


@gpu
def test_misaligned_operands_fall_back_to_copies():
    a = torch.randn(33, 7, device="cuda", dtype=torch.bfloat16)  # K = 7: rows not 16-byte multiples
    b = torch.randn(7, 5, device="cuda", dtype=torch.bfloat16)
    check(ck.gemm(a, b), a, b)
    big = torch.randn(100, 130, device="cuda", dtype=torch.bfloat16)
    a2 = big[:, 1:65]  # misaligned pointer
    b2 = torch.randn(64, 48, device="cuda", dtype=torch.bfloat16)
    check(ck.gemm(a2, b2), a2, b2)


@gpu
@pytest.mark.parametrize("activation", [None, "relu", "gelu_tanh", "silu"])
def test_epilogue(activation):
    m, n, k = 256, 384, 320
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    c = torch.randn(n, m, device="cuda", dtype=torch.float32).t()  # column-major C
    z = 0.5 * ref_mm(a, b) + 0.25 * c.double() + bias.double()
    ref = {None: z, "relu": torch.relu(z), "silu": F.silu(z), "gelu_tanh": F.gelu(z, approximate="tanh")}[activation]
    out = ck.gemm(a, b, bias=bias, alpha=0.5, beta=0.25, c=c, activation=activation)
    check(out, a, b, extra=ref)


@gpu
def test_autograd():
    a = torch.randn(96, 80, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(80, 112, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(112, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = ck.gemm(a, b, bias=bias, activation="gelu_tanh")
    g = torch.randn_like(y)
    ours = torch.autograd.grad(y, [a, b, bias], g)
    a64, b64, bias64 = (t.detach().double().requires_grad_() for t in (a, b, bias))
    refs = torch.autograd.grad(F.gelu(a64 @ b64 + bias64, approximate="tanh"), [a64, b64, bias64], g.double())
    for o, r in zip(ours, refs):
        assert (o.double() - r).abs().max().item() <= 2e-2 * r.abs().max().item() + 1e-2


@gpu
def test_nan_propagates():
    a = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    a[3, 5] = float("nan")
    y = ck.gemm(a, b)
    assert y[3].isnan().all() and not y[4].isnan().any()


@gpu
@pytest.mark.parametrize("fast_accum", [False, True])
@pytest.mark.parametrize("scales", ["tensor", "vector", "row_and_tensor", "tensor_and_column"])
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8(scales, fmt, fast_accum):
    # Ragged M and N (tails of the 128 x 256 tile), each scale kind and their mixes: per-tensor
    # scales are folded into alpha, vectors are read once per row / column in the epilogue.
    m, n, k = 330, 264, 2048
    a = (torch.randn(m, k, device="cuda") * 0.5).to(fmt)
    w = (torch.randn(n, k, device="cuda") * 0.5).to(fmt)
    b = w.t()  # column-major (K, N): K-major
    row_vector = scales in ("vector", "row_and_tensor")
    col_vector = scales in ("vector", "tensor_and_column")
    sa = torch.rand(m, device="cuda") + 0.5 if row_vector else torch.tensor(0.7, device="cuda")
    sb = torch.rand(n, device="cuda") + 0.5 if col_vector else torch.rand(1, device="cuda") + 0.5
    y = ck.gemm_fp8(a, b, sa, sb, fast_accum=fast_accum)
    ref = (a.double() @ b.double()) * (sa.double().reshape(-1, 1) if row_vector else sa.double()) * sb.double()
    err = (y.double() - ref).abs().max().item()
    assert err <= 1e-2 * ref.abs().max().item()


@gpu
@pytest.mark.parametrize("m, n, tile", [(1024, 4096, (128, 256)), (2048, 3072, (128, 192)),
                                        (512, 512, (128, 128)), (100, 1024, (64, 128))])
def test_fp8_accumulates_like_scaled_mm(m, n, tile):
    # Every tile the heuristic picks for fp8 folds every 128 values of K: with fp32 output over
    # a long K its error against float64 is cuBLAS's (the tensor core's own accumulation over
    # all of K, as with fast accumulation, would be several times larger).
    from cute_kernels.gemm.config import choose_config
    from cute_kernels.runtime.arch import sm_count

    k = 16384
    cfg = choose_config(m, n, k, 1, 1, sm_count(0))
    assert (cfg.tile_m, cfg.tile_n, cfg.fp8_promote_every) == (*tile, 1)
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    ref = a.double() @ b.double()
    ours = ck.gemm_fp8(a, b, one, one, out_dtype=torch.float32)
    cublas = torch._scaled_mm(a, b, one, one, out_dtype=torch.float32)
    fast = ck.gemm_fp8(a, b, one, one, out_dtype=torch.float32, fast_accum=True)
    err, err_cublas, err_fast = ((t.double() - ref).abs().max().item() for t in (ours, cublas, fast))
    assert err <= 1.25 * err_cublas, (err, err_cublas)
    assert err_fast >= 2 * err, (err_fast, err)  # the test can tell the two apart


@gpu
def test_torch_compile():
    f = torch.compile(lambda a, b, bias: ck.gemm(a, b, bias=bias, activation="relu"), fullgraph=True)
    a = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(f(a, b, bias), ck.gemm(a, b, bias=bias, activation="relu"))


@gpu
def test_bad_inputs():
    a = torch.randn(8, 8, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ck.UnsupportedError, match="inner dims"):
        ck.gemm(a, torch.randn(7, 8, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ck.DTypeError, match="same dtype"):
        ck.gemm(a, a.half())
    with pytest.raises(ck.DTypeError):
        ck.gemm(a.float(), a.float())
    with pytest.raises(ck.UnsupportedError, match="activation"):
        ck.gemm(a, a, activation="tanh")
    with pytest.raises(ck.UnsupportedError, match="bias"):
        ck.gemm(a, a, bias=torch.ones(7, device="cuda"))
