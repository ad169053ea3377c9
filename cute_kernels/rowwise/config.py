"""Launch shapes for the row-wise kernels (softmax and its relatives).

Pure functions of (row length, vector width, dtypes, direction): they never read tensor data,
synchronize or allocate.

A row of ``n`` elements is split over ``threads_per_row`` consecutive threads and, for long rows,
over the ``cluster_n`` CTAs of a cluster; each thread holds its elements in registers, loaded
and stored ``vec`` elements (up to 16 bytes) at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime.errors import UnsupportedError

CLUSTER_SIZES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class RowConfig:
    n: int  # row length (compile-time)
    vec: int  # elements per vector access
    threads_per_row: int
    num_threads: int  # threads per CTA
    cluster_n: int  # CTAs sharing one row
    stage_smem: bool = False  # load through shared memory with cp.async instead of directly

    # The self-check's short name: "n4096 v8 128/256t c2" (row length, vector width, threads
    # per row / per CTA, cluster), then " smem" when staged.
    label_fields = ("n", "vec", "threads_per_row", "num_threads", "cluster_n", "stage_smem")

    @property
    def label(self) -> str:
        cluster = f" c{self.cluster_n}" if self.cluster_n > 1 else ""
        smem = " smem" if self.stage_smem else ""
        return f"n{self.n} v{self.vec} {self.threads_per_row}/{self.num_threads}t{cluster}{smem}"

    @property
    def rows_per_cta(self) -> int:
        return self.num_threads // self.threads_per_row

    @property
    def vecs_per_thread(self) -> int:
        vectors = self.n // self.vec
        per_step = self.threads_per_row * self.cluster_n
        return -(-vectors // per_step)

    @property
    def elems_per_thread(self) -> int:
        return self.vecs_per_thread * self.vec

    @property
    def cols_per_cta(self) -> int:
        return self.vecs_per_thread * self.vec * self.threads_per_row

    @property
    def even_n(self) -> bool:
        """True when the tile covers the row exactly (no column predicates needed)."""
        return self.cols_per_cta * self.cluster_n == self.n


def row_config(n: int, vec: int, widest_itemsize: int, tensors_held: int = 1,
               wide_clusters: bool = False) -> RowConfig:
    """Choose the launch shape for rows of ``n`` elements.

    ``tensors_held`` is how many row-sized fragments each thread keeps in registers at once
    (1 for softmax forward; 2 for its backward, y and dy; 4 for the norm backward, which also
    keeps the weight and the dw accumulator). ``wide_clusters`` splits rows that would take 8
    CTAs over 16 instead. A thread holds at most 128 / ``tensors_held``
    elements of each. Short rows share a warp between several rows; rows too long for one CTA
    of 256 threads are split over a cluster of up to 16 CTAs, which bounds the row length
    (524288 / ``tensors_held``).
    """
    if n < 1:
        raise UnsupportedError(f"row length must be >= 1, got {n}")
    cap = 128 // tensors_held
    if tensors_held == 1:
        # Measured forward table: warps share short rows, a full CTA takes long ones.
        threads_per_row = 256
        for limit, threads in ((64, 8), (128, 16), (3072, 32), (6144, 64), (16384, 128)):
            if n <= limit:
                threads_per_row = threads
                break
        num_threads = 128 if n <= 16384 else 256
        per_cta = 32768 if widest_itemsize >= 4 else 16384
    else:
        threads_per_row = 8 if n <= 64 else 16 if n <= 128 else 32
        while threads_per_row < 256 and n > threads_per_row * cap:
            threads_per_row *= 2
        # Measured on H100 (benchmarks/NOTES.md): softmax backward runs 0.5% faster with
        # 256-thread CTAs even for short rows.
        num_threads = 256
        per_cta = 256 * cap
    cluster_n = next((c for c in CLUSTER_SIZES if n <= per_cta * c), CLUSTER_SIZES[-1])
    if cluster_n == 8 and wide_clusters:
        # Measured on H100 at N = 131072 (bf16): for softmax, 16 CTAs of 32 elements per thread
        # beat 8 CTAs of 64 by 1.5% forward and 4% backward; for the cross-entropy forward they
        # lose 7% (benchmarks/NOTES.md), so the op asks.
        cluster_n = 16
    config = RowConfig(n, vec, threads_per_row, num_threads, cluster_n)
    if config.elems_per_thread > cap:
        longest = cap * num_threads * CLUSTER_SIZES[-1]
        raise UnsupportedError(
            f"row length {n} is longer than the {longest} elements this kernel supports "
            f"(16 CTAs x {num_threads} threads x {cap} elements)"
        )
    # Forward rows that fit one CTA load a little faster through shared memory (cp.async, which
    # needs 4-byte accesses) while the tile stays <= 32 KB; split rows and the backward load
    # straight into registers.
    tile_bytes = config.rows_per_cta * config.cols_per_cta * widest_itemsize
    if tensors_held == 1 and cluster_n == 1 and vec * widest_itemsize >= 8 and tile_bytes <= 32768:
        config = RowConfig(n, vec, threads_per_row, num_threads, cluster_n, stage_smem=True)
    return config
