"""RMSNorm and LayerNorm forward and backward: GB/s for ours and the peers.

Forward counts x read + y written; backward counts x and dy read + dx written (the weight,
the per-row statistics and dw are small and not counted). The backward is timed as users run
it: ``torch.autograd.grad(y, (x, weight[, bias]), dy)`` through each library's autograd
(weight gradients included). bf16 rows, with a bf16 weight and, for RMSNorm, an fp32 weight
(parameters kept in fp32 by mixed precision).

    python benchmarks/bench_norms.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (Results, autograd_grad, bench_many, ceilings, gbps, make_input_sets,  # noqa: E402
                     try_import)

import cute_kernels as ck  # noqa: E402

# The backward is timed on a kept graph (retain_graph): torch.compile's donated buffers refuse it.
import torch._functorch.config  # noqa: E402
torch._functorch.config.donated_buffer = False

ACCEPTANCE = [(32768, 4096), (16384, 16384), (4096, 131072)]
SWEEP = [(131072, 1024), (65536, 2048), (8192, 16384), (2048, 65536)]


def norms(layer_norm: bool, n: int, quack) -> dict:
    """Forward functions (x, w, b) of each library."""
    if layer_norm:
        found = {"ours": lambda x, w, b: ck.layer_norm(x, w, b),
                 "torch": lambda x, w, b: F.layer_norm(x, (n,), w, b)}
        compiled = torch.compile(lambda x, w, b: F.layer_norm(x, (n,), w, b))
    else:
        found = {"ours": lambda x, w, b: ck.rms_norm(x, w),
                 "torch": lambda x, w, b: F.rms_norm(x, (n,), w, 1e-6)}
        compiled = torch.compile(lambda x, w, b: F.rms_norm(x, (n,), w, 1e-6))
    found["torch_compile"] = compiled
    if quack is not None and not layer_norm:
        found["quack"] = lambda x, w, b: quack.rmsnorm(x, w, eps=1e-6)
    return found


def run_shape(results, m, n, layer_norm, quack, w_dtype=torch.bfloat16):
    dtype, size = torch.bfloat16, 2
    name = "layernorm" if layer_norm else "rmsnorm"
    label = "bfloat16" if w_dtype == dtype else f"bf16, {str(w_dtype).removeprefix('torch.')} w"

    def make():
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        w = torch.randn(n, device="cuda", dtype=w_dtype)
        b = torch.randn(n, device="cuda", dtype=w_dtype) if layer_norm else None
        return x, w, b

    sets = make_input_sets(make, m * n * size)
    fwd = dict(norms(layer_norm, n, quack))
    if quack is not None and not layer_norm:
        fwd["quack"] = lambda x, w, b: quack.rmsnorm_fwd(x, w, eps=1e-6)
    if quack is not None and layer_norm:
        # quack's layernorm_fwd takes an fp32 weight and bias: converted once per input set.
        as_f32 = {}

        def f32(t):
            if t.data_ptr() not in as_f32:
                as_f32[t.data_ptr()] = t.float()
            return as_f32[t.data_ptr()]
        fwd["quack"] = lambda x, w, b: quack.layernorm_fwd(x, f32(w), f32(b), eps=1e-5)
    ms = bench_many(fwd, sets)
    rates = {k: gbps(2 * m * n * size, v) for k, v in ms.items()}
    results.add("norms", f"{name}_fwd", (m, n), label, "GBps", rates.pop("ours"), rates)
    del sets

    def make_bwd():
        x, w, b = make()
        return x, w, b, torch.randn_like(x)

    sets = make_input_sets(make_bwd, 2 * m * n * size)
    bwd = {k: autograd_grad(f) for k, f in norms(layer_norm, n, quack).items()}
    ms = bench_many(bwd, sets)
    rates = {k: gbps(3 * m * n * size, v) for k, v in ms.items()}
    results.add("norms", f"{name}_bwd", (m, n), label, "GBps", rates.pop("ours"), rates)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    results = Results()
    results.start(ceilings())
    shapes = ACCEPTANCE + ([] if args.quick else SWEEP)
    for m, n in shapes:  # compile ours before any peer is imported
        for w_dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(2, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            w = torch.randn(n, device="cuda", dtype=w_dtype, requires_grad=True)
            ck.rms_norm(x, w).sum().backward()
            ck.layer_norm(x, w, w).sum().backward()
    quack = try_import("quack.rmsnorm")
    for layer_norm in (False, True):
        for m, n in shapes:
            run_shape(results, m, n, layer_norm, quack)
            if not layer_norm and (m, n) in ACCEPTANCE[:2]:
                run_shape(results, m, n, layer_norm, quack, w_dtype=torch.float32)
    results.save()


if __name__ == "__main__":
    main()
