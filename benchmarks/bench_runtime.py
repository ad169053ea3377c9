"""Host-side costs: time per call of a tiny softmax (dispatch), and first-call time in a fresh
process with a cold and with a warm disk cache.

    python benchmarks/bench_runtime.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results  # noqa: E402

import cute_kernels as ck  # noqa: E402

FIRST_CALL = """
import json, time, torch
import cute_kernels as ck
x = torch.randn(64, 3000, device="cuda", dtype=torch.float16)
torch.cuda.synchronize()
start = time.perf_counter()
ck.softmax(x)
torch.cuda.synchronize()
print(json.dumps({"first_call_s": time.perf_counter() - start}))
"""


def host_us_per_call(fn, x, calls=5000) -> float:
    """Host time per call: many back-to-back calls, GPU work small enough not to throttle them."""
    for _ in range(200):
        fn(x)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def first_call_seconds(cache_dir: str) -> float:
    env = dict(os.environ, CUTE_KERNELS_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])["first_call_s"]


def import_seconds(code: str, runs: int = 3) -> float:
    """Median wall time of a fresh interpreter running ``code`` (an import)."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main():
    results = Results()
    base = import_seconds("import torch, cutlass.cute")
    ours_import = import_seconds("import cute_kernels")
    print(f"import: torch + the DSL {base:.2f} s, cute_kernels (both included) {ours_import:.2f} s")
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    ours = host_us_per_call(ck.softmax, x)
    theirs = host_us_per_call(lambda t: torch.softmax(t, -1), x)
    print(f"dispatch 8x1024 bf16: ours {ours:.2f} us/call, torch.softmax {theirs:.2f} us/call, "
          f"ratio {ours / theirs:.2f}")
    with tempfile.TemporaryDirectory() as cache:
        cold = first_call_seconds(cache)
        warm = first_call_seconds(cache)
    print(f"first call in a new process: cold cache {cold:.3f} s (compile), warm cache {warm:.3f} s")
    results.set_section("runtime", {
        "dispatch_us": {"shape": "8x1024", "dtype": "bfloat16", "ours": round(ours, 2),
                        "torch": round(theirs, 2), "ratio": round(ours / theirs, 2)},
        "first_call_s": {"cold_cache": round(cold, 3), "warm_cache": round(warm, 3)},
        "import_s": {"torch_and_dsl": round(base, 2), "cute_kernels": round(ours_import, 2)},
    })
    results.save()


if __name__ == "__main__":
    main()
