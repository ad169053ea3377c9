"""W4A16 through the public calls, timed in CUDA graphs: the kernels' own rates, host excluded.

    python benchmarks/experiments/experiment_w4a16_graphs.py [--shapes MxNxK,...]

``bench_quant.py`` times each call with its own events, so a call shorter than its host time
reads as host plus device time. Here each candidate's calls are captured in a CUDA graph (40
calls over L2-cold input sets: a fresh weight per set) and the graph's replay is timed:
``ck.gemm_w4a16`` with a prepared weight (``nvfp4_prepare_weight``) and with the packed one,
cuBLAS bf16 on the dequantized weight, and quack's ``gemm_w4a16`` (nvfp4, its own repacked
weight) where it is installed. GB/s over the NVFP4 weight's bytes (codes and e4m3 scales) up to
64 rows of x, TFLOP/s beyond; the ratio to cuBLAS after each.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import cute_kernels as ck

DEFAULT_SHAPES = "1x8192x8192,16x8192x8192,64x8192x8192,1x14336x4096,16x28672x4096,16x4096x14336,4096x8192x8192"


def graph_ms(fn, sets, calls: int = 40) -> float:
    """Median milliseconds per call of ``fn`` over ``calls`` calls replayed from a CUDA graph."""
    for s in sets:
        fn(*s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*sets[i % len(sets)])
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    args = parser.parse_args()
    try:
        from quack.gemm_w4 import gemm_w4a16 as quack_gemm, prepare_w4_weight as quack_prepare
    except Exception:  # the peer is left out
        quack_gemm = quack_prepare = None
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        weight_bytes = n * k // 2 + n * k // 16
        sets = []
        for _ in range(max(3, -(-150_000_000 // weight_bytes)) if m <= 64 else 2):
            packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
            scales = torch.randint(0x20, 0x48, (n, k // 16), dtype=torch.uint8, device="cuda")
            scales = scales.view(torch.float8_e4m3fn)
            quack_weight = quack_prepare(packed, scales, "nvfp4") if quack_gemm else (None, None)
            sets.append((torch.randn(m, k, device="cuda", dtype=torch.bfloat16), packed, scales,
                         ck.nvfp4_prepare_weight(packed, scales),
                         ck.nvfp4_dequantize(packed, scales, 1.0), *quack_weight))
        fns = {"prepared": lambda x, p, s, w, d, qb, qs: ck.gemm_w4a16(x, w, None),
               "packed": lambda x, p, s, w, d, qb, qs: ck.gemm_w4a16(x, p, s),
               "cublas": lambda x, p, s, w, d, qb, qs: torch.matmul(x, d.t())}
        if quack_gemm:
            fns["quack"] = lambda x, p, s, w, d, qb, qs: quack_gemm(x, qb, qs, wformat="nvfp4")
        ms = {}
        with torch.no_grad():
            for name, fn in fns.items():
                try:
                    ms[name] = graph_ms(fn, sets)
                except Exception as exc:  # a peer that cannot be captured is left out
                    print(f"[{name} left out: {type(exc).__name__}: {exc}]")
                    torch.cuda.synchronize()
        rate = ((lambda v: f"{weight_bytes / v / 1e6:.0f} GB/s") if m <= 64
                else (lambda v: f"{2 * m * n * k / v / 1e9:.0f} TFLOP/s"))
        base = ms.get("cublas")
        print(f"{m}x{n}x{k}: " + "  ".join(
            f"{name} {rate(v)} ({v * 1e3:.1f} us{'' if base is None else f', {base / v:.2f}x'})"
            for name, v in ms.items()), flush=True)


if __name__ == "__main__":
    main()
