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
