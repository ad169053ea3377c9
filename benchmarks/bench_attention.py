"""Attention forward: TFLOP/s (4 * B * Hq * Sq * Sk * D, halved for causal; 2 * ... * (D + Dv)
with a value head dim of its own) for ours and the peers in the same run: cuDNN (SDPA's cuDNN
backend), FlashAttention's CuTe kernel (``flash_attn.cute``), SDPA's flash backend
(FlashAttention-2).

    python benchmarks/bench_attention.py            # acceptance shapes + the sweep for the plot
    python benchmarks/bench_attention.py --quick    # acceptance shapes only
    python benchmarks/bench_attention.py --backward # backward and forward + backward rows

Backward rows (``attn_bwd``) time dQ, dK, dV through autograd and count 2.5x the forward's
FLOPs (2 * B * Hq * Sq * Sk * (3 D + 2 Dv): the five GEMMs); forward + backward rows
(``attn_fwd_bwd``) time both, counted as 3.5x. Shapes (B, S, Hq, Hkv, D[, Dv]).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    Results,
    autograd_grad,
    bench_many,
    ceilings,
    make_input_sets,
    tflops,
    try_import,
    usable,
)

import cute_kernels as ck  # noqa: E402

TOKENS = 16384
# Rounds per row (``bench_many``): a row's ratio to a peer moved by up to 6% between runs of
# three rounds (benchmarks/NOTES.md), most of it the peers' own burst clocks.
ROUNDS = 5


def sdpa_peer(backend):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
    return run


def peers():
    from torch.nn.attention import SDPBackend

    found = {"cudnn": sdpa_peer(SDPBackend.CUDNN_ATTENTION),
             "sdpa_flash": sdpa_peer(SDPBackend.FLASH_ATTENTION)}
    fa = try_import("flash_attn.cute")
    if fa is not None:
        def fa_cute(q, k, v, causal, window=None):
            out = fa.flash_attn_func(q, k, v, causal=causal,
                                     **({} if window is None else {"window_size": window}))
            return out[0] if isinstance(out, tuple) else out
        found["fa_cute"] = fa_cute
    return found


def _shape(batch, seqlen, heads, heads_kv, dim, dim_v):
    return (batch, seqlen, heads, heads_kv, dim) + ((dim_v,) if dim_v != dim else ())


def run_case(results, peer_fns, batch, seqlen, heads, heads_kv, dim, causal, dtype=torch.bfloat16,
             window=None, label="attn_fwd", dim_v=None):
    dim_v = dim_v or dim

    def make():
        q = torch.randn(batch, seqlen, heads, dim, device="cuda", dtype=dtype)
        k = torch.randn(batch, seqlen, heads_kv, dim, device="cuda", dtype=dtype)
        return q, k, torch.randn(batch, seqlen, heads_kv, dim_v, device="cuda", dtype=dtype)

    size = torch.tensor([], dtype=dtype).element_size()
    sets = make_input_sets(make, batch * seqlen * ((heads + heads_kv) * dim + heads_kv * dim_v) * size)
    flops = 2 * batch * heads * seqlen * seqlen * (dim + dim_v) / (2 if causal else 1)
    if window is not None:
        ours = lambda q, k, v: ck.flash_attn(q, k, v, causal=causal, window_size=window)
        cands = {"ours": ours}
        if "fa_cute" in peer_fns:
            cands["fa_cute"] = lambda q, k, v: peer_fns["fa_cute"](q, k, v, causal, window)
    else:
        cands = {"ours": lambda q, k, v: ck.flash_attn(q, k, v, causal=causal)}
        for name, fn in peer_fns.items():
            cands[name] = (lambda f: lambda q, k, v: f(q, k, v, causal))(fn)
    cands = {n: f for n, f in cands.items() if n == "ours" or usable(f, *sets[0])}
    ms = bench_many(cands, sets, rounds=ROUNDS)
    rates = {k: tflops(flops, v) for k, v in ms.items()}
    shape = _shape(batch, seqlen, heads, heads_kv, dim, dim_v)
    tag = "causal" if causal else "full"
    if window is not None:
        tag = f"window{window[0]}"
    row = results.add("attention", f"{label}_{tag}", shape, dtype, "TFLOPs", rates.pop("ours"),
                      rates, ms=round(ms["ours"], 4))
    del sets
    return row


def run_backward(results, peer_fns, batch, seqlen, heads, heads_kv, dim, causal,
                 dtype=torch.bfloat16, with_forward=False, deterministic=False, dim_v=None):
    """Backward through autograd (dQ, dK, dV), TFLOP/s counted as 2.5x the forward's; with
    ``with_forward``, forward and backward together (3.5x). ``deterministic``: ours with
    ``deterministic=True`` (the peers as they are; compare with the row without it)."""
    dim_v = dim_v or dim

    def make():
        q = torch.randn(batch, seqlen, heads, dim, device="cuda", dtype=dtype)
        k = torch.randn(batch, seqlen, heads_kv, dim, device="cuda", dtype=dtype)
        v = torch.randn(batch, seqlen, heads_kv, dim_v, device="cuda", dtype=dtype)
        return q, k, v, torch.randn(batch, seqlen, heads, dim_v, device="cuda", dtype=dtype)

    size = torch.tensor([], dtype=dtype).element_size()
    sets = make_input_sets(make, batch * seqlen * (heads + heads_kv) * (dim + dim_v) * size)
    per_score = (3 * dim + 2 * dim_v) + ((dim + dim_v) if with_forward else 0)
    flops = 2 * batch * heads * seqlen * seqlen * per_score / (2 if causal else 1)
    attend = {"ours": lambda q, k, v: ck.flash_attn(q, k, v, causal=causal, deterministic=deterministic)}
    for name, fn in peer_fns.items():
        attend[name] = (lambda f: lambda q, k, v: f(q, k, v, causal))(fn)
    wrap = forward_backward if with_forward else autograd_grad
    cands = {name: wrap(fn) for name, fn in attend.items()}
    cands = {n: f for n, f in cands.items() if n == "ours" or usable(f, *sets[0])}
    ms = bench_many(cands, sets, rounds=ROUNDS)
    rates = {k: tflops(flops, v) for k, v in ms.items()}
    tag = "causal" if causal else "full"
    label = ("attn_fwd_bwd" if with_forward else "attn_bwd") + ("_deterministic" if deterministic else "")
    results.add("attention", f"{label}_{tag}", _shape(batch, seqlen, heads, heads_kv, dim, dim_v),
                dtype, "TFLOPs", rates.pop("ours"), rates, ms=round(ms["ours"], 4))


def forward_backward(forward):
    """A candidate that times a training step's attention: ``forward`` on leaves that need
    gradients, then ``torch.autograd.grad`` of its output with the output gradient last."""
    def run(q, k, v, dout):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(forward(*leaves), leaves, dout)
    return run


def backward_rows(results, peer_fns, quick):
    lengths = (1024, 4096, 16384) if quick else (1024, 2048, 4096, 8192, 16384)
    for seqlen in lengths:
        for causal in (False, True):
            run_backward(results, peer_fns, TOKENS // seqlen, seqlen, 16, 16, 128, causal)
    for dim in (64, 192, 256):
        for causal in (False, True):
            run_backward(results, peer_fns, 4, 4096, 16, 16, dim, causal)
    for causal in (False, True):
        run_backward(results, peer_fns, 4, 4096, 16, 16, 128, causal, deterministic=True)
    # one GPT-style attention layer (GQA), forward and backward
    run_backward(results, peer_fns, 4, 4096, 32, 8, 128, True, with_forward=True)
    # large query-head groups (Llama-3 70B, Qwen2.5 72B: 64 query heads over 8 kv heads)
    run_backward(results, peer_fns, 2, 4096, 64, 8, 128, True)
    run_backward(results, peer_fns, 2, 4096, 64, 8, 128, True, with_forward=True)
    if not quick:
        run_backward(results, peer_fns, 4, 4096, 16, 16, 128, False, with_forward=True)
        run_backward(results, peer_fns, 4, 4096, 16, 16, 96, True)
        # DeepSeek's MLA prefill: q / k head dim 192, v 128
        for causal in (False, True):
            run_backward(results, peer_fns, 4, 4096, 16, 16, 192, causal, dim_v=128)
        run_backward(results, peer_fns, 4, 4096, 16, 16, 192, True, with_forward=True, dim_v=128)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--backward", action="store_true", help="backward rows only")
    args = parser.parse_args()
    results = Results()
    results.start(ceilings())
    peer_fns = peers()
    if args.backward:
        backward_rows(results, peer_fns, args.quick)
        results.save()
        return
    for dim in (128, 64, 256):
        lengths = (1024, 2048, 4096, 8192, 16384) if dim == 128 else (4096,)
        for seqlen in lengths:
            for causal in (False, True):
                run_case(results, peer_fns, TOKENS // seqlen, seqlen, 16, 16, dim, causal)
    # GQA per query head against MHA; a sliding window against full causal.
    run_case(results, peer_fns, 4, 4096, 32, 8, 128, True)
    run_case(results, peer_fns, 4, 4096, 32, 32, 128, True)
    run_case(results, peer_fns, 2, 8192, 16, 16, 128, True, window=(1024, 0))
    if not args.quick:
        for dim in (64, 96, 192):
            for seqlen in (1024, 4096):
                run_case(results, peer_fns, TOKENS // seqlen, seqlen, 16, 16, dim, True)
        for seqlen in (512, 32768):
            run_case(results, peer_fns, max(1, TOKENS // seqlen), seqlen, 16, 16, 128, True)
        # DeepSeek's MLA prefill: q / k head dim 192, v 128
        for causal in (False, True):
            run_case(results, peer_fns, 4, 4096, 16, 16, 192, causal, dim_v=128)
    results.save()


if __name__ == "__main__":
    main()
