"""GEMM configurations and the heuristic that picks one.

Pure functions of (M, N, K, batch, dtypes, SM count): no tensor data is read, nothing is
allocated or synchronized.
"""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATIONS = (None, "relu", "gelu_tanh", "silu")


@dataclass(frozen=True)
class Epilogue:
    """What the epilogue applies to the fp32 accumulator, in this order:
    ``alpha * acc (+ beta * C) (+ bias[col])``, then the activation, then the output cast.
    (Integer accumulators: the zero-point correction first, in int32.)
    Without ``alpha`` the kernel takes alpha to be 1 and skips the multiply (its launcher
    refuses any other value)."""

    bias: bool = False
    residual: bool = False  # beta * C
    activation: str | None = None
    row_scale: bool = False  # fp8 / int8: acc * scale_a[row]
    col_scale: bool = False  # fp8 / int8: acc * scale_b[col]
    # fp8 / int8 per-tensor scales: one value each (scale_a[0], scale_b[0]), read once per CTA
    # and folded into alpha; exclusive with the vector form of the same operand.
    scalar_scale_a: bool = False
    scalar_scale_b: bool = False
    alpha: bool = False  # acc * alpha for a runtime alpha other than 1
    # int8 with asymmetric A: acc - zero_a[row] * sum_b[col] in int32, before anything else
    # (A's per-row zero points against B's column sums over K).
    zero_point: bool = False

    @property
    def multiplies(self) -> bool:
        """Whether every value is multiplied by one scalar (alpha and the per-tensor scales)."""
        return self.alpha or self.scalar_scale_a or self.scalar_scale_b


@dataclass(frozen=True)
class GemmConfig:
    tile_m: int  # 64 (one MMA warpgroup), 128 or 256 (two, cooperative: 64 / 128 rows each)
    tile_n: int  # 64 .. 256, multiple of 16
    cluster_m: int = 1  # CTAs along M sharing B tiles (TMA multicast)
    cluster_n: int = 1  # CTAs along N sharing A tiles
    swizzle: int = 8  # rasterization group size (in clusters) for L2 reuse
    # Grid size cap in clusters: the persistent grid launches min(tiles, max_clusters) clusters
    # and each walks its share of the tiles; 2^30 launches one cluster per tile.
    max_clusters: int = 1 << 30
    epilogue: Epilogue = Epilogue()
    fp8_promote_every: int = 0  # fp8: fold the MMA accumulator into fp32 every this many k-tiles
    # fp8: the MMA accumulator covers half the tile's columns and is folded after each half of
    # every k-tile (a promotion every 128 values of K), so a 128 x 256 tile fits the registers.
    fp8_split_n: bool = False
    warpgroups: int = 0  # MMA warpgroups: 0 = one per 64 rows of the tile (two for ping-pong)
    # Ping-pong: two MMA warpgroups take alternate tiles (tile_m = 64 rows each); one runs its
    # mainloop while the other runs its epilogue, so the tensor cores never wait for stores.
    pingpong: bool = False
    # Stream-K tail: the tiles of a last, partial wave are shared out along K, one equal run of
    # k-tiles per cluster, with partial sums through a workspace (kernel_sm90.py).
    stream_k: bool = False
    # fp8 with a fold every k-tile (cooperative, no stream-K): each tile's epilogue also runs the
    # next tile's first k-tile on the tensor cores, whose MMA accumulator is free then (the last
    # tile's epilogue runs one extra k-tile, so it pays where CTAs have several tiles).
    epilogue_mma: bool = False
    # The kernel computes D^T = B^T A^T: its A is the caller's B transposed (the weight's rows
    # along the MMA's M), its B the caller's A, its D the caller's D transposed; tile_m / tile_n
    # count rows of that problem (gemm/op.py runs skinny products so). No C, bias or scales.
    swap_ab: bool = False
    epi_n: int = 32  # output columns per epilogue sub-tile (one TMA store each)
    epi_stages: int = 4  # shared-memory buffers of epilogue sub-tiles (stores in flight)
    k_blocks: int = 4  # MMA k-blocks per pipeline stage (64 values of K for 16-bit operands)
    # CTAs resident per SM: 2 halves each CTA's shared memory (pipeline stages) and registers
    # (MMA warpgroups setmaxnreg to 216 instead of 232), for grids of more CTAs than SMs.
    ctas_per_sm: int = 1
    # K-major A and B whose rows TMA cannot read (K not a multiple of 16 bytes): the kernel
    # first copies them into zero-padded buffers, the grid meets at a barrier, then the
    # mainloop reads the buffers (one launch where a separate padding kernel would cost a second).
    pad_k: bool = False

    # The self-check's short name: "128x256 c2x1" (tile, cluster), then the other fields that
    # differ from their defaults.
    label_fields = ("tile_m", "tile_n", "cluster_m", "cluster_n", "max_clusters")

    @property
    def label(self) -> str:
        return f"{self.tile_m}x{self.tile_n} c{self.cluster_m}x{self.cluster_n}"

    @property
    def mma_warpgroups(self) -> int:
        return self.warpgroups or (2 if self.pingpong or self.tile_m > 64 else 1)

    @property
    def threads(self) -> int:
        return 128 * (1 + self.mma_warpgroups)


