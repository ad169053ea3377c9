"""The order in which the attention kernels' CTAs take their tiles (device code, no torch).

With a causal mask the tiles of one (head, sequence) pair differ in length: the forward's last
query tiles see the most key blocks, the backward's first key blocks walk the most query
blocks. Taken pair by pair, the last pairs' longest tiles would start last and run alone at
the end. ``grouped_rank`` orders a grid of ``ranks`` tiles per pair in groups of ``group``
pairs (as many as share the L2, chosen by the launcher): the groups in turn, within a group
rank by rank (longest first) over its pairs.

Persistent CTAs take the tiles by a static stride of the grid (CTA c: slots c, c + ctas, ...),
which would hand tiles of one length to the same CTAs (the grid's period against the groups'
sorted runs): ``paired_rank`` hands out a pair's j-th longest and j-th shortest tile in two
consecutive rounds of the grid instead, so every CTA's two tiles together cost the same (their
ranks sum to ``ranks`` - 1, and a tile's cost falls with its rank by a constant step).

Constraints:
  - ``group`` >= 1 (any value: the last group takes the pairs left); grid indices in 32 bits
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


@cute.jit
def grouped_rank(linear, ranks, heads, batches, group):
    """(rank, head, batch) of linear tile index ``linear`` in a grid of ``ranks`` tiles for each
    of ``heads * batches`` pairs, ordered in groups of ``group`` pairs (module docstring); the
    last group may hold fewer pairs."""
    pairs = heads * batches
    per_group = group * ranks
    g = linear // per_group
    in_group = linear - g * per_group
    group_pairs = cutlass.min(group, pairs - g * group)
    rank = in_group // group_pairs
    pair = g * group + in_group - rank * group_pairs
    batch = pair // heads
    return rank, pair - batch * heads, batch


@cute.jit
def paired_slots(ctas, ranks, pairs):
    """Slots the persistent CTAs walk for ``paired_rank``: two rounds of the grid per round of
    tile pairs (a pair's odd middle tile alone), the slots past the last pair empty."""
    return 2 * ctas * cute.ceil_div((ranks + 1) // 2 * pairs, ctas)


@cute.jit
def paired_rank(slot, ctas, ranks, heads, batches, group):
    """(rank, head, batch) of slot ``slot`` of a persistent grid of ``ctas`` CTAs (module
    docstring): round r of the grid takes tile pairs (r // 2) * ctas + c in ``grouped_rank``'s
    order of ``(ranks + 1) // 2`` pairs per (head, batch), the longer tile (rank j) in even
    rounds, its partner (rank ranks - 1 - j) in odd ones; rank = ``ranks`` for an empty slot
    (past the last pair, or the partner of an odd middle tile)."""
    rnd = slot // ctas
    item = rnd // 2 * ctas + slot - rnd * ctas
    half = (ranks + 1) // 2
    j, head, batch = grouped_rank(item, half, heads, batches, group)
    partner = cutlass.select_(j == ranks - 1 - j, ranks, ranks - 1 - j)
    rank = cutlass.select_(rnd % 2 == 1, partner, j)
    empty = item >= half * heads * batches
    rank = cutlass.select_(empty, ranks, rank)
    return rank, cutlass.select_(empty, 0, head), cutlass.select_(empty, 0, batch)
