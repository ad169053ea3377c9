"""Attention forward configurations and the heuristic that picks one.

Pure functions of (head dim, mask kind, options, the longest key sequence): no tensor data is
read, nothing is allocated
or synchronized. Sequence lengths and batch sizes are run-time values of the compiled kernel, so
a new length never recompiles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

HEAD_DIMS = (64, 96, 128, 192, 256)
# Other head dims (multiples of HEAD_DIM_ALIGN up to 256, q / k and v each) run zero-padded to
# the next of HEAD_DIMS (``op._padded``).
HEAD_DIM_ALIGN = 8


@dataclass(frozen=True)
class AttentionFwdConfig:
    head_dim: int  # q's and k's (and v's) head dim
    tile_m: int  # query rows per CTA: 64 per MMA warpgroup
    tile_n: int  # key rows per K / V stage, a multiple of 16
    stages: int = 2  # K and V pipeline depth
    # Mask: with ``local`` the kernel masks keys outside [i + Sk - Sq - left, i + Sk - Sq + right]
    # (left / right are run-time values; causal is right = 0 and an unbounded left).
    local: bool = False
    softcap: bool = False  # scores -> softcap * tanh(scores / softcap)
    varlen: bool = False  # packed sequences with cu_seqlens (O stored with masked 16-byte stores)
    # One CTA per SM walks tiles; O gets its own shared buffer, so the next tile's Q and first
    # K / V blocks load while the MMA warpgroups finish a tile (needs the shared memory for it).
    persistent: bool = False

    @property
    def mma_warpgroups(self) -> int:
        return self.tile_m // 64

    @property
    def threads(self) -> int:
        return 128 * (self.mma_warpgroups + 1)

    @property
    def smem_bytes(self) -> int:
        """Q, K and V stages, and O's buffer when persistent (16-bit values)."""
        tiles = self.tile_m * (2 if self.persistent else 1) + 2 * self.stages * self.tile_n
        return 2 * self.head_dim * tiles


SMEM_BYTES = 227 * 1024  # what one CTA may use on sm_90 (232448 bytes, less the barriers)
# Persistent CTAs (where O's own buffer fits) up to this many keys, without / with a mask.
# Measured on H100 (bf16, 16 heads, 16k tokens): without a mask they hide each tile's fixed
# costs (first Q and K loads, epilogue) and run 7-11% faster at 1024-4096 keys; past that, at
# head dim 128 a 128 x 176 tile (no room for O's buffer) wins by 3-4%. With a causal mask the
# tiles' costs differ, and a static round-robin over them balances worse than the hardware's
# CTA scheduler once the sequence has more than a few tiles (6% slower at 2048 keys).
PERSISTENT_MAX_KEYS = {False: 4096, True: 1024}
# With a mask and fixed lengths the persistent CTAs take a pair's query tiles in long / short
# pairs (``schedule.paired_rank``), which balances them: measured on H100 (bf16, 16 heads, 16k
# tokens, causal, same runs) at head dim 128 +11% at 1024 keys over the static stride, +12% /
# +5% / +0-3% over one CTA per tile at 2048 / 4096 / 8192, 0 to -6% at 16384; head dim 96
# +9% / +3% at 2048 / 4096; head dim 64 (192-row tiles) -3% / -7% at 2048 / 4096.
# Persistent up to this many keys there:
PAIRED_MAX_KEYS = {96: 4096, 128: 8192}
PERSISTENT_ANY_KEYS = (64, 96)  # unmasked head dims whose alternative is the same tile

# (tile_m, tile_n) per head dim. Three MMA warpgroups (192 query rows) for head dim 64, so each
# K / V stage feeds more MMA work; two elsewhere (three at head dim 96 spill: 160 registers
# each). The key tile shrinks as the head grows so that Q, two K and two V stages fit the 227 KB
# of shared memory and the S, P and O fragments fit the 240 registers of an MMA warpgroup.
TILES = {64: (192, 128), 96: (128, 128), 128: (128, 128), 192: (128, 112), 256: (128, 80)}


