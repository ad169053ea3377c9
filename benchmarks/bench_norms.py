"""RMSNorm and LayerNorm forward and backward: GB/s for ours and the peers.

Forward counts x read + y written; backward counts x and dy read + dx written (the weight,
the per-row statistics and dw are small and not counted).

    python benchmarks/bench_norms.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results, bench_many, ceilings, gbps, make_input_sets, try_import  # noqa: E402

import cute_kernels as ck  # noqa: E402
from cute_kernels.rowwise.norm_op import norm_backward  # noqa: E402

ACCEPTANCE = [(32768, 4096), (16384, 16384), (4096, 131072)]
SWEEP = [(131072, 1024), (65536, 2048), (8192, 16384), (2048, 65536)]


def torch_bwd(layer_norm):
    def run(x, w, b, dy, rstd, mean):
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = F.layer_norm(x, (x.shape[-1],), w, b) if layer_norm else F.rms_norm(x, (x.shape[-1],), w, 1e-6)
        return torch.autograd.grad(y, [x, w], dy)
    return run


def compiled_bwd(layer_norm):
    def math(x, w, b, dy, rstd, mean):
        xf, dyf = x.float(), dy.float()
        xhat = ((xf - mean[:, None]) if layer_norm else xf) * rstd[:, None]
        g = dyf * w.float()
        c1 = (xhat * g).mean(-1, keepdim=True)
        dx = g - xhat * c1
        if layer_norm:
            dx = dx - g.mean(-1, keepdim=True)
        return (dx * rstd[:, None]).to(x.dtype), (dyf * xhat).sum(0)
    return torch.compile(math)


def compiled_fwd(layer_norm):
    if layer_norm:
        return torch.compile(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b))
    return torch.compile(lambda x, w, b: F.rms_norm(x, (x.shape[-1],), w, 1e-6))


def run_shape(results, m, n, layer_norm, quack):
    dtype, size = torch.bfloat16, 2
    name = "layernorm" if layer_norm else "rmsnorm"

    def make():
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        w = torch.randn(n, device="cuda", dtype=dtype)
        b = torch.randn(n, device="cuda", dtype=dtype) if layer_norm else None
        return x, w, b

    sets = make_input_sets(make, m * n * size)
    fwd = {"ours": (lambda x, w, b: ck.layer_norm(x, w, b)) if layer_norm else (lambda x, w, b: ck.rms_norm(x, w)),
           "torch": (lambda x, w, b: F.layer_norm(x, (n,), w, b)) if layer_norm else (lambda x, w, b: F.rms_norm(x, (n,), w, 1e-6)),
           "torch_compile": compiled_fwd(layer_norm)}
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
    results.add("norms", f"{name}_fwd", (m, n), dtype, "GBps", rates.pop("ours"), rates)
    del sets

    def make_bwd():
        x, w, b = make()
        xf = x.float()
        mean = xf.mean(-1) if layer_norm else torch.zeros(m, device="cuda")
        var = ((xf - mean[:, None]) ** 2).mean(-1) if layer_norm else (xf * xf).mean(-1)
        rstd = torch.rsqrt(var + 1e-6)
        return x, w, b, torch.randn_like(x), rstd, mean if layer_norm else None

    sets = make_input_sets(make_bwd, 2 * m * n * size)

    def ours(x, w, b, dy, rstd, mean):
        return norm_backward(x, w, dy, rstd, mean, None, layer_norm, True, layer_norm)

    bwd = {"ours": ours, "torch": torch_bwd(layer_norm), "torch_compile": compiled_bwd(layer_norm)}
    if quack is not None and not layer_norm:
        bwd["quack"] = lambda x, w, b, dy, rstd, mean: quack.rmsnorm_bwd(x, w, dy, rstd)
    ms = bench_many(bwd, sets)
    rates = {k: gbps(3 * m * n * size, v) for k, v in ms.items()}
    results.add("norms", f"{name}_bwd", (m, n), dtype, "GBps", rates.pop("ours"), rates)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    results = Results()
    results.start(ceilings())
    shapes = ACCEPTANCE + ([] if args.quick else SWEEP)
    for m, n in shapes:  # compile ours before any peer is imported
        x = torch.randn(2, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        ck.rms_norm(x, w), ck.layer_norm(x, w, w)
        rstd = torch.ones(2, device="cuda")
        norm_backward(x, w, x, rstd, None, None, False, True, False)
        norm_backward(x, w, x, rstd, rstd, None, True, True, True)
    quack = try_import("quack.rmsnorm")
    for layer_norm in (False, True):
        for m, n in shapes:
            run_shape(results, m, n, layer_norm, quack)
    results.save()


if __name__ == "__main__":
    main()