# Relative MMA throughput of each tile shape at large K (measured on H100, 4096^3 bf16:
# 749 / 503 TFLOP/s, benchmarks/NOTES.md). The smaller tile wins only by filling more SMs.
TILE_EFFICIENCY = {(128, 256): 1.0, (128, 128): 0.7}
# fp8 keeps a second fp32 accumulator for the promotion: 128 x 256 fits only with the
# column-split promotion; 128 x 192 and 128 x 128 hold both accumulators whole (measured at
# 8192^3: 1263-1276 / 1229-1234 vs 1233-1278 TFLOP/s; at 4096^3 128 x 128 1178 vs 1301;
# benchmarks/NOTES.md), so 128 x 192 wins where its waves round better.
FP8_TILE_EFFICIENCY = {(128, 256): 1.0, (128, 192): 1.0, (128, 128): 0.85}
# fp8 without promotion (fast accumulation): 1314 / 1358 vs 1058 / 1030 TFLOP/s at 4096^3 /
# 8192^3 (benchmarks/NOTES.md).
FP8_FAST_TILE_EFFICIENCY = {(128, 256): 1.0, (128, 128): 0.8}
# 16-bit ping-pong: three epilogue buffers per warpgroup instead of four leave room for a fifth
# 40 KB pipeline stage of 128 x 192 tiles; the epilogue (slower with fewer stores in flight)
# runs under the other warpgroup's mainloop. Measured 1.04-1.07x at 8192^2 x 512, 1.01x at
# 16384 x 8192 x 1024, 0.99-1.01x at 8192^2 x 1024 and 4096 x 8192 x 1024 (benchmarks/NOTES.md).
PINGPONG_EPI_STAGES = 3
# Beyond this K the cooperative tile's epilogue is too small a share of a tile for the
# ping-pong schedule to pay even against a costly stream-K tail (measured 0.87x at
# 4096 x 4352 x 8192, 0.97-0.99x at 8192^3; at K = 4096 the wave counts decide).
PINGPONG_MAX_K = 4096


def _pingpong_charge(k: int) -> float:
    """The cooperative schedule's exposed epilogue as a share of a tile's time, as measured
    against the ping-pong schedule: 8% at K = 1024 to 2048, growing as 1/K below (16% at 512)
    and falling as 1/K above (5.3% at 3072)."""
    return 0.08 * max(1024 / k, min(1.0, 2048 / k))


# A stream-K tail cuts each of its tiles into 1 / fill pieces, and the CTA that ends a tile adds
# the others' partial sums one after another. Beyond this many pieces per tile at K = 4096
# (in proportion to K elsewhere) that takes longer than the data-parallel wave it replaces
# (measured, stream-K / data-parallel: 0.98x at 2048 x 4352 x 4096 and 1.00x at 16384^2 x 4096
# with 16.5 pieces, 0.86x at 3072 x 4352 x 2048 with 11, 0.96x at 16384 x 8192 x 8192 with 33,
# 1.07x at 5120^2 x 8192 with 16.5, 1.07x at 4096 x 4352 x 4096 with 8).
STREAM_K_MAX_PIECES = 16


