"""GEMM: TFLOP/s for ours, cuBLAS (torch.matmul / torch._scaled_mm) and quack, same run.

    python benchmarks/bench_gemm.py [--quick]
    python benchmarks/bench_gemm.py --grid     # real model shapes (gemm_bf16_linear rows)

The grid multiplies activations (M, K) by a weight stored as ``nn.Linear`` stores it, (N, K),
passed transposed; for M <= 16 a row also reports the weight bandwidth achieved (GB/s), and the
host time of an unaligned call is measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results, bench_many, ceilings, host_us, make_input_sets, tflops, try_import, usable  # noqa: E402

import cute_kernels as ck  # noqa: E402

# Five interleaved rounds (the median wins): the libraries run the same tiles at the large shapes,
# so the ratios sit near 1.0, and the device has transient slow spells (measured: a few ms at
# half speed, hitting whichever library is being timed) that three rounds do not outvote.
ROUNDS = 5
SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 8192, 1024), (16384, 1024, 4096),
          (4096, 14336, 4096), (4096, 4096, 14336), (1024, 1024, 1024), (128, 8192, 8192)]
# Shapes whose last wave of 128 x 256 tiles is mostly empty (the stream-K tail's case), and a
# mid-length K (the ping-pong schedule's range above K = 1024).
EXTRA_SHAPES = [(4096, 4352, 4096), (8192, 4352, 8192), (8192, 8192, 2048)]
# Real model shapes (M x N x K): projections of Llama-3 8B (qkv 6144 x 4096, down 4096 x
# 14336, gate + up 28672 x 4096) and 70B (qkv 10240 x 8192, down 8192 x 28672) at decode,
# small-prefill and training token counts, vocabulary heads (Llama-3 128256, Mistral 32000,
# GPT-2 50257), and odd or unaligned sizes.
GRID_SHAPES = (
    [(m, 6144, 4096) for m in (1, 16, 64, 256, 2048, 8192)]
    + [(m, 4096, 14336) for m in (1, 16, 64, 256, 2048, 8192)]
    + [(m, 14336, 4096) for m in (1, 16, 64, 256)]
    + [(m, 28672, 4096) for m in (16, 256, 2048)]
    + [(m, 10240, 8192) for m in (1, 256, 8192)]
    + [(m, 8192, 28672) for m in (16, 2048)]
    + [(1, 128256, 4096), (2048, 128256, 4096), (2048, 32000, 4096), (8192, 50257, 768)]
    + [(1, 4096, 4096), (16, 4096, 4096), (1024, 1024, 1024), (2048, 2048, 8192),
       (3000, 5000, 1000), (3000, 5000, 2000), (2048, 5000, 1000), (333, 1000, 777)]
    + [(8192, 16, 4096), (8192, 64, 4096)]  # LoRA down-projections (rank 16 / 64)
)


def grid_rows(results, quack) -> None:
    """``gemm_bf16_linear`` rows over GRID_SHAPES (weights (N, K), passed transposed)."""
    dtype = torch.bfloat16
    for m, n, k in GRID_SHAPES:
        sets = make_input_sets(lambda: (torch.randn(m, k, device="cuda", dtype=dtype),
                                        torch.randn(n, k, device="cuda", dtype=dtype).t()),
                               (m * k + k * n) * 2)
        fns = {"ours": ck.gemm, "cublas": torch.matmul}
        if quack is not None and usable(quack.gemm, *sets[0]):
            fns["quack"] = quack.gemm
        ms = bench_many(fns, sets, rounds=ROUNDS, reps=20)
        rates = {key: tflops(2 * m * n * k, v) for key, v in ms.items()}
        extra = {}
        if m <= 16:  # decode: the weight is the traffic
            extra["weight_GBps"] = {key: round(n * k * 2 / v / 1e6, 1) for key, v in ms.items()}
        results.add("gemm", "gemm_bf16_linear", (m, n, k), dtype, "TFLOPs", rates.pop("ours"), rates, **extra)
    a = torch.randn(333, 777, device="cuda", dtype=dtype)
    w = torch.randn(1000, 777, device="cuda", dtype=dtype)
    host = host_us({"ours": ck.gemm, "torch": torch.matmul}, a, w.t())
    print(f"host time 333x1000x777 (weight (N, K) transposed): ours {host['ours']:.2f} us, "
          f"torch.matmul {host['torch']:.2f} us")
    results.data.setdefault("runtime", {})["gemm_333x1000x777_host_us"] = {k: round(v, 2) for k, v in host.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--grid", action="store_true", help="the real-shape grid only")
    args = parser.parse_args()
    results = Results()
    results.start(ceilings())
    if args.grid:
        grid_rows(results, try_import("quack.gemm_interface"))
        results.save()
        return
    shapes = SHAPES[:2] if args.quick else SHAPES + EXTRA_SHAPES
    dtype = torch.bfloat16
    for m, n, k in shapes:  # compile ours before any peer is imported
        ck.gemm(torch.randn(m, k, device="cuda", dtype=dtype), torch.randn(k, n, device="cuda", dtype=dtype))
    quack = try_import("quack.gemm_interface")
    for m, n, k in shapes:
        sets = make_input_sets(lambda: (torch.randn(m, k, device="cuda", dtype=dtype),
                                        torch.randn(k, n, device="cuda", dtype=dtype)), (m * k + k * n) * 2)
        fns = {"ours": ck.gemm, "cublas": torch.matmul}
        if quack is not None:
            fns["quack"] = quack.gemm
        ms = bench_many(fns, sets, rounds=ROUNDS, reps=20)
        rates = {key: tflops(2 * m * n * k, v) for key, v in ms.items()}
        results.add("gemm", "gemm_bf16", (m, n, k), dtype, "TFLOPs", rates.pop("ours"), rates)
    # Epilogue fusion: bias + gelu in the kernel vs matmul followed by the separate ops.
    m = n = k = 4096
    bias = torch.randn(n, device="cuda", dtype=dtype)
    sets = make_input_sets(lambda: (torch.randn(m, k, device="cuda", dtype=dtype),
                                    torch.randn(k, n, device="cuda", dtype=dtype)), (m * k + k * n) * 2)
    fns = {"ours": lambda a, b: ck.gemm(a, b, bias=bias, activation="gelu_tanh"),
           "cublas": lambda a, b: F.gelu(torch.matmul(a, b) + bias, approximate="tanh")}
    ms = bench_many(fns, sets, rounds=ROUNDS)
    rates = {key: tflops(2 * m * n * k, v) for key, v in ms.items()}
    results.add("gemm", "gemm_bf16_bias_gelu", (m, n, k), dtype, "TFLOPs", rates.pop("ours"), rates)
    # fp8 e4m3, per-tensor scales.
    for m, n, k in [(4096, 4096, 4096), (8192, 8192, 8192)]:
        def make():
            a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
            w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
            return a, w.t()
        one = torch.ones((), device="cuda")
        sets = make_input_sets(make, m * k + k * n)
        fns = {"ours": lambda a, b: ck.gemm_fp8(a, b, one, one),
               "cublas": lambda a, b: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)}
        ms = bench_many(fns, sets, rounds=ROUNDS)
        rates = {key: tflops(2 * m * n * k, v) for key, v in ms.items()}
        results.add("gemm", "gemm_fp8", (m, n, k), "float8_e4m3fn", "TFLOPs", rates.pop("ours"), rates)
        # Fast accumulation (no promotion) on both sides.
        fns = {"ours": lambda a, b: ck.gemm_fp8(a, b, one, one, fast_accum=True),
               "cublas": lambda a, b: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16,
                                                       use_fast_accum=True)}
        ms = bench_many(fns, sets, rounds=ROUNDS)
        rates = {key: tflops(2 * m * n * k, v) for key, v in ms.items()}
        results.add("gemm", "gemm_fp8_fast_accum", (m, n, k), "float8_e4m3fn", "TFLOPs", rates.pop("ours"), rates)
    # Host overhead of a tiny call.
    a = torch.randn(64, 64, device="cuda", dtype=dtype)
    b = torch.randn(64, 64, device="cuda", dtype=dtype)
    host = host_us({"ours": ck.gemm, "torch": torch.matmul}, a, b)
    print(f"host time 64x64x64: ours {host['ours']:.2f} us, torch.matmul {host['torch']:.2f} us")
    results.data.setdefault("runtime", {})["gemm_64_host_us"] = {k: round(v, 2) for k, v in host.items()}
    results.save()


if __name__ == "__main__":
    main()
