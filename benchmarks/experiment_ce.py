"""Cross-entropy forward + backward through autograd: where the time goes (torch profiler,
CUDA kernels grouped by name) and the time per call with and without the gradient in place.

    python benchmarks/experiment_ce.py [M V]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import bench, kernel_profile, make_input_sets  # noqa: E402

import cute_kernels as ck  # noqa: E402


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


if __name__ == "__main__":
    main()