# A stream-K run of one partial wave (every tile cut) must cover at least this much of K per
# cluster (``choose_config``).
SINGLE_WAVE_MIN_RUN = 3072
# 16-bit tiles for 128 < M <= 256, by measured throughput per tile (H200, 256 x N x K): 64 x 128
# tiles in pairs along M ran 585 vs 423 TFLOP/s for 128 x 128 at 256 x 4096 x 14336 (128 vs 64
# CTAs), 404 vs 390 at 256 x 6144 x 4096, and 489 vs 520 (128 x 128 with a stream-K tail) at
# 256 x 10240 x 8192.
# 128 x 160 tiles in pairs along M (as many as 132 SMs hold at N = 10240: 64 column tiles) ran
# 714 vs 492 TFLOP/s (128 x 256 with a stream-K tail; cuBLAS 703) and 513 (128 x 128, a stream-K
# tail) at 256 x 10240 x 8192, 442 vs 327 (128 x 128) at 192 x 8192 x 8192; but 606 vs 663 at
# 256 x 8192 x 8192 (128 x 128 tiles filling 128 SMs), 337 vs 583 (64 x 128 pairs) at
# 256 x 4096 x 14336, 426 vs 488 at 256 x 6144 x 4096 (a last wave 59% full; cuBLAS 520). The
# two 256 x 8192 / 10240 x 8192 measurements put its efficiency at 0.8 against 128 x 128's 0.7.
# On H100, at 256 x 28672 x 4096 (data-parallel): 128 x 160 pairs 578, 128 x 256 (no cluster:
# each weight slab read by two CTAs) 554, cuBLAS 576 TFLOP/s; 128 x 256 at 256 x 14336 x 4096
# (one wave) 544 vs 463 for 128 x 160 (1.4 waves): 128 x 256's unshared weight reads put it at
# 0.9, 128 x 160 at 0.85 (still below 128 x 128 at 256 x 8192 x 8192, one wave of each).
SMALL_M_TILE_EFFICIENCY = {(128, 256): 0.9, (128, 160): 0.85, (128, 128): 0.7, (64, 128): 0.6}
NARROW_TILE_MIN_FILL = 0.7
# 256 x 160 tiles (two warpgroups of 128 x 160: two m64 MMAs per k-block, so B is read twice
# per k-block), for 16-bit inputs with M > 256, where N's 256-wide tile columns round the waves
# badly (cuBLAS's own choice at N = 5000 is a 256 x 152 tile, three full waves at M = 3000).
# Two epilogue buffers per warpgroup leave room for four 52 KB pipeline stages. Measured on
# H100 (`experiment_gemm.py --linear`, TFLOP/s, against 128 x 256 in clusters of two; cuBLAS):
# 3000 x 5000 x 2000 645 vs 594 (681; 3 vs 3.64 waves), 2048 x 5000 x 1000 479 vs 429 (518; 2
# vs 2.42), but 3000 x 5000 x 1000 492 vs 508 (522: its larger epilogue shows at short K),
# 4096 x 5000 x 4096 663 vs 669 (both 97% full waves), 4096^3 560 vs 718 (4 waves, 79% vs 97%
# full). With three stages and four buffers: 602 / 454 / 476 / 661 / 561. Its efficiency
# against 128 x 256 (``wide_tile_efficiency``): 0.9 at K <= 1024, 0.97 from K = 2048.
WIDE_TILE = (256, 160)
WIDE_EPI_STAGES = 2


def wide_tile_efficiency(k: int) -> float:
    """The 256 x 160 tile's throughput relative to 128 x 256's (``WIDE_TILE``): its larger
    epilogue is a larger share of short tiles."""
    return 0.9 + 0.07 * min(1.0, max(0.0, (k - 1024) / 1024))
