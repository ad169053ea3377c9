"""Cross-entropy forward + backward through autograd: where the time goes (torch profiler,
CUDA kernels grouped by name) and the time per call with and without the gradient in place.

    python benchmarks/experiments/experiment_ce.py [M V] [--timeline | --host]

``--timeline`` runs the fwd+bwd peers of bench_losses.py first (as the benchmark interleaves
them), then prints every CUDA kernel of a few of our calls with its start and length, and the
host calls that can stall the stream (allocations, frees, synchronizations). ``--host`` times
the host side of one call on a small problem (the GPU never the bottleneck) against torch's, and
prints where our Python time goes (cProfile).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import bench, bench_many, kernel_profile, make_input_sets, try_import  # noqa: E402

import cute_kernels as ck  # noqa: E402
from cute_kernels.rowwise.config import row_config  # noqa: E402
from cute_kernels.rowwise.cross_entropy_op import _build_forward, vector_width  # noqa: E402
from cute_kernels.runtime import get_kernel  # noqa: E402


def timeline(fn, sets, calls: int = 4) -> None:
    """Kernels of ``calls`` calls of ``fn`` (start relative to the first, length, gap before it,
    in us) and the host-side allocations and synchronizations among them."""
    stalls = ("cudaMalloc", "cudaFree", "cudaStreamSynchronize", "cudaDeviceSynchronize",
              "cudaEventSynchronize", "cudaMemcpy")
    for i in range(3):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn(*sets[i % len(sets)])
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    t0 = kernels[0].time_range.start if kernels else 0
    end = t0
    for e in kernels:
        start = e.time_range.start
        print(f"  gpu {start - t0:9.1f} +{e.time_range.elapsed_us():7.1f} gap {start - end:6.1f}  {e.name[:70]}")
        end = max(end, e.time_range.end)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(stalls):
            print(f"  host {e.time_range.start - t0:9.1f} +{e.time_range.elapsed_us():7.1f}  {e.name}")
    print(f"  span of {calls} calls: {end - t0:.1f} us", flush=True)


def host_time(m, v, fwd_bwd, calls: int = 300) -> None:
    import cProfile
    import pstats
    import time

    import torch.nn.functional as F
    from bench_losses import fwd_bwd as peer
    x = torch.randn(m, v, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, v, (m,), device="cuda")
    cases = {"ours fwd+bwd": fwd_bwd(False), "torch fwd+bwd": peer(F.cross_entropy),
             "ours fwd none": lambda x, t: ck.cross_entropy(x, t, reduction="none"),
             "ours fwd mean": lambda x, t: ck.cross_entropy(x, t)}
    quack = try_import("quack.cross_entropy")
    if quack is not None:
        cases["quack fwd"] = lambda x, t: quack.cross_entropy_fwd(x, t)
    for name, fn in cases.items():
        for _ in range(20):
            fn(x, t)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn(x, t)
        host = (time.perf_counter() - start) / calls * 1e6
        torch.cuda.synchronize()
        print(f"host {name}: {host:.1f} us per call", flush=True)
    profile = cProfile.Profile()
    run = fwd_bwd(False)
    profile.enable()
    for _ in range(calls):
        run(x, t)
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(22)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    m, v = (int(x) for x in args[:2]) if len(args) > 1 else (8192, 32768)
    sets = make_input_sets(lambda: (torch.randn(m, v, device="cuda", dtype=torch.bfloat16),
                                    torch.randint(0, v, (m,), device="cuda")), m * v * 2)

    def fwd_bwd(inplace):
        def run(x, t):
            x = x.detach().requires_grad_()
            ck.cross_entropy(x, t, inplace_backward=inplace).backward()
            return x.grad
        return run

    if "--host" in sys.argv:
        host_time(m, v, fwd_bwd)
        return
    if "--timeline" in sys.argv:
        import torch.nn.functional as F
        from bench_losses import fwd_bwd as peer

        peers = {"torch": peer(F.cross_entropy),
                 "torch_compile": peer(torch.compile(lambda x, t: F.cross_entropy(x.float(), t)))}
        print("after the peers:", {k: round(t * 1000) for k, t in bench_many({"ours": fwd_bwd(False), **peers},
                                                                               sets, reps=20).items()}, "us")
        timeline(fwd_bwd(False), sets)
        return
    for name, fn in (("fwd", lambda x, t: ck.cross_entropy(x, t)), ("fwd+bwd", fwd_bwd(False)),
                     ("fwd+bwd in place", fwd_bwd(True))):
        ms = bench(fn, sets)
        print(f"{name}: {ms * 1000:.1f} us", flush=True)
    kernel_profile(fwd_bwd(False), sets[0], calls=5, rows=8)
    # The forward kernel alone (per-row loss, no reduction, no autograd) and the op with
    # reduction="none" against quack's forward, interleaved in one run.
    key = (torch.bfloat16, torch.int64, None, False, False, False, v)
    cls, config, specs = _build_forward(key, vector_width(v, 2, 0))
    kernel = get_kernel(cls, config, specs)
    loss, lse = torch.empty(m, device="cuda"), torch.empty(m, device="cuda")

    def run(x, t):
        kernel(x, t, loss, lse, None, None, -100, 0.0, 0.0)
        return loss
    ref = torch.nn.functional.cross_entropy(sets[0][0].float(), sets[0][1], reduction="none")
    torch.testing.assert_close(run(*sets[0]), ref, atol=2e-3, rtol=2e-3)
    fns = {"kernel": run, "op, reduction=none": lambda x, t: ck.cross_entropy(x, t, reduction="none")}
    # The row split over twice the CTAs (32 values per thread): 16-CTA clusters at V = 131072.
    split = dataclasses.replace(config, row=row_config(v, config.row.vec, 2, tensors_held=4))
    if split.row != config.row:
        wide = get_kernel(cls, split, specs)
        fns[f"kernel, {split.row.cluster_n} CTAs per row"] = (
            lambda x, t: wide(x, t, loss, lse, None, None, -100, 0.0, 0.0))
    quack = try_import("quack.cross_entropy")
    if quack is not None:
        fns["quack"] = lambda x, t: quack.cross_entropy_fwd(x, t)
    ms = bench_many(fns, sets)
    print("forward GB/s:", {k: round(m * v * 2 / t / 1e6) for k, t in ms.items()})


if __name__ == "__main__":
    main()