# With a mask, one CTA per tile at head dim 128 (past the paired range): 128 x 176 tiles where
# a row sees at least this many keys (measured on H100, bf16, 16 heads, S = 16384, against 128 x
# 128 with a third K / V stage: causal +14-16%, softcap causal +10-15%, a symmetric window of
# 2048 +2-9%; but a window of 1024 -7%, of 256 -17%, where the edge blocks' masked keys weigh
# more; varlen causal with sequences of 3000-5000 -2%).
WIDE_TILE_MIN_KEYS = 4096


@functools.lru_cache(maxsize=4096)
def attention_fwd_config(head_dim: int, *, local: bool, softcap: bool, varlen: bool,
                         max_seqlen_k: int = 0, window_keys: int | None = None) -> AttentionFwdConfig:
    """The forward's configuration; ``window_keys``: with a mask, at most how many keys one
    query row sees (None: as many as there are)."""
    tile_m, tile_n = TILES[head_dim]
    fits = AttentionFwdConfig(head_dim, tile_m, tile_n, persistent=True).smem_bytes <= SMEM_BYTES
    limit = PERSISTENT_MAX_KEYS[local]
    if local and not varlen:
        limit = PAIRED_MAX_KEYS.get(head_dim, limit)
    short = max_seqlen_k <= limit or (not local and head_dim in PERSISTENT_ANY_KEYS)
    if fits and short:
        return AttentionFwdConfig(head_dim, tile_m, tile_n, local=local, softcap=softcap,
                                  varlen=varlen, persistent=True)
    stages = 2
    if head_dim == 128:
        # Measured on H100 (16k tokens, 16 heads, bf16): without a mask 128 x 176 tiles run
        # 3-4% faster than 128 x 128 at S >= 4096 (fewer barriers and waits per FLOP); with a
        # mask, see WIDE_TILE_MIN_KEYS (else a third K / V stage, 224 KB).
        wide = not varlen and (window_keys is None or window_keys >= WIDE_TILE_MIN_KEYS)
        if local and not wide:
            stages = 3
        else:
            tile_n = 176
    return AttentionFwdConfig(head_dim, tile_m, tile_n, stages=stages, local=local,
                              softcap=softcap, varlen=varlen)


def all_fwd_configs() -> list[AttentionFwdConfig]:
    """Every configuration :func:`attention_fwd_config` can return."""
    limits = sorted({*PERSISTENT_MAX_KEYS.values(), *PAIRED_MAX_KEYS.values()})
    key_counts = [1] + [n + d for n in limits for d in (0, 1)]
    found = {
        attention_fwd_config(d, local=local, softcap=softcap, varlen=varlen, max_seqlen_k=keys,
                             window_keys=window)
        for d in HEAD_DIMS for local in (False, True) for softcap in (False, True)
        for varlen in (False, True) for keys in key_counts for window in (None, 1)
    }
    return sorted(found, key=lambda c: (c.head_dim, c.persistent, c.local, c.softcap, c.varlen))


@dataclass(frozen=True)
class AttentionBwdConfig:
    head_dim: int
    tile_m: int = 64  # query rows per step (128: head dim 64 only)
    tile_n: int = 128  # key rows per CTA: 64 per MMA warpgroup (past head dim 128: tile_n / 2)
    stages: int = 2  # Q's pipeline depth (dO's too where do_stages is 0)
    local: bool = False
    softcap: bool = False
    varlen: bool = False
    deterministic: bool = False  # dQ summed in a fixed key-block order (semaphores)
    # > 0: dO (and D) through their own pipeline of this depth (Q's: ``stages``), released as
    # soon as dV's GEMM is done; 0: with Q in one pipeline stage
    do_stages: int = 0
    # one CTA per SM taking key blocks in turn (the next block's K and V load under the last
    # one's dK / dV store) instead of one CTA per key block
    persistent: bool = False


# The backward runs every forward head dim, softcap included (softcap turns the scores into
# their tanh in place and folds the tanh's derivative into dP - D before P is formed: no more
# registers than without it). Past 128 the two MMA warpgroups split the keys and compute dK,
# dV transposed (``bwd_wide_sm90.py``).
BWD_WIDE_HEAD_DIMS = (192, 256)