# A single partial wave of 64-row tiles is cut along K only while fewer tiles than half the
# clusters would run data-parallel: from there the data-parallel grid streams the weights as
# fast (memory-bound at these sizes) without the partial sums (measured, data-parallel vs
# stream-K: 225 vs 199 TFLOP/s at 64 x 14336 x 4096 (112 tiles), 220 vs 210 at
# 64 x 10240 x 8192 (80); 155 vs 179 at 64 x 4096 x 14336 (32)).
SINGLE_WAVE_MAX_FILL = 0.5


def narrow_tile_k_blocks(tile_n: int, tiles: int, k: int, sm_count: int) -> int:
    """MMA k-blocks per pipeline stage for the 64 x 16..64 tiles of skinny products. They are
    memory-bound, and each stage costs the MMA warpgroup a fixed wait-issue-release round: with
    at most one tile per SM, longer stages let each CTA stream faster (the same shared memory in
    fewer, larger stages). Measured on H100 (`experiment_gemm.py --linear`, direct launches,
    TFLOP/s for 4 / 8 / 16 k-blocks, cuBLAS): 1 x 14336 x 4096 2.59 / 2.66 / 2.65 (2.67),
    16 x 14336 x 4096 40.4 / 41.5 / 41.7 (41.9), 16 x 4096 x 14336 (64 tiles) 37.5 / 39.3 /
    41.6 (39.9), 16 x 6144 x 4096 (96 tiles) 33.7 / 35.1 / 32.6, 1 x 10240 x 8192 2.62 / 2.69 /
    2.61; 16-column tiles take 16 where at most half the SMs have a tile, else 8. 32 / 48
    columns: 8 (32 x 4096 x 14336 78.7 / 83.2 / 79.3, 48 x 4096 x 14336 121 / 123 / 98);
    64 columns: 4 (158 / 157 at 64 x 4096 x 14336). Short K keeps 4 (a stage past K's end
    would be MMAs on zeros)."""
    if tile_n == 16 and 2 * tiles <= sm_count and k >= 4096:
        return 16
    if tile_n <= 48 and k >= 1024:
        return 8
    return GemmConfig.k_blocks


def stream_k_tail_waves(fill: float, k: int) -> float:
    """Time of a stream-K tail in waves, for a last wave ``fill`` full: the tail's work, the
    partial exchange (0.3, measured), and beyond four pieces per tile 0.05 per piece at
    K = 4096 (the owner's additions, a fixed time: a smaller share of longer tiles). Callers
    cap it at the data-parallel wave (measured 1.01x data-parallel at 73% fill)."""
    return fill + 0.3 + 0.05 * 4096 / k * max(0.0, 1 / fill - 4)


