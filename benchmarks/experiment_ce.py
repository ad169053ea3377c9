"""Cross-entropy forward + backward through autograd: where the time goes (torch profiler,
CUDA kernels grouped by name) and the time per call with and without the gradient in place.

    python benchmarks/experiment_ce.py [M V]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import bench, bench_many, kernel_profile, make_input_sets, try_import  # noqa: E402

import cute_kernels as ck  # noqa: E402
from cute_kernels.norms.cross_entropy_op import _build_forward, vector_width  # noqa: E402
from cute_kernels.runtime import get_kernel  # noqa: E402


def main():
    m, v = (int(x) for x in sys.argv[1:3]) if len(sys.argv) > 2 else (8192, 32768)
    sets = make_input_sets(lambda: (torch.randn(m, v, device="cuda", dtype=torch.bfloat16),
                                    torch.randint(0, v, (m,), device="cuda")), m * v * 2)

    def fwd_bwd(inplace):
        def run(x, t):
            x = x.detach().requires_grad_()
            ck.cross_entropy(x, t, inplace_backward=inplace).backward()
            return x.grad
        return run

    for name, fn in (("fwd", lambda x, t: ck.cross_entropy(x, t)), ("fwd+bwd", fwd_bwd(False)),
                     ("fwd+bwd in place", fwd_bwd(True))):
        ms = bench(fn, sets)
        print(f"{name}: {ms * 1000:.1f} us", flush=True)
    kernel_profile(fwd_bwd(False), sets[0], calls=5, rows=8)
    # The forward kernel alone (per-row loss, no reduction, no autograd) and the op with
    # reduction="none" against quack's forward, interleaved in one run.
    key = (torch.bfloat16, torch.int64, None, False, False, v)
    cls, config, specs = _build_forward(key, vector_width(v, 2, 0))
    kernel = get_kernel(cls, config, specs)
    loss, lse = torch.empty(m, device="cuda"), torch.empty(m, device="cuda")

    def run(x, t):
        kernel(x, t, loss, lse, None, None, -100, 0.0, 0.0)
        return loss
    ref = torch.nn.functional.cross_entropy(sets[0][0].float(), sets[0][1], reduction="none")
    torch.testing.assert_close(run(*sets[0]), ref, atol=2e-3, rtol=2e-3)
    fns = {"kernel": run, "op, reduction=none": lambda x, t: ck.cross_entropy(x, t, reduction="none")}
    quack = try_import("quack.cross_entropy")
    if quack is not None:
        fns["quack"] = lambda x, t: quack.cross_entropy_fwd(x, t)
    ms = bench_many(fns, sets)
    print("forward GB/s:", {k: round(m * v * 2 / t / 1e6) for k, t in ms.items()})


if __name__ == "__main__":
    main()
