"""Tensors of more than 2^31 elements on the GPU: no offset a kernel forms may wrap at 32 bits.

Each test builds operands just past 2^31 elements (4 GiB in 16-bit), runs the public op, and
checks rows at the start, the middle and the end -- where a wrapped offset would read or write
someone else's row -- against float64 references computed on those rows alone. The tests take
a file lock, so that parallel workers run them one at a time, and skip when the GPU lacks the
memory.
"""

from __future__ import annotations

import fcntl
import math
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

import cute_kernels as ck
from cute_kernels.quant.formats import nvfp4_quantize_ref

gpu = pytest.mark.gpu
PAST_INT32 = 2**31 + 2**20  # elements: just past the int32 range


@pytest.fixture
def gpu_memory():
    """``need(gib)``: skip unless that much GPU memory is free. Holds a lock across pytest
    workers for the test's duration."""
    with open(os.path.join(tempfile.gettempdir(), "cute_kernels_large_tensors.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        torch.cuda.empty_cache()

        def need(gib: float) -> None:
            free = torch.cuda.mem_get_info()[0] / 2**30
            if free < gib:
                pytest.skip(f"needs {gib:.0f} GiB of free GPU memory, {free:.1f} GiB free")

        yield need
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        fcntl.flock(lock, fcntl.LOCK_UN)


def probe_rows(rows: int) -> list[int]:
    return [0, 1, rows // 2, rows - 2, rows - 1]


def assert_rule(ours: torch.Tensor, ref: torch.Tensor, lowp: torch.Tensor) -> None:
    """The suite's rule: our error at most twice torch's in the same precision, + 1e-3."""
    ours_err = (ours.double() - ref).abs().max().item()
    torch_err = (lowp.double() - ref).abs().max().item()
    assert ours_err <= 2 * torch_err + 1e-3, f"error {ours_err:.3e} vs torch's {torch_err:.3e}"


@gpu
def test_softmax_forward_and_backward(gpu_memory):
    gpu_memory(24)
    cols = 1024
    rows = -(-PAST_INT32 // cols)
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16).requires_grad_()
    y = ck.softmax(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    for r in probe_rows(rows):
        xr = x[r].detach()
        ref = torch.softmax(xr.double(), -1)
        assert_rule(y[r], ref, torch.softmax(xr, -1))
        dref = ref * (dy[r].double() - (dy[r].double() * ref).sum())
        y_lowp = torch.softmax(xr, -1)
        dlowp = y_lowp * (dy[r] - (dy[r] * y_lowp).sum())
        assert_rule(x.grad[r], dref, dlowp)


@gpu
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_norms(gpu_memory, norm):
    gpu_memory(16)
    cols = 4096
    rows = -(-PAST_INT32 // cols)
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) + 3.0
    weight = torch.rand(cols, device="cuda", dtype=torch.bfloat16) + 0.5
    if norm == "rms":
        out = ck.rms_norm(x, weight)
    else:
        out = ck.layer_norm(x, weight)
    for r in probe_rows(rows):
        xr, w = x[r].double(), weight.double()
        if norm == "rms":
            ref = xr * torch.rsqrt(xr.pow(2).mean() + 1e-6) * w
            lowp = F.rms_norm(x[r], (cols,), weight, 1e-6)
        else:
            ref = (xr - xr.mean()) * torch.rsqrt(xr.var(unbiased=False) + 1e-5) * w
            lowp = F.layer_norm(x[r], (cols,), weight, None, 1e-5)
        assert_rule(out[r], ref, lowp)


@gpu
def test_cross_entropy_loss_and_gradient(gpu_memory):
    gpu_memory(24)
    vocab = 65536
    rows = -(-PAST_INT32 // vocab)
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16).requires_grad_()
    target = torch.randint(0, vocab, (rows,), device="cuda")
    loss = ck.cross_entropy(logits, target, reduction="none")
    loss.sum().backward()
    for r in probe_rows(rows):
        lr = logits[r].detach().double()
        ref = torch.logsumexp(lr, -1) - lr[target[r]]
        assert abs(loss[r].item() - ref.item()) <= 1e-4 * max(1.0, abs(ref.item())), (r, loss[r].item(), ref.item())
        grad_ref = torch.softmax(lr, -1)
        grad_ref[target[r]] -= 1
        lowp = torch.softmax(logits[r].detach(), -1)
        lowp[target[r]] -= 1
        assert_rule(logits.grad[r], grad_ref, lowp)


@gpu
@pytest.mark.parametrize("big", ["output", "a"])
def test_gemm(gpu_memory, big):
    gpu_memory(16)
    if big == "output":  # M x N past 2^31: the epilogue's offsets
        m, n, k = -(-PAST_INT32 // 32768), 32768, 64
    else:  # M x K past 2^31: A's loads
        m, n, k = -(-PAST_INT32 // 8192), 64, 8192
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    out = ck.gemm(a, b)
    for r in probe_rows(m):
        ref = a[r].double() @ b.double()
        assert_rule(out[r], ref, a[r:r + 1] @ b)


def attention_rows(q, k, v, causal):
    """float64 attention of (S, H, D) slices."""
    scores = torch.einsum("ihd,jhd->hij", q.double(), k.double()) / math.sqrt(q.shape[-1])
    if causal:
        s_q, s_k = q.shape[0], k.shape[0]
        allowed = torch.arange(s_k, device=q.device)[None] <= torch.arange(s_q, device=q.device)[:, None] + s_k - s_q
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hij,jhd->ihd", torch.softmax(scores, -1), v.double())


def lowp_rows(q, k, v, causal):
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          v.transpose(0, 1)[None], is_causal=causal)[0].transpose(0, 1)


@gpu
def test_flash_attn_forward_and_backward(gpu_memory):
    gpu_memory(48)
    seqlen, heads, dim = 128, 16, 128
    batch = -(-PAST_INT32 // (seqlen * heads * dim))
    q, k, v = (torch.randn(batch, seqlen, heads, dim, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    out = ck.flash_attn(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    for bi in probe_rows(batch):
        qb, kb, vb = (t[bi].detach() for t in (q, k, v))
        assert_rule(out[bi], attention_rows(qb, kb, vb, True), lowp_rows(qb, kb, vb, True))
        leaves = [t.double().requires_grad_() for t in (qb, kb, vb)]
        attention_rows(*leaves, True).backward(dout[bi].double())
        lows = [t.clone().requires_grad_() for t in (qb, kb, vb)]
        lowp_rows(*lows, True).backward(dout[bi])
        for ours, ref, low in zip((q.grad[bi], k.grad[bi], v.grad[bi]), leaves, lows):
            assert_rule(ours, ref.grad, low.grad)


@gpu
def test_flash_attn_varlen(gpu_memory):
    gpu_memory(24)
    heads, dim = 16, 128
    total = -(-PAST_INT32 // (heads * dim))
    lengths = [1024] * (total // 1024) + ([total % 1024] if total % 1024 else [])
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = ck.flash_attn_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    for s in (0, len(lengths) // 2, len(lengths) - 2, len(lengths) - 1):
        lo, hi = cu[s].item(), cu[s + 1].item()
        assert_rule(out[lo:hi], attention_rows(q[lo:hi], k[lo:hi], v[lo:hi], True),
                    lowp_rows(q[lo:hi], k[lo:hi], v[lo:hi], True))


@gpu
def test_nvfp4_quantize(gpu_memory):
    gpu_memory(16)
    cols = 131072
    rows = -(-PAST_INT32 // cols)
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor(0.01, device="cuda")
    packed, scales, _ = ck.nvfp4_quantize(x, scale)
    for r in probe_rows(rows):
        ref_packed, ref_scales, _ = nvfp4_quantize_ref(x[r:r + 1], scale)
        assert torch.equal(packed[r:r + 1], ref_packed), r
        assert torch.equal(scales[r:r + 1].view(torch.uint8), ref_scales.view(torch.uint8)), r
