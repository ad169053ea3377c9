"""Fused linear cross-entropy: time and peak extra memory per chunk size, and where the time
goes (torch profiler, CUDA kernels grouped by name) at the default chunk.

    python benchmarks/experiments/experiment_flce.py [TOKENS HIDDEN VOCAB]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_losses import peak_extra_memory  # noqa: E402
from harness import bench, kernel_profile  # noqa: E402

import cute_kernels as ck  # noqa: E402


def main():
    tokens, hidden, vocab = (int(v) for v in sys.argv[1:4]) if len(sys.argv) > 3 else (8192, 4096, 128256)
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) / 64
    t = torch.randint(0, vocab, (tokens,), device="cuda")

    def run(chunk):
        def go(h, w, t):
            hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
            ck.fused_linear_cross_entropy(hh, ww, t, chunk_size=chunk).backward()
            return hh.grad, ww.grad
        return go

    for chunk in (None, 512):
        fn = run(chunk)
        fn(h, w, t)
        mem = peak_extra_memory(fn, h, w, t) / 2**30
        ms = bench(fn, [(h, w, t)], warmup=2, reps=6)
        print(f"chunk {chunk}: {ms:.2f} ms, peak extra {mem:.3f} GiB", flush=True)
    kernel_profile(run(None), (h, w, t))


if __name__ == "__main__":
    main()
