"""Time GEMM configurations side by side with cuBLAS (L2-cold inputs, interleaved rounds).

    python benchmarks/experiments/experiment_gemm.py [--shapes MxNxK,...] [--configs TMxTNxWGxCM[xEPINxEPISTAGES[xSWIZZLE]][nCN][k][p|s][t][bKB][oC][wN],...] [--fp8 [--promote N]] [--linear]

``nCN`` sets the cluster's CTAs along N (default 1); ``bKB`` the MMA k-blocks per pipeline stage
(default 4); ``oC`` the CTAs per SM (1 or 2); ``k`` the stream-K tail; a last ``wN`` (fp8)
folds every N k-tiles instead of ``--promote``. A trailing ``p`` selects the ping-pong
schedule (TM = 64: rows per warpgroup tile); a trailing ``s`` (fp8) the column-split promotion
(``GemmConfig.fp8_split_n``); a last ``t`` runs the transposed problem (D^T = B^T A^T, the
operands' roles and majors swapped, D written column-major).
``--linear`` (bf16) gives B as ``nn.Linear`` stores a weight, (N, K) row-major passed transposed.
Every configuration runs persistent (one CTA per SM at most, as many clusters as run at once).
Each result is checked against cuBLAS before it is timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import bench_many, make_input_sets, tflops  # noqa: E402

from cute_kernels.gemm.config import Epilogue, GemmConfig  # noqa: E402
from cute_kernels.gemm.op import compiled_gemm, kernel_specs  # noqa: E402
from cute_kernels.runtime.arch import max_active_clusters  # noqa: E402


def parse(text, parts):
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item] if text else parts


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x4096x4096")
    parser.add_argument("--configs", default="128x256x2x1,128x256x2x2,128x128x2x1,64x128x1x1")
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--promote", type=int, default=4,
                        help="fp8: k-tiles per promotion into the fp32 accumulator (0: none, one accumulator)")
    parser.add_argument("--linear", action="store_true", help="bf16 B as a transposed (N, K) weight")
    args = parser.parse_args()
    for m, n, k in parse(args.shapes, []):
        if args.fp8:
            def make():
                a = torch.randn(1, m, k, device="cuda").to(torch.float8_e4m3fn)
                return a, torch.randn(1, n, k, device="cuda").to(torch.float8_e4m3fn).transpose(1, 2)
            sets = make_input_sets(make, m * k + k * n)
        elif args.linear:
            sets = make_input_sets(lambda: (torch.randn(1, m, k, device="cuda", dtype=torch.bfloat16),
                                            torch.randn(1, n, k, device="cuda", dtype=torch.bfloat16).transpose(1, 2)),
                                   (m * k + k * n) * 2)
        else:
            sets = make_input_sets(lambda: (torch.randn(1, m, k, device="cuda", dtype=torch.bfloat16),
                                            torch.randn(1, k, n, device="cuda", dtype=torch.bfloat16)),
                                   (m * k + k * n) * 2)
        d = torch.empty(1, m, n, device="cuda", dtype=torch.bfloat16)
        one = torch.ones(max(m, n), device="cuda")
        sa, sb = (one[:1], one[:1]) if args.fp8 else (None, None)  # fp8: per-tensor scales
        a0, b0 = sets[0]
        ref = (torch._scaled_mm(a0[0], b0[0], one[0], one[0], out_dtype=torch.bfloat16) if args.fp8
               else torch.matmul(a0[0], b0[0])).float()
        fns = {}
        for text in args.configs.split(","):
            text, _, window = text.partition("w")  # fp8: k-tiles per fold, instead of --promote
            text, _, occupancy = text.partition("o")  # CTAs per SM
            text, _, k_blocks = text.partition("b")  # MMA k-blocks per pipeline stage
            promote = int(window) if window else args.promote
            swap = text.endswith("t")  # the transposed problem: D^T = B^T A^T
            pingpong, split = text.rstrip("t").endswith("p"), text.rstrip("t").endswith("s")
            stream_k = "k" in text
            shape, _, cn = text.rstrip("pst").rstrip("k").partition("n")
            tm, tn, wg, cm, *epi_opts = (int(v) for v in shape.split("x"))
            cn = int(cn or 1)
            epi_n, epi_stages, swizzle = (list(epi_opts) + [32, 4, 8][len(epi_opts):])
            epi = Epilogue(scalar_scale_a=True, scalar_scale_b=True) if args.fp8 else Epilogue()
            ctas = int(occupancy or 1)
            cfg = GemmConfig(tm, tn, cm, cn, swizzle, max_active_clusters(0, cm * cn, ctas), epilogue=epi, warpgroups=wg,
                             k_blocks=int(k_blocks or 4), ctas_per_sm=ctas,
                             fp8_promote_every=promote if args.fp8 else 0, fp8_split_n=split, epi_n=epi_n, epi_stages=epi_stages,
                             pingpong=pingpong, stream_k=stream_k)

            def operands(a, b, swap=swap):
                return (b.transpose(1, 2), a.transpose(1, 2), d.transpose(1, 2)) if swap else (a, b, d)

            try:
                kernel = compiled_gemm(cfg, kernel_specs(*operands(a0, b0), None, None, sa, sb, cfg))
            except Exception as exc:  # noqa: BLE001 (report and go on)
                print(f"{m}x{n}x{k} {tm}x{tn} wg{wg} c{cm}x{cn}: {type(exc).__name__}: {str(exc)[:200]}")
                continue

            def run(a, b, kernel=kernel, operands=operands):
                kernel(*operands(a, b), None, None, sa, sb, 1.0, 0.0)

            run(a0, b0)
            err = ((d[0].float() - ref).abs().max() / ref.abs().max()).item()
            print(f"{m}x{n}x{k} {tm}x{tn} wg{wg} c{cm}x{cn}: rel err vs cuBLAS {err:.2e}")
            fns[text + (f"b{k_blocks}" if k_blocks else "") + (f"o{occupancy}" if occupancy else "")
                + (f"w{window}" if window else "")] = run  # the configuration as given (epilogue options included)
        if args.fp8:
            scale = one[0]
            fns["cublas"] = lambda a, b: torch._scaled_mm(a[0], b[0], scale, scale, out_dtype=torch.bfloat16)
            fns["cublas fast"] = lambda a, b: torch._scaled_mm(a[0], b[0], scale, scale, out_dtype=torch.bfloat16,
                                                               use_fast_accum=True)
        else:
            fns["cublas"] = lambda a, b: torch.matmul(a[0], b[0])
        ms = bench_many(fns, sets, rounds=3, reps=20)
        line = "  ".join(f"{key} {tflops(2 * m * n * k, v):.3g}" for key, v in ms.items())
        print(f"{m}x{n}x{k} TFLOP/s: {line}", flush=True)


if __name__ == "__main__":
    main()
