"""Static persistent tile schedule for the GEMM kernels.

Cluster ``c`` of ``C`` launched clusters works on cluster tiles ``c, c + C, c + 2C, ...``. A
cluster tile covers ``cluster_m x cluster_n`` output tiles, one per CTA. Within a batch the
cluster tiles are walked in groups of ``group`` cluster columns (N): inside a group the column
index moves fastest, so the clusters running at the same time share a band of A rows and a
band of B columns, and both stay in L2. The last group is simply narrower, so no launched work
ever falls outside the problem (a schedule that rounds the column count up to the group size
would compute whole tiles of nothing).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


def cluster_tile_counts(m, n, batch, tile_mn, cluster_mn):
    """(cluster tiles along M, along N, in total) for an M x N x batch output."""
    cm_tiles = (m + tile_mn[0] * cluster_mn[0] - 1) // (tile_mn[0] * cluster_mn[0])
    cn_tiles = (n + tile_mn[1] * cluster_mn[1] - 1) // (tile_mn[1] * cluster_mn[1])
    return cm_tiles, cn_tiles, cm_tiles * cn_tiles * batch


@cute.jit
def tile_coords(t: Int32, cm_tiles: Int32, cn_tiles: Int32, group: cutlass.Constexpr,
                cluster_mn: cutlass.Constexpr, rank_m: Int32, rank_n: Int32):
    """(m, n, l) output-tile coordinates of this CTA in cluster tile ``t``."""
    per_batch = cm_tiles * cn_tiles
    l = t // per_batch
    r = t - l * per_batch
    span = cm_tiles * group
    g = r // span
    within = r - g * span
    first_n = g * group
    width = cutlass.min(cn_tiles - first_n, group)
    mc = within // width
    nc = first_n + within - mc * width
    return mc * cluster_mn[0] + rank_m, nc * cluster_mn[1] + rank_n, l


# Stream-K tail: when the cluster tiles do not fill the last wave, the ``total % clusters`` tiles
# of that wave are cut along K into one equal run of k-tiles per cluster, so every cluster ends
# at the same time. A run is shorter than a tile: it covers the end of one tile (from k-tile x)
# and / or the start of the next (up to k-tile y), and every run with both has x - y = k_tiles -
# run length. Each cluster works on its start piece first, then on its end piece: so at any time
# the clusters read the same k-slices (k in the first phase, k + x - y in the second), as the
# data-parallel waves do, and L2 serves the tiles that share operand rows. The piece that ends a
# tile owns it: it waits for the tile's other pieces (finished earlier or at the same time), adds
# their partial sums from the workspace and runs the epilogue; every other piece stores its
# partial sum and raises its flag. A cluster has at most one such piece, so one workspace slot.
# Waits point only at earlier clusters, which raise their flags before they wait themselves, so
# a grid larger than what runs at once still finishes (later clusters start as earlier ones end).


@cute.jit
def sk_run(cluster: Int32, clusters: Int32, units: Int32):
    """(first unit, end unit) of ``cluster``'s share of ``units`` k-tiles (equal to within one)."""
    base = units // clusters
    rem = units - base * clusters
    first = cluster * base + cutlass.min(cluster, rem)
    end = first + base
    if cluster < rem:
        end = end + 1
    return first, end


def whole_tiles(cluster, clusters, total, stream_k: bool):
    """Number of whole cluster tiles ``cluster`` runs (``cluster, cluster + clusters, ...``): all
    of its tiles, or with ``stream_k`` those of the full waves (host or device integers)."""
    if stream_k:
        return total // clusters
    return (total - cluster + clusters - 1) // clusters


@cute.jit
def tail_piece(i: Int32, cluster: Int32, clusters: Int32, total: Int32, k_tiles: Int32):
    """(cluster tile, first k-tile, end k-tile) of ``cluster``'s stream-K piece ``i``: 0 the
    start of a tile, 1 the end of the previous one (a run inside one tile is piece 0; an empty
    piece has end <= first)."""
    whole = total - total % clusters
    first, end = sk_run(cluster, clusters, (total - whole) * k_tiles)
    j = first // k_tiles
    start_piece = end > (j + 1) * k_tiles  # the run reaches into tile j + 1
    t, k_first, k_end = whole + j, first - j * k_tiles, cutlass.min(k_tiles, end - j * k_tiles)
    if i == 0:
        if start_piece:
            t, k_first, k_end = whole + j + 1, Int32(0), end - (j + 1) * k_tiles
    elif not start_piece:
        k_end = k_first
    return t, k_first, k_end
