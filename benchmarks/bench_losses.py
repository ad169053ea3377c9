"""Cross-entropy and fused linear cross-entropy: ours against the peers.

cross_entropy_fwd counts the logits read once (GB/s); cross_entropy_fwd_bwd counts the logits
read twice and the gradient written once (cross_entropy_softcap_fwd_bwd: the same with Gemma 2's
soft cap of 30 at its vocabulary); flce_fwd_bwd reports TFLOP/s of the three GEMMs
(6 * tokens * hidden * vocab) plus time and peak extra memory (flce_softcap_fwd_bwd: Gemma 2
2B's head, hidden 2304, vocabulary 256000, soft cap 30).

    python benchmarks/bench_losses.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results, bench, bench_many, ceilings, gbps, make_input_sets, tflops, try_import  # noqa: E402

import cute_kernels as ck  # noqa: E402

CE_SHAPES = [(8192, 32768), (4096, 131072)]
CE_SOFTCAP = (4096, 256000)
FLCE = (8192, 4096, 128256)
FLCE_SOFTCAP = (8192, 2304, 256000)
GEMMA_CAP = 30.0


def ce_peers(quack_ce, liger_ce):
    """Forward peers, each returning the per-row losses (quack's forward does no reduction)."""
    fwd = {"torch": lambda x, t: F.cross_entropy(x, t, reduction="none"),
           "torch_compile": torch.compile(lambda x, t: F.cross_entropy(x.float(), t, reduction="none"))}
    if quack_ce is not None:
        fwd["quack"] = lambda x, t: quack_ce.cross_entropy_fwd(x, t)
    return fwd


def fwd_bwd(loss_fn):
    def run(x, t):
        x = x.detach().requires_grad_()
        loss_fn(x, t).backward()
        return x.grad
    return run


def run_ce(results, m, v, quack_ce, liger):
    dtype = torch.bfloat16
    sets = make_input_sets(lambda: (torch.randn(m, v, device="cuda", dtype=dtype),
                                    torch.randint(0, v, (m,), device="cuda")), m * v * 2)
    fwd = {"ours": lambda x, t: ck.cross_entropy(x, t, reduction="none"), **ce_peers(quack_ce, liger)}
    ms = bench_many(fwd, sets)
    rates = {k: gbps(m * v * 2, t) for k, t in ms.items()}
    results.add("losses", "cross_entropy_fwd", (m, v), dtype, "GBps", rates.pop("ours"), rates)
    both = {"ours": fwd_bwd(ck.cross_entropy), "torch": fwd_bwd(F.cross_entropy),
            "torch_compile": fwd_bwd(torch.compile(lambda x, t: F.cross_entropy(x.float(), t)))}
    if quack_ce is not None:
        both["quack"] = fwd_bwd(quack_ce.cross_entropy)
    if liger is not None:
        liger_loss = liger.LigerCrossEntropyLoss()
        both["liger"] = fwd_bwd(lambda x, t: liger_loss(x, t))
    ms = bench_many(both, sets, reps=20)
    rates = {k: gbps(3 * m * v * 2, t) for k, t in ms.items()}
    results.add("losses", "cross_entropy_fwd_bwd", (m, v), dtype, "GBps", rates.pop("ours"), rates,
                ms={k: round(t, 3) for k, t in ms.items()})


def run_ce_softcap(results, liger):
    m, v = CE_SOFTCAP
    dtype = torch.bfloat16
    sets = make_input_sets(lambda: (torch.randn(m, v, device="cuda", dtype=dtype) * 8,
                                    torch.randint(0, v, (m,), device="cuda")), m * v * 2)

    def capped(x, t):
        return F.cross_entropy(GEMMA_CAP * torch.tanh(x.float() / GEMMA_CAP), t)

    both = {"ours": fwd_bwd(lambda x, t: ck.cross_entropy(x, t, softcap=GEMMA_CAP)),
            "torch": fwd_bwd(capped), "torch_compile": fwd_bwd(torch.compile(capped))}
    if liger is not None:
        liger_loss = liger.LigerCrossEntropyLoss(softcap=GEMMA_CAP)
        both["liger"] = fwd_bwd(lambda x, t: liger_loss(x, t))
    ms = bench_many(both, sets, reps=20)
    rates = {k: gbps(3 * m * v * 2, t) for k, t in ms.items()}
    results.add("losses", "cross_entropy_softcap_fwd_bwd", (m, v), dtype, "GBps", rates.pop("ours"),
                rates, ms={k: round(t, 3) for k, t in ms.items()})


def peak_extra_memory(fn, *args) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(*args)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def run_flce(results, liger, shape=FLCE, softcap=None):
    """Ours (the default plan; at the default shape also the slice pass, per-token losses and
    the soft cap), torch's unfused loss and Liger's, forward + backward with weight gradients."""
    tokens, hidden, vocab = shape
    dtype = torch.bfloat16
    h = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    w = (torch.randn(vocab, hidden, device="cuda", dtype=dtype) / 64)
    t = torch.randint(0, vocab, (tokens,), device="cuda")

    def make_run(loss_fn):
        def run(h, w, t):
            hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
            loss_fn(hh, ww, t).backward()
            return hh.grad, ww.grad
        return run

    def ours_by_slices(h, w, t):  # the plan with too little memory for a chunk of logits
        from cute_kernels.losses import fused_linear_cross_entropy as flce

        free_bytes = flce._free_bytes
        flce._free_bytes = lambda device: 4 * flce.ACCUMULATE_ROWS * vocab * 2 - 1
        try:
            return ck.fused_linear_cross_entropy(h, w, t)
        finally:
            flce._free_bytes = free_bytes

    def torch_loss(h, w, t):
        logits = (h @ w.t()).float()
        return F.cross_entropy(softcap * torch.tanh(logits / softcap) if softcap else logits, t)

    fns = {"ours": make_run(lambda h, w, t: ck.fused_linear_cross_entropy(h, w, t, softcap=softcap))}
    if softcap is None:
        fns.update({"ours_slice_pass": make_run(ours_by_slices),
                    "ours_per_token": make_run(lambda h, w, t: ck.fused_linear_cross_entropy(
                        h, w, t, reduction="none").mean()),
                    "ours_softcap": make_run(lambda h, w, t: ck.fused_linear_cross_entropy(
                        h, w, t, softcap=GEMMA_CAP))})
    fns["torch"] = make_run(torch_loss)
    if liger is not None:
        liger_loss = liger.LigerFusedLinearCrossEntropyLoss(softcap=softcap)
        fns["liger"] = make_run(lambda h, w, t: liger_loss(w, h, t))
    memory = {}
    for name, fn in fns.items():
        fn(h, w, t)  # warm up (compiles)
        memory[name] = peak_extra_memory(fn, h, w, t) / 2**30
    ms = {name: bench(fn, [(h, w, t)], warmup=2, reps=10) for name, fn in fns.items()}
    flops = 6 * tokens * hidden * vocab
    rates = {k: tflops(flops, v) for k, v in ms.items()}
    for variant in ("ours_slice_pass", "ours_per_token", "ours_softcap"):  # ours, in ms and memory only
        rates.pop(variant, None)
    name = "flce_softcap_fwd_bwd" if softcap else "flce_fwd_bwd"
    results.add("losses", name, (tokens, hidden, vocab), dtype, "TFLOPs", rates.pop("ours"),
                rates, ms={k: round(v, 2) for k, v in ms.items()},
                peak_extra_GiB={k: round(v, 3) for k, v in memory.items()})
    print("flce ms", {k: round(v, 2) for k, v in ms.items()}, "peak extra GiB",
          {k: round(v, 3) for k, v in memory.items()})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-flce", action="store_true")
    parser.add_argument("--only-flce", action="store_true")
    args = parser.parse_args()
    results = Results()
    results.start(ceilings())
    for m, v in CE_SHAPES:  # compile ours before any peer is imported
        x = torch.randn(2, v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ck.cross_entropy(x, torch.zeros(2, dtype=torch.long, device="cuda")).backward()
    quack_ce = try_import("quack.cross_entropy")
    liger = try_import("liger_kernel.transformers")
    for m, v in ([] if args.only_flce else CE_SHAPES):
        run_ce(results, m, v, quack_ce, liger)
    if not args.only_flce:
        run_ce_softcap(results, liger)
    if not args.skip_flce:
        run_flce(results, liger)
        run_flce(results, liger, FLCE_SOFTCAP, GEMMA_CAP)
    results.save()


if __name__ == "__main__":
    main()