def choose_config(m: int, n: int, k: int, batch: int, itemsize: int, sm_count: int,
                  epilogue: Epilogue = Epilogue(), fast_accum: bool = False) -> GemmConfig:
    """Tile and cluster shape for a (batch x) M x N x K problem.

    128 x 256 (two MMA warpgroups of 64 x 256) and 128 x 128 tiles, and for 16-bit inputs
    256 x 160 (``WIDE_TILE``) where its waves round well, are scored by their wave count
    (tiles / SMs, rounded up) times the tile's work divided by its measured MMA efficiency; the
    cheapest wins, so small problems shrink the tile until more SMs have work.
    M <= 128 takes 64 x 128 tiles (one warpgroup), with a 2-CTA cluster along M sharing B when
    M > 64; fp8 chooses among 128 x 256 (column-split promotion), 128 x 192 and 128 x 128 the
    same way (``fast_accum``: no promotion, one accumulator, 128 x 256 or 128 x 128); short and
    mid-length K (up to ``PINGPONG_MAX_K``) with many tiles takes the ping-pong schedule. A
    2-CTA cluster along M halves B traffic from L2 when there are enough tiles to fill the
    clusters. The grid is persistent:
    at most one CTA per SM; a mostly empty last wave with long K runs as a stream-K tail.
    """
    def tiles(tm, tn):
        return -(-m // tm) * -(-n // tn) * batch

    fast_accum = fast_accum and itemsize == 1
    efficiency = dict(TILE_EFFICIENCY if itemsize != 1 else
                      FP8_FAST_TILE_EFFICIENCY if fast_accum else FP8_TILE_EFFICIENCY)
    # The 256 x 160 tile (``WIDE_TILE``) runs in clusters of two along M and rounds waves: it
    # is a candidate where its row tiles pair up and its last wave is at least 80% full.
    wide_fill = tiles(*WIDE_TILE) / sm_count % 1
    if itemsize == 2 and m > 256 and -(-m // WIDE_TILE[0]) % 2 == 0 and (wide_fill == 0 or wide_fill >= 0.8):
        efficiency[WIDE_TILE] = wide_tile_efficiency(k)

    def cost(shape):
        tm, tn = shape
        return -(-tiles(tm, tn) // sm_count) * tm * tn / efficiency[shape]

    exact_fp8 = itemsize == 1 and not fast_accum

    def clusters_and_tail(tm, tn, pingpong):
        """(cluster_m, clusters launched, cluster tiles, stream-K tail?) for a tile shape.

        A 2-CTA cluster along M where there are enough tiles (fp8 128 x 256 runs without: measured
        1233 vs 1222 TFLOP/s at 8192^3, 1181 vs 1165 at 4096^3). Stream-K tail for 16-bit
        inputs when the last wave is at most 75% full and K is long: its tiles are shared out
        along K instead of leaving clusters idle (measured, 128 x 256 cluster 2, stream-K vs
        not: 1.12x at 4096 x 4352 x 4096 (last wave 12% full), 1.07x at 8192 x 4352 x 8192
        (24%), 1.02x at 8192^3 (52%), 1.01x at 6144^3 (73%); 0.97-1.00x at 3.88 waves (88%),
        where the fixed cost of the partial sums outweighs the idle time saved). fp8 stays
        data-parallel: its tails lost at every fill measured (24% to 88%), an fp8 tile's
        mainloop being half a bf16 one's against the same 128 KB partial exchange. A nearly
        empty last wave stays data-parallel too (``STREAM_K_MAX_PIECES``)."""
        # (the two 128 x 160 tiles of 128 < M <= 256 always pair: measured 714 vs 699 TFLOP/s
        # at 256 x 10240 x 8192, 673 vs 641 at 256 x 28672 x 4096)
        enough = (tiles(tm, tn) >= 2 * sm_count or 64 < m <= 256 and tm == 64
                  or 128 < m <= 256 and tn == 160 or (tm, tn) == WIDE_TILE)
        one_cta = itemsize == 1 and tn == 256 or tn <= 64  # (no B worth sharing: skinny tiles)
        cm = 2 if enough and not one_cta and -(-m // tm) % 2 == 0 else 1
        clusters = max(1, sm_count // cm)
        cluster_tiles = -(-m // (tm * cm)) * -(-n // tn) * batch
        tail = cluster_tiles % clusters
        # With fewer tiles than clusters (one partial wave) every tile is cut, where each
        # cluster's run still covers K >= SINGLE_WAVE_MIN_RUN (measured at M = 16 / 64:
        # 1.2x at 4096 x 14336 and 1.27x at 8192 x 28672 (runs of 3475 / 13900); 0.74x at
        # 6144 x 4096 (1489); at M = 128 x 4096 x 4096, 0.69x (1985)).
        long_runs = cluster_tiles > clusters or (tail * k >= SINGLE_WAVE_MIN_RUN * clusters
                                                 and (tm > 64 or tail < SINGLE_WAVE_MAX_FILL * clusters))
        # At 128 < M <= 256 a tail after full waves cuts the two row tiles of a weight slab
        # apart, so the slab is read twice from DRAM: there only a single partial wave is cut
        # (measured on H100, stream-K / data-parallel: 128 x 256 0.84x / 0.79x at
        # 256 x 28672 / 14336 x 4096, 128 x 128 pairs 0.70x at 256 x 6144 x 4096, 64 x 128
        # pairs 0.80-0.98x; a single wave at 256 x 4096 x 14336: 1.17-1.32x).
        after_waves = 128 < m <= 256 and cluster_tiles > clusters
        stream_k = (itemsize == 2 and not pingpong and long_runs and tn > 64 and (tm, tn) != WIDE_TILE
                    and 0 < tail <= 0.75 * clusters and k >= 2048 and not after_waves
                    and clusters * 4096 <= STREAM_K_MAX_PIECES * k * tail)
        return cm, clusters, cluster_tiles, stream_k

    def tile_cost(shape):
        """Waves (a stream-K tail counted by ``stream_k_tail_waves``) times the tile's work over
        its efficiency; 128 x 160 tiles only where their last wave is at least
        ``NARROW_TILE_MIN_FILL`` full (they are there to round waves)."""
        _, clusters, cluster_tiles, stream_k_tail = clusters_and_tail(*shape, False)
        last_wave = cluster_tiles % clusters
        if shape == (128, 160) and 0 < last_wave < NARROW_TILE_MIN_FILL * clusters:
            return float("inf")
        waves = -(-cluster_tiles // clusters)
        if stream_k_tail:
            waves = min(waves, cluster_tiles // clusters
                        + stream_k_tail_waves(cluster_tiles % clusters / clusters, k))
        return waves * shape[0] * shape[1] / SMALL_M_TILE_EFFICIENCY[shape]

    k_blocks = GemmConfig.k_blocks
    if n <= 64 and m > 128 and itemsize == 2:
        # A few output columns (skinny products run transposed, gemm/op.py): 64-row tiles as
        # wide as N (16 to 64) stream A data-parallel, one slab per CTA; B is a sliver.
        tile_m, tile_n = 64, -(-n // 16) * 16
        k_blocks = narrow_tile_k_blocks(tile_n, tiles(tile_m, tile_n), k, sm_count)
    elif m <= 128:
        # One MMA warpgroup per 64 rows: nothing wasted for M <= 64, and for M <= 128 twice the
        # CTAs of a 128-row tile, in pairs sharing B (measured 341 vs 322 TFLOP/s for 128 x 128
        # tiles at 128 x 8192 x 8192).
        tile_m, tile_n = 64, 128
    elif m <= 256 and itemsize == 2:
        # Few row blocks: 64-row tiles in pairs fill twice the SMs of 128-row ones, and the
        # stream-K tails of each shape are counted (``SMALL_M_TILE_EFFICIENCY``).
        tile_m, tile_n = min(SMALL_M_TILE_EFFICIENCY, key=tile_cost)
    else:
        tile_m, tile_n = min(efficiency, key=cost)

    # Short K makes the epilogue a large share of each tile: the ping-pong schedule hides it
    # (128 x 192 per warpgroup), where there are many waves, N wastes little on 192-wide tiles
    # and its waves cost less than the cooperative tile's with that tile's exposed epilogue
    # charged (``_pingpong_charge``; a stream-K tail counted by ``stream_k_tail_waves``).
    # The ping-pong tiles must fill four waves at K <= 1024, two below K = 2048 and one from
    # K = 2048 on; the cost decides beyond that (one to two waves, M = 512 to 2048, K = 2048 /
    # 4096: measured 1.04-1.30x, one tie; at 1024 x 5120 x 1536 one ran 0.78x or 1.22x from one
    # process to the next, cuBLAS alike, so below K = 2048 two waves are asked). Measured
    # ping-pong / cooperative 128 x 256 (with the heuristic's stream-K tail where it gives one),
    # K = 1024 before the ping-pong hand-over moved ahead of the MMA drain (which gained
    # ping-pong 3-5%): 1.06x at 8192 x 8192 x 1024 (21 vs 16 waves), 1.05x at 8192^2 x 512, 1.01-1.03x at 4096 x 8192 x 1024 (11 vs 8),
    # 1.03-1.08x at 6144^2 x 1024 (12 vs 9); 0.93-0.94x at 4096^2 x 1024 and 2048 x 8192 x 1024
    # (6 vs 4), 0.96x at 4096^2 x 512. K = 1536 to 3072: 1.10x at 8192^2 x 1536, 1.06x at
    # 8192^2 x 2048, 1.15x at 16384 x 8192 x 2048, 1.08x at 6144^2 x 2048, 1.04x at
    # 4096 x 14336 x 2048, 1.05x at 8192^2 x 3072; 1.01x at 4096 x 8192 x 2048 and 0.98x at
    # 8192 x 4096 x 2048 (11 vs 8 waves: predicted 1.047, below the 5% margin asked above
    # K = 1024), 0.91x at 4096^2 x 2048; 0.88x at 4096^3, 0.97-0.99x at 8192^3. Above K = 1024
    # a ragged last tile column may waste 1/64 of N, not 1/32: N = 4096 (22 columns, the last a
    # third full) lost at 8192 x 4096 x 2048 (0.98x), 6144 x 4096 x 2048 (0.94x) and
    # 6144 x 4096 x 3072 (1.00x); N = 4352 / 14336 (1/68, 1/224) won 1.14x / 1.09x at K = 2048.
    # Against stream-K tails cut into many pieces (K = 2048 to 4096): 1.32x at 2048 x 4352 x 4096,
    # 1.35x at 3072^2 x 2048, 1.17x at 3072^2 x 4096, 1.12x at 4096 x 13824 x 3072 and
    # 8192 x 16384 x 3072, 1.07x at 4096 x 4352 x 4096, 1.04-1.07x at 6144 x 5120 x 4096,
    # 5120 x 3072 x 4096, 4096 x 13824 x 4096; two waves at K = 1536 / 2048 (previously
    # data-parallel): 1.00-1.06x (benchmarks/NOTES.md).
    def pingpong_pays():
        _, clusters, cluster_tiles, stream_k_tail = clusters_and_tail(tile_m, tile_n, False)
        waves = -(-cluster_tiles // clusters)
        if stream_k_tail:
            waves = min(waves, cluster_tiles // clusters
                        + stream_k_tail_waves(cluster_tiles % clusters / clusters, k))
        coop_cost = waves * tile_m * tile_n / {**SMALL_M_TILE_EFFICIENCY, **efficiency}[tile_m, tile_n]
        pp_cost = -(-tiles(128, 192) // sm_count) * 128 * 192
        return coop_cost * (1 + _pingpong_charge(k)) > pp_cost * (1.0 if k <= 1024 else 1.05)

    pingpong = (itemsize == 2 and m > 128 and k <= PINGPONG_MAX_K
                and tiles(128, 192) >= (4 if k <= 1024 else 2 if k < 2048 else 1) * sm_count
                and (-n % 192) * (32 if k <= 1024 else 64) <= n and pingpong_pays())
    if pingpong:
        tile_m, tile_n = 128, 192
    cluster_m, clusters, cluster_tiles, stream_k = clusters_and_tail(tile_m, tile_n, pingpong)
    # fp8 folds the MMA accumulator into the fp32 one after every k-tile (128 values of K, as
    # cuBLAS does); at 128 x 256 after each column half of every k-tile (so without the
    # cluster, and without promotion: 1315 vs 1206 at 8192^3; 1295 vs 1317 at 4096^3).
    split = exact_fp8 and tile_n == 256
    promote = 1 if exact_fp8 else 0
    # fp8 exact: the next tile's first k-tile under each epilogue, where every CTA has at least
    # two tiles (measured +0.6-0.7% at 4096^3, +0.4-1.7% at 8192^3; -4% with one tile per CTA).
    epilogue_mma = exact_fp8 and not stream_k and cluster_tiles >= 2 * clusters
    return GemmConfig(tile_m, tile_n, cluster_m, 1, swizzle=8, max_clusters=clusters, k_blocks=k_blocks,
                      epilogue=epilogue, fp8_promote_every=promote, fp8_split_n=split,
                      pingpong=pingpong, stream_k=stream_k, epilogue_mma=epilogue_mma,
                      epi_stages=(PINGPONG_EPI_STAGES if pingpong else WIDE_EPI_STAGES
                                  if (tile_m, tile_n) == WIDE_TILE else GemmConfig.epi_stages))
