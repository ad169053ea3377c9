"""The order in which the attention kernels' CTAs take their tiles (device code, no torch).

With a causal mask the tiles of one (head, sequence) pair differ in length: the forward's last
query tiles see the most key blocks, the backward's first key blocks walk the most query
blocks. Taken pair by pair, the last pairs' longest tiles would start last and run alone at
the end. ``grouped_rank`` orders a grid of ``ranks`` tiles per pair in groups of ``group``
pairs (as many as share the L2, chosen by the launcher): the groups in turn, within a group
rank by rank (longest first) over its pairs.

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
