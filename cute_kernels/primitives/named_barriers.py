"""Hardware named barriers (``bar.sync`` / ``bar.arrive`` ids) by name, one enum per kernel
family, so that two roles of one kernel never share an id by accident.

Id 0 is ``__syncthreads`` (``cute.arch.barrier()`` with no id); ids 1-15 are free for a kernel
to use. A barrier counts ``number_of_threads`` arrivals (a multiple of 32) before it releases.
"""

from __future__ import annotations

import enum

MAX_BARRIER_ID = 15


class GemmBarrier(enum.IntEnum):
    """The dense GEMM's (``gemm/kernel_sm90.py``) barriers."""

    # Epilogue of MMA warpgroup 0 (128 threads): its sub-tile written to shared memory before
    # its store warp issues the TMA store, and the buffer free again. Warpgroup w uses
    # ``EPILOGUE + w``.
    EPILOGUE = 1
    # Ping-pong (256 threads): warpgroup 0 has issued its mainloop's last MMAs, warpgroup 1 may
    # start its own (``MAINLOOP_DONE + 0``), and the other way round (``MAINLOOP_DONE + 1``).
    MAINLOOP_DONE = 3
    # Stream-K (every MMA thread): the partial sum is in the workspace before its flag is set,
    # and the flag seen before the partial is read.
    STREAM_K = 5
    # W4A16 with two or three MMA warpgroups splitting one tile's K (all their threads): the
    # others' partial sums are in shared memory (``SPLIT_K_PARTIAL``), warpgroup 0 has read
    # them (``SPLIT_K_READ``).
    SPLIT_K_PARTIAL = 6
    SPLIT_K_READ = 7



class AttentionBarrier(enum.IntEnum):
    """The attention forward's (``attention/fwd_sm90.py``) barriers."""

    # Every MMA thread: the O tile is in shared memory before one warp stores it.
    EPILOGUE = 1
    # Ping-pong (256 threads: the waiting warpgroup and the one handing over): MMA warpgroup w
    # may issue its next GEMMs once ``MMA_TURN + w`` completes; w's predecessor arrives on it
    # after issuing its own. Ids MMA_TURN .. MMA_TURN + 2.
    MMA_TURN = 2


class AttentionBwdBarrier(enum.IntEnum):
    """The attention backward's (``attention/bwd_sm90.py``) barriers."""

    # MMA warpgroup w's fp32 dQ tile is free again (the reduce warp has read it): 160 threads,
    # the warpgroup waits, the reduce warp arrives. Ids DQ_EMPTY + w.
    DQ_EMPTY = 1
    # Warpgroup w's dQ tile is written: 160 threads, the reduce warp waits, the warpgroup
    # arrives. Ids DQ_FULL + w.
    DQ_FULL = 3
    # Both warpgroups' dS^T is in shared memory for the dQ GEMMs: 256 threads.
    DS_READY = 5
    # Head dims above 128 (``attention/bwd_wide_sm90.py``): warpgroup w's own P and dS are in
    # shared memory for its dV and dK GEMMs: its 128 threads. Ids OWN_SCORES_READY + w.
    OWN_SCORES_READY = 6
    # Head dims above 128 with one P / dS buffer: both warpgroups' GEMMs of the previous step
    # are done, the buffer may be written again: 256 threads.
    SCORES_FREE = 8
    # A split group's dK and dV fragments are in shared memory (``stage_kv_sums``): 288
    # threads, the reduce warp waits, the MMA warpgroups arrive.
    KV_STAGED = 9
