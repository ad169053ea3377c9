"""SM clock and board power while one fp8 GEMM runs back to back (nvidia-smi sampled every 50 ms).

    python benchmarks/experiments/experiment_power.py [--shape MxNxK] [--configs s,none,128x192c2,...] [--seconds S]

Configurations: ``s`` the 128 x 256 column-split promotion, ``none`` 128 x 256 without
promotion, ``TMxTN`` a fold per k-tile; ``cCM`` after any of them sets the cluster's CTAs along M,
``nCN`` along N, a last ``wSW`` the swizzle group (default 8).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cute_kernels.gemm.config import Epilogue, GemmConfig  # noqa: E402
from cute_kernels.gemm.op import compiled_gemm, kernel_specs  # noqa: E402
from cute_kernels.runtime.arch import sm_count  # noqa: E402


def sampled(fn, seconds, flops):
    fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    start, calls = time.perf_counter(), 0
    begin = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    begin.record()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            fn()
        calls += 20
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    rows = [line.split(",") for line in smi.communicate()[0].splitlines() if "," in line]
    rows = rows[len(rows) // 4:]  # after the ramp
    clock = sum(float(r[0]) for r in rows) / max(1, len(rows))
    power = sum(float(r[1]) for r in rows) / max(1, len(rows))
    tf = flops * calls / (begin.elapsed_time(end) * 1e-3) / 1e12
    return clock, power, tf


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="8192x8192x8192")
    parser.add_argument("--configs", default="s,none")
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    m, n, k = (int(v) for v in args.shape.split("x"))
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    one = torch.ones(max(m, n), device="cuda")
    sa, sb = one[:m], one[:n]
    fns = {}
    for text in args.configs.split(","):
        epi = Epilogue(row_scale=True, col_scale=True)
        name, _, swizzle = text.partition("w")
        cn = re.search(r"n(\d)$", name)
        text, swizzle, cn = name[:cn.start()] if cn else name, int(swizzle or 8), int(cn.group(1)) if cn else 1
        if text.startswith(("none", "s")):  # 128 x 256: no promotion / column split
            split = text.startswith("s")
            cm = int(text.partition("c")[2] or 1)
            cfg = GemmConfig(128, 256, cm, cn, swizzle, sm_count(0) // (cm * cn), epilogue=epi, fp8_promote_every=int(split),
                             fp8_split_n=split)
        else:  # TMxTN[cCM]: a fold per k-tile
            shape, _, cm = text.partition("c")
            tm, tn = (int(v) for v in shape.split("x"))
            cm = int(cm or 1)
            cfg = GemmConfig(tm, tn, cm, cn, swizzle, sm_count(0) // (cm * cn), epilogue=epi, fp8_promote_every=1)
        kernel = compiled_gemm(cfg, kernel_specs(a, b, d, None, None, sa, sb, cfg))
        fns[f"ours-{text}n{cn}w{swizzle}"] = lambda kernel=kernel: kernel(a, b, d, None, None, sa, sb, 1.0, 0.0)
    s = one[0]
    fns["cublas-exact"] = lambda: torch._scaled_mm(a, b, s, s, out_dtype=torch.bfloat16)
    fns["cublas-fast"] = lambda: torch._scaled_mm(a, b, s, s, out_dtype=torch.bfloat16, use_fast_accum=True)
    for name, fn in fns.items():
        clock, power, tf = sampled(fn, args.seconds, 2 * m * n * k)
        print(f"{args.shape} {name}: {tf:.0f} TFLOP/s, SM clock {clock:.0f} MHz, power {power:.0f} W", flush=True)


if __name__ == "__main__":
    main()
