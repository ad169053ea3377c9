"""``tuned=True``: time a small set of GEMM configurations on the caller's operands, keep the
fastest, and remember the choice on disk.

The choice is stored in ``<cache dir>/<source fingerprint>/gemm_tuning.json`` (the compile
cache's folder, so a change to the kernels starts over), keyed by the architecture, dtypes,
operand majors, problem size and epilogue. Tuning a new key costs a few compilations (seconds,
each cached afterwards) and about ten timed launches per candidate; later calls, in this or any
process, read the stored choice.
"""

from __future__ import annotations

import dataclasses
import json
import threading

import torch

from ..runtime.compile import _file_lock, cache_dir, disk_cache_enabled, source_fingerprint
from .config import PINGPONG_EPI_STAGES, GemmConfig

_lock = threading.Lock()
_memory: dict = {}


def candidates(base: GemmConfig, m: int, sms: int, fp8: bool = False) -> list[GemmConfig]:
    """The heuristic's choice first, then the other tile / cluster / schedule shapes worth
    timing (ping-pong tiles are per warpgroup: 128 x 192 keeps 192 fp32 accumulators, fp8's
    128 x 96 two accumulators of 96; fp8's 128 x 256 folds per column half, its 128 x 192 keeps
    two accumulators of 96 per warpgroup; every fp8 tile folds per k-tile; a stream-K tail only
    with the heuristic's tile and cluster, whose last wave it was chosen for). fp8 without
    promotion (fast accumulation) takes no ping-pong: 192 accumulators spill with its layouts."""
    promote = base.fp8_promote_every > 0
    if m <= 64:
        shapes = [(64, 128, False)]
    elif m <= 128:
        shapes = [(64, 128, False), (128, 128, False)]
    elif promote:
        shapes = [(128, 256, False), (128, 192, False), (128, 128, False), (128, 96, True)]
    elif fp8:
        shapes = [(128, 256, False), (128, 128, False)]
    else:
        shapes = [(128, 256, False), (128, 128, False), (128, 192, True)]
    found = [base]
    for tile_m, tile_n, pingpong in shapes:
        split = promote and tile_n == 256  # fp8 128 x 256 only with the column-split promotion
        for cluster_m in (1, 2):
            cfg = dataclasses.replace(base, tile_m=tile_m, tile_n=tile_n, cluster_m=cluster_m,
                                      max_clusters=max(1, sms // cluster_m), pingpong=pingpong,
                                      stream_k=base.stream_k and (tile_m, tile_n, cluster_m)
                                      == (base.tile_m, base.tile_n, base.cluster_m),
                                      fp8_split_n=split,
                                      fp8_promote_every=int(promote),
                                      epilogue_mma=base.epilogue_mma and not pingpong,
                                      epi_stages=PINGPONG_EPI_STAGES if pingpong and not promote
                                      else GemmConfig.epi_stages)
            if cfg not in found:
                found.append(cfg)
    return found


def _path():
    return cache_dir() / source_fingerprint() / "gemm_tuning.json"


def _load() -> dict:
    if not _memory and disk_cache_enabled():
        try:
            _memory.update(json.loads(_path().read_text()))
        except (OSError, ValueError):
            pass
    return _memory


def _store(key: str, config: GemmConfig) -> None:
    _memory[key] = dataclasses.asdict(config)
    if not disk_cache_enabled():
        return
    path = _path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(path.with_suffix(".lock")):
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError):
            stored = {}
        stored[key] = _memory[key]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(stored, indent=1, sort_keys=True))
        tmp.replace(path)


def _from_dict(entry: dict, base: GemmConfig) -> GemmConfig:
    fields = {**entry, "epilogue": base.epilogue}
    return GemmConfig(**fields)


def tuned_config(key: str, base: GemmConfig, m: int, sms: int, fp8: bool, build, run) -> GemmConfig:
    """The stored choice for ``key``, or the fastest of ``candidates`` (timed with ``run(build(cfg))``)."""
    with _lock:
        entry = _load().get(key)
        if entry is not None:
            return _from_dict(entry, base)
        best, best_ms = base, float("inf")
        for cfg in candidates(base, m, sms, fp8):
            fn = build(cfg)
            for _ in range(2):
                run(fn)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                run(fn)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end) / 10
            if ms < best_ms:
                best, best_ms = cfg, ms
        _store(key, best)
        return best
