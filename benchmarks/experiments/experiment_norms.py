"""Time the LayerNorm / RMSNorm forward kernel (weight and bias) under different row splits,
side by side in one run (L2-cold inputs, interleaved rounds).

    python benchmarks/experiments/experiment_norms.py [--shapes MxN,...] [--held 1,3,1l,1s,1w] [--rms | --no-bias]
    python benchmarks/experiments/experiment_norms.py --backward op,128/128/1/264 [--shapes ...] [--rms]

``--held H`` builds the row split as if each thread kept H row-sized fragments in registers
(``row_config(..., tensors_held=H)``): more held fragments split the row over more threads.
A trailing ``l`` loads the weight and bias after the row reductions (``late_affine``), a
trailing ``s`` stages x through shared memory (``stage_x``); ``w`` splits rows of 8 CTAs over 16;
``x`` reduces LayerNorm's moments in one exchange (``one_exchange``); ``b`` bulk-copies the
weight and bias to shared memory at the start (``stage_affine``).

``--backward V,...`` times the backward kernel (dx, dw and for LayerNorm db) in launch shapes
``threads_per_row/threads_per_cta/cluster_n/grid[/ctas_per_sm]`` (grid in clusters; the
registers capped for ``ctas_per_sm`` CTAs per SM when given; ``op``: the op's own shape,
``op+sum`` with the op's sum of the per-CTA partials).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import bench_many, gbps, make_input_sets  # noqa: E402

from cute_kernels.rowwise.config import RowConfig, row_config  # noqa: E402
from cute_kernels.rowwise.norm import NormBwdSm90, NormConfig, NormFwdSm90  # noqa: E402
from cute_kernels.rowwise.norm_op import _build_backward, _build_forward, backward_grid, column_sum  # noqa: E402
from cute_kernels.runtime import get_kernel  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x65536,4096x131072")
    parser.add_argument("--held", default="1,3,1l")
    parser.add_argument("--rms", action="store_true", help="RMSNorm with a weight (default LayerNorm, weight and bias)")
    parser.add_argument("--no-bias", action="store_true", help="LayerNorm with a weight only")
    parser.add_argument("--backward", default=None, help="backward launch shapes (see above), comma-separated")
    args = parser.parse_args()
    if args.backward:
        return backward(args)
    dt = torch.bfloat16
    layer_norm = not args.rms
    bias = layer_norm and not args.no_bias
    for shape in args.shapes.split(","):
        m, n = (int(v) for v in shape.split("x"))
        sets = make_input_sets(lambda: (torch.randn(m, n, device="cuda", dtype=dt),), m * n * 2)
        w = torch.randn(n, device="cuda", dtype=dt)
        b = torch.randn(n, device="cuda", dtype=dt) if bias else None
        y = torch.empty(m, n, device="cuda", dtype=dt)
        rstd, mean = torch.empty(m, device="cuda"), torch.empty(m, device="cuda")
        key = (dt, None, dt, dt if bias else None, dt, None, layer_norm, 0, 0.0, n)
        _, config, specs = _build_forward(key, 8)
        x0 = sets[0][0]
        ref = (torch.nn.functional.layer_norm(x0.float(), (n,), w.float(), b.float() if bias else None, 1e-5)
               if layer_norm
               else torch.nn.functional.rms_norm(x0.float(), (n,), w.float(), 1e-5))
        fns = {}
        for text in args.held.split(","):
            held, flags = int(text.rstrip("lswxb")), text.lstrip("0123456789")
            late, staged = "l" in flags, "s" in flags
            rows = row_config(n, 8, 2, tensors_held=held, wide_clusters="w" in flags)
            config = NormConfig(rows, layer_norm, True, bias, False, late_affine=late,
                                stage_x=staged, one_exchange="x" in flags and layer_norm,
                                stage_affine="b" in flags)
            kernel = get_kernel(NormFwdSm90, config, specs)

            def run(x, kernel=kernel):
                kernel(x, None, w, b, y, None, rstd, mean if layer_norm else None, 1e-5)
            run(x0)
            err = (y.float() - ref).abs().max().item()
            print(f"{shape} held={text} cluster={rows.cluster_n} elems/thread={rows.elems_per_thread}: "
                  f"max err {err:.3f}", flush=True)
            fns[f"held{text}/c{rows.cluster_n}"] = run
        ms = bench_many(fns, sets)
        print(f"{shape} GB/s:", {k: round(gbps(2 * m * n * 2, t)) for k, t in ms.items()}, flush=True)


def backward(args):
    dt = torch.bfloat16
    layer_norm = not args.rms
    bias = layer_norm and not args.no_bias
    for shape in args.shapes.split(","):
        m, n = (int(v) for v in shape.split("x"))

        def make():
            x = torch.randn(m, n, device="cuda", dtype=dt)
            xf = x.float()
            mean = xf.mean(-1) if layer_norm else None
            centred = xf - mean[:, None] if layer_norm else xf
            return x, torch.randn_like(x), torch.rsqrt((centred * centred).mean(-1) + 1e-5), mean

        sets = make_input_sets(make, 2 * m * n * 2)
        w = torch.randn(n, device="cuda", dtype=dt)
        dx = torch.empty(m, n, device="cuda", dtype=dt)
        key = (dt, dt, dt, None, dt, layer_norm, True, layer_norm, 0, 0.0, n)
        _, base, specs = _build_backward(key, 8)
        x0, dy0, rstd0, mean0 = sets[0]
        xhat = ((x0.float() - mean0[:, None]) if layer_norm else x0.float()) * rstd0[:, None]
        g = dy0.float() * w.float()
        ref = g - xhat * (xhat * g).mean(-1, keepdim=True)
        if layer_norm:
            ref = ref - g.mean(-1, keepdim=True)
        ref = ref * rstd0[:, None]
        ref_dw = (dy0.float() * xhat).sum(0)
        fns = {}
        for text in args.backward.split(","):
            config, ctas = base, backward_grid(m, n, x0.device, 2, 2, False)
            if not text.startswith("op"):
                tpr, threads, cluster, ctas, *bound = (int(v) for v in text.split("/"))
                row = RowConfig(n, 8, tpr, threads, cluster)
                config = dataclasses.replace(base, row=row, ctas_per_sm=bound[0] if bound else 0)
            kernel = get_kernel(NormBwdSm90, config, specs)
            parts = torch.empty(1 + layer_norm, ctas, n, device="cuda")
            dw, db = parts[0], parts[1] if layer_norm else None
            totals = torch.empty(1 + layer_norm, n, device="cuda")

            def run(x, dy, rstd, mean, kernel=kernel, dw=dw, db=db, ctas=ctas, parts=parts,
                    totals=totals, sums=text == "op+sum"):
                kernel(x, w, dy, rstd, mean, None, dx, dw, db, ctas)
                if sums:  # the op's reduction of the per-CTA partials
                    column_sum(parts, totals)
            run(x0, dy0, rstd0, mean0)
            err = (dx.float() - ref).abs().max().item()
            err_dw = (dw.sum(0) - ref_dw).abs().max().item()
            print(f"{shape} {text}: {config.row} grid {ctas}: "
                  f"max err dx {err:.3g} dw {err_dw:.3g}", flush=True)
            fns[text] = run
        ms = bench_many(fns, sets)
        print(f"{shape} GB/s:", {k: round(gbps(3 * m * n * 2, t)) for k, t in ms.items()}, flush=True)


if __name__ == "__main__":
    main()
