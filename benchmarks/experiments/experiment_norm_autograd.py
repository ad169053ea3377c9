"""RMSNorm as users run it: forward with a bf16 or fp32 weight, backward through autograd
(weight gradient included), ours against quack, with each side's kernels and host time listed
(the host time of a tiny softmax call, step by step: profile_dispatch.py).

    python benchmarks/experiments/experiment_norm_autograd.py [MxN ...]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import bench_many, gbps, kernel_profile, make_input_sets, try_import  # noqa: E402

import cute_kernels as ck  # noqa: E402


def autograd_backward(norm):
    """``torch.autograd.grad(y, (x, w), dy)`` on a forward recorded once per input set."""
    graphs = {}

    def run(x, w, dy):
        key = (x.data_ptr(), w.data_ptr())
        if key not in graphs:
            xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
            graphs[key] = (norm(xg, wg), xg, wg)
        y, xg, wg = graphs[key]
        return torch.autograd.grad(y, (xg, wg), dy, retain_graph=True)
    return run


def main():
    shapes = [tuple(int(v) for v in s.split("x")) for s in sys.argv[1:]] or [(32768, 4096), (16384, 16384)]
    quack = try_import("quack.rmsnorm")
    for m, n in shapes:
        for w_dtype in (torch.bfloat16, torch.float32):
            def make():
                return (torch.randn(m, n, device="cuda", dtype=torch.bfloat16),
                        torch.randn(n, device="cuda", dtype=w_dtype),
                        torch.randn(m, n, device="cuda", dtype=torch.bfloat16))
            sets = make_input_sets(make, 2 * m * n * 2)
            fwd = {"ours": lambda x, w, dy: ck.rms_norm(x, w)}
            bwd = {"ours": autograd_backward(lambda x, w: ck.rms_norm(x, w))}
            if quack is not None:
                fwd["quack"] = lambda x, w, dy: quack.rmsnorm_fwd(x, w, eps=1e-6)
                bwd["quack"] = autograd_backward(lambda x, w: quack.rmsnorm(x, w, eps=1e-6))
            f = bench_many(fwd, sets, rounds=5)
            b = bench_many(bwd, sets, rounds=5)
            wn = str(w_dtype).removeprefix("torch.")
            line = f"{m}x{n} w={wn:8s} fwd ours {gbps(2 * m * n * 2, f['ours']):6.0f} GB/s"
            if "quack" in f:
                line += f" quack {gbps(2 * m * n * 2, f['quack']):6.0f} ({f['quack'] / f['ours']:.3f}x)"
            line += f" | bwd autograd ours {b['ours'] * 1e3:6.1f} us"
            if "quack" in b:
                line += f" quack {b['quack'] * 1e3:6.1f} us ({b['quack'] / b['ours']:.3f}x)"
            print(line, flush=True)
            for name, fn in bwd.items():
                print(f"  {name} backward kernels:")
                kernel_profile(fn, sets[0], calls=3, rows=6)
                calls = 20
                for inputs in sets[:2]:
                    fn(*inputs)
                torch.cuda.synchronize()
                start = time.perf_counter()
                for i in range(calls):
                    fn(*sets[i % len(sets)])
                host = (time.perf_counter() - start) / calls * 1e6
                torch.cuda.synchronize()
                print(f"  {name} host time per backward call (no sync): {host:.1f} us")
                if w_dtype == torch.bfloat16 and (m, n) == shapes[0]:
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
                        for i in range(5):
                            fn(*sets[i % len(sets)])
                        torch.cuda.synchronize()
                    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=60))
            del sets


if __name__ == "__main__":
    main()