@functools.lru_cache(maxsize=256)
def attention_bwd_config(head_dim: int, *, local: bool, softcap: bool, varlen: bool,
                         deterministic: bool = False) -> AttentionBwdConfig:
    tile_m, tile_n, stages, do_stages = 64, 128, 2, 0
    if head_dim == 64 and not softcap:
        # 128 queries per step: half the steps (barriers, pipeline waits, LSE / D reads) per
        # FLOP; the fragments fit the registers only at this head dim, without softcap's
        # extra pass over the scores
        tile_m = 128
    if head_dim in BWD_WIDE_HEAD_DIMS:
        # bwd_wide_sm90.py, measured on H100 (bf16, S = 4096, full / causal TFLOP/s): one dO
        # stage beside dQ's fp32 tiles; at 192 96-key blocks and two Q stages (448 / 390;
        # one Q stage 427 / 403, 64 keys 342 / 311); at 256 64-key blocks and one Q stage
        # (385 / 358; 80 keys with two Q stages, no room for dQ's tiles, dQ atomics from
        # registers: 314 / 290)
        tile_n, stages, do_stages = (96, 2, 1) if head_dim == 192 else (64, 1, 1)
    # Persistent CTAs where every key block's walk is as long (no mask: a static round of key
    # blocks per CTA stays balanced), the adds need no order among CTAs (not deterministic)
    # and the blocks are whole (not varlen)
    persistent = (head_dim not in BWD_WIDE_HEAD_DIMS and not local and not varlen
                  and not deterministic)
    return AttentionBwdConfig(head_dim, tile_m=tile_m, tile_n=tile_n, stages=stages, local=local,
                              softcap=softcap, varlen=varlen, deterministic=deterministic,
                              do_stages=do_stages, persistent=persistent)


# With a causal mask, the CTAs of one kv head's key blocks walk different numbers of query
# blocks, so those that walk a whole large group of query heads drift apart: they no longer
# read the same Q and dO rows (nor add into the same dQ rows) at about the same time, and the L2
# stops sharing them. Groups of more than BWD_SPLIT_ABOVE query heads per kv head are then
# split over several CTAs (runs of BWD_RUN_HEADS heads), which add their dK and dV into fp32
# accumulators. Measured on H100 (bf16, causal, backward through autograd, TFLOP/s split /
# whole group): head dim 128, 2 x 4096 x 64 / 8 heads 555 / 440, 1 x 16384 x 64 / 8 588 / 551,
# 4 x 4096 x 28 / 4 515 / 439; head dim 96, 4 x 4096 x 24 / 3 486 / 346; runs of 4 heads
# in between (521, 557, 506, 486). Groups of 4 lose by splitting (8 x 2048 x 32 / 8: 409 / 435),
# and head dim 64 (128 queries per step) does not gain (4 x 4096 x 32 / 4: 433 / 449).
BWD_SPLIT_ABOVE = 4
BWD_RUN_HEADS = 2
BWD_SPLIT_HEAD_DIMS = (96, 128)


def kv_splits_supported(config: AttentionBwdConfig) -> bool:
    """Whether the backward kernel of ``config`` can split a kv head's group over CTAs: with a
    mask, at the head dims where it pays (``bwd_kv_splits``); deterministic too (the runs of
    a key block then add in run order)."""
    return config.local and config.head_dim in BWD_SPLIT_HEAD_DIMS


def bwd_kv_splits(config: AttentionBwdConfig, group: int, uneven_walks: bool) -> int:
    """CTAs per kv head's key block for a group of ``group`` query heads per kv head;
    ``uneven_walks``: the mask gives the key blocks walks of different lengths (a window at
    least as wide as the query sequence, as a causal mask's: a narrower sliding window gives
    every key block inside the sequence the same walk)."""
    if not (kv_splits_supported(config) and uneven_walks) or group <= BWD_SPLIT_ABOVE:
        return 1
    return -(-group // BWD_RUN_HEADS)


def all_bwd_configs() -> list[AttentionBwdConfig]:
    """Every backward configuration the op can launch."""
    return [attention_bwd_config(d, local=local, softcap=softcap, varlen=varlen, deterministic=det)
            for d in HEAD_DIMS for local in (False, True) for softcap in (False, True)
            for varlen in (False, True) for det in (False, True)]
