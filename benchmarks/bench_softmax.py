"""Softmax forward and backward: GB/s (bytes read + written) for ours and the peers.

    python benchmarks/bench_softmax.py            # acceptance shapes + the N sweep for the plot
    python benchmarks/bench_softmax.py --quick    # acceptance shapes only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results, bench_many, ceilings, gbps, make_input_sets, try_import  # noqa: E402

import cute_kernels as ck  # noqa: E402
from cute_kernels.rowwise.softmax_op import _backward  # noqa: E402

ACCEPTANCE = [(32768, 4096), (16384, 16384), (4096, 131072)]
SWEEP_ELEMENTS = 1 << 27  # M * N for the sweep
SWEEP_N = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144]


def torch_bwd(y, dy):
    return torch._softmax_backward_data(dy, y, -1, y.dtype)


def compiled_peers():
    fwd = torch.compile(lambda x: torch.softmax(x.float(), -1).to(x.dtype))

    def bwd_math(y, dy):
        yf, dyf = y.float(), dy.float()
        return (yf * (dyf - (dyf * yf).sum(-1, keepdim=True))).to(y.dtype)

    return fwd, torch.compile(bwd_math)


def run_shape(results, m, n, dtype, peers_fwd, peers_bwd):
    size = torch.tensor([], dtype=dtype).element_size()
    fwd_sets = make_input_sets(lambda: (torch.randn(m, n, device="cuda", dtype=dtype),), m * n * size)
    ms = bench_many({"ours": ck.softmax, **peers_fwd}, fwd_sets)
    rates = {k: gbps(2 * m * n * size, v) for k, v in ms.items()}
    results.add("softmax", "softmax_fwd", (m, n), dtype, "GBps", rates.pop("ours"), rates)
    del fwd_sets

    def make_bwd():
        y = torch.softmax(torch.randn(m, n, device="cuda", dtype=dtype), -1)
        return y, torch.randn_like(y)

    bwd_sets = make_input_sets(make_bwd, 2 * m * n * size)
    ms = bench_many({"ours": lambda y, dy: _backward(y, dy, 1, dtype), **peers_bwd}, bwd_sets)
    rates = {k: gbps(3 * m * n * size, v) for k, v in ms.items()}
    results.add("softmax", "softmax_bwd", (m, n), dtype, "GBps", rates.pop("ours"), rates)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    results = Results()
    results.start(ceilings())
    print("ceilings", results.data["ceilings"])
    # Compile ours before any peer is imported (some peers patch the DSL on import).
    for m, n in ACCEPTANCE + [(SWEEP_ELEMENTS // n, n) for n in SWEEP_N]:
        x = torch.randn(2, n, device="cuda", dtype=torch.bfloat16)
        ck.softmax(x)
        _backward(x, x, 1, x.dtype)
    cfwd, cbwd = compiled_peers()
    peers_fwd = {"torch": lambda x: torch.softmax(x, -1), "torch_compile": cfwd}
    peers_bwd = {"torch": torch_bwd, "torch_compile": cbwd}
    quack_softmax = try_import("quack.softmax")
    if quack_softmax is not None:
        peers_fwd["quack"] = quack_softmax.softmax_fwd
        peers_bwd["quack"] = lambda y, dy: quack_softmax.softmax_bwd(dy, y)
    dtype = torch.bfloat16
    for m, n in ACCEPTANCE:
        run_shape(results, m, n, dtype, peers_fwd, peers_bwd)
    if not args.quick:
        for n in SWEEP_N:
            if (SWEEP_ELEMENTS // n, n) not in ACCEPTANCE:
                run_shape(results, SWEEP_ELEMENTS // n, n, dtype, peers_fwd, peers_bwd)
    results.save()


if __name__ == "__main__":
    main()
