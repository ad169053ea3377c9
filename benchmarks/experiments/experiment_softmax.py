"""Softmax config variants against quack, kernel against kernel (outputs preallocated),
interleaved rounds. Prints GB/s per variant; the winner goes into ``norms/config.py``.

    python benchmarks/experiments/experiment_softmax.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import bench_many, gbps, make_input_sets, try_import  # noqa: E402

from cute_kernels.rowwise.config import row_config  # noqa: E402
from cute_kernels.rowwise.softmax import SoftmaxBwdSm90, SoftmaxFwdSm90  # noqa: E402
from cute_kernels.rowwise.dispatch import row_specs  # noqa: E402
from cute_kernels.runtime import get_kernel  # noqa: E402

SHAPES = [(32768, 4096), (16384, 16384), (4096, 131072), (131072, 1024), (65536, 2048)]


def variants(n, held):
    base = row_config(n, 8, 2, tensors_held=held)
    out = {"direct": base, "staged": dataclasses.replace(base, stage_smem=True)}
    if base.num_threads == 128 and base.rows_per_cta > 1 or base.threads_per_row < 128:
        out["direct_256t"] = dataclasses.replace(base, num_threads=256)
        out["staged_256t"] = dataclasses.replace(base, num_threads=256, stage_smem=True)
    if base.cluster_n > 1:
        for c in (base.cluster_n // 2, base.cluster_n * 2):
            if 1 < c <= 16 and dataclasses.replace(base, cluster_n=c).elems_per_thread <= 128 // held:
                out[f"cluster{c}"] = dataclasses.replace(base, cluster_n=c)
    return out


def main():
    global SHAPES
    if len(sys.argv) > 1:
        SHAPES = [tuple(int(d) for d in arg.split("x")) for arg in sys.argv[1:]]
    fwd_fns, bwd_fns = {}, {}
    for m, n in SHAPES:
        x = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        for name, cfg in variants(n, 1).items():
            fwd_fns[(n, name)] = get_kernel(SoftmaxFwdSm90, cfg, row_specs([x.dtype] * 2, n, 8))
        for name, cfg in variants(n, 2).items():
            bwd_fns[(n, name)] = get_kernel(SoftmaxBwdSm90, cfg, row_specs([x.dtype] * 3, n, 8))
    quack = try_import("quack.softmax")
    for m, n in SHAPES:
        nbytes = m * n * 2
        sets = make_input_sets(
            lambda: (torch.randn(m, n, device="cuda", dtype=torch.bfloat16),
                     torch.empty(m, n, device="cuda", dtype=torch.bfloat16)), 2 * nbytes)
        cands = {name: fn for (nn, name), fn in fwd_fns.items() if nn == n}
        if quack:
            cands["quack"] = lambda x, y: quack._softmax_fwd(x, y)
        ms = bench_many(cands, sets, rounds=5)
        print(f"fwd {m}x{n}: " + "  ".join(f"{k} {gbps(2 * nbytes, v):.0f}" for k, v in ms.items()))
        del sets
        sets = make_input_sets(
            lambda: (torch.softmax(torch.randn(m, n, device="cuda", dtype=torch.bfloat16), -1),
                     torch.randn(m, n, device="cuda", dtype=torch.bfloat16),
                     torch.empty(m, n, device="cuda", dtype=torch.bfloat16)), 3 * nbytes)
        cands = {name: fn for (nn, name), fn in bwd_fns.items() if nn == n}
        if quack:
            cands["quack"] = lambda y, dy, dx: quack._softmax_backward(dy, y, dx)
        ms = bench_many(cands, sets, rounds=5)
        print(f"bwd {m}x{n}: " + "  ".join(f"{k} {gbps(3 * nbytes, v):.0f}" for k, v in ms.items()))
        del sets


if __name__ == "__main__":
    main()
