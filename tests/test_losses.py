"""Cross-entropy and fused linear cross-entropy against float64 references."""

import pytest
import torch
import torch.nn.functional as F

import cute_kernels as ck
from cute_kernels.reference import cross_entropy_ref as ref_ce
from cute_kernels.losses.fused_linear_cross_entropy import chunk_rows
from cute_kernels.rowwise.cross_entropy_op import cross_entropy_fwd

gpu = pytest.mark.gpu
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
VOCABS = [1, 7, 192, 760, 1128, 4096, 8192, 65536, 131072, 262144]


# ---------------------------------------------------------------- no GPU needed


def test_cpu_tensor_is_refused():
    with pytest.raises(ck.DeviceError):
        ck.cross_entropy(torch.randn(4, 8), torch.zeros(4, dtype=torch.long))


def test_modules_return_z_loss_off_cuda():
    x = torch.randn(30, 11) * 3
    t = torch.randint(0, 11, (30,))
    t[::4] = -100
    loss, z_loss = ck.CrossEntropyLoss(lse_square_scale=1e-2, return_z_loss=True)(x, t)
    z_ref = 1e-2 * (torch.logsumexp(x, -1) ** 2)[t != -100].mean()
    torch.testing.assert_close(z_loss, z_ref)
    torch.testing.assert_close(loss, F.cross_entropy(x, t) + z_ref)
    h, w = torch.randn(30, 8), torch.randn(11, 8)
    loss, z_loss = ck.FusedLinearCrossEntropyLoss(lse_square_scale=1e-2, reduction="sum",
                                                  return_z_loss=True)(h, w, t)
    z_ref = 1e-2 * (torch.logsumexp(h @ w.t(), -1) ** 2)[t != -100].sum()
    torch.testing.assert_close(z_loss, z_ref)
    torch.testing.assert_close(loss, F.cross_entropy(h @ w.t(), t, reduction="sum") + z_ref)


def test_module_softcap_off_cuda_and_probability_targets():
    # off CUDA the module computes the capped loss with torch; class-probability targets
    # (torch's own loss) are refused with a cap or a z-loss rather than silently dropping them
    x = torch.randn(6, 9, 3) * 20
    t = torch.randint(0, 9, (6, 3))
    loss = ck.CrossEntropyLoss(softcap=7.0, label_smoothing=0.1)(x, t)
    torch.testing.assert_close(loss, F.cross_entropy(7.0 * torch.tanh(x / 7.0), t, label_smoothing=0.1))
    with pytest.raises(ck.UnsupportedError, match="class-probability"):
        ck.CrossEntropyLoss(softcap=7.0)(x, torch.softmax(x, 1))
    with pytest.raises(ck.UnsupportedError, match="class-probability"):
        ck.CrossEntropyLoss(lse_square_scale=1e-4)(x, torch.softmax(x, 1))
    torch.testing.assert_close(ck.CrossEntropyLoss()(x, torch.softmax(x, 1)),
                               F.cross_entropy(x, torch.softmax(x, 1)))


@pytest.mark.parametrize("tokens,hidden,vocab",
                         [(8192, 4096, 128256), (333, 256, 5003), (1000, 512, 32000), (2000, 64, 3001)])
def test_weight_gradient_slices_keep_their_logits_above_the_rows_they_write(tokens, hidden, vocab):
    from cute_kernels.losses.fused_linear_cross_entropy import SLICE_COLUMNS, _slab_in_place

    flat = torch.empty(vocab * hidden, dtype=torch.bfloat16)  # only views of it are taken
    v0 = 0
    while True:
        width, logits = _slab_in_place(flat, v0, tokens, hidden, vocab, 8)
        if logits is None:
            break
        start, stride = logits.storage_offset(), logits.stride(0)
        assert width >= SLICE_COLUMNS[0] and width % 8 == 0 and logits.shape == (tokens, width)
        assert start % 8 == 0 and stride % 8 == 0  # 16-byte rows for the GEMM's TMA
        assert start >= (v0 + width) * hidden  # clear of this and every earlier slice's rows
        assert start + tokens * stride <= vocab * hidden
        v0 += width
    assert v0 < vocab  # the rest goes to the separate buffer


def test_accumulating_by_chunks_needs_a_quarter_of_the_free_memory():
    from cute_kernels.losses.fused_linear_cross_entropy import accumulates_by_chunks

    assert accumulates_by_chunks(8192, 128256, 2, 80 << 30)
    assert not accumulates_by_chunks(8192, 128256, 2, 4 * 1024 * 128256 * 2 - 1)
    assert accumulates_by_chunks(8192, 128256, 2, 4 * 1024 * 128256 * 2)
    assert accumulates_by_chunks(10, 128256, 4, 4 * 10 * 128256 * 4)  # fewer tokens than a chunk


def test_chunk_rows_matches_memory_budget():
    # hidden 8192x4096 bf16 = 64 MiB; vocab 128256: 64 MiB / (128256 * 2) -> 256 rows
    assert chunk_rows(8192, 4096, 128256, 2, 80 << 30) == 256
    assert chunk_rows(100, 4096, 128256, 2, 80 << 30) == 64
    assert chunk_rows(10, 64, 1000, 2, 80 << 30) == 10
    assert chunk_rows(8192, 4096, 128256, 2, 1 << 30) == 256


class _KernelsInTorch:
    """The fused linear cross-entropy's kernels as torch computations on the CPU, with the
    kernels' contracts: the planning around them (chunks, the slice pass, tails, ignored rows)
    runs as it does on the GPU."""

    @staticmethod
    def _capped(logits, cap):
        """The logits capped as the kernels load them, and the cap's derivative (1 without)."""
        x = logits.double()
        if not cap:
            return x, 1.0
        t = torch.tanh(x / cap)
        return cap * t, 1 - t * t

    @staticmethod
    def cross_entropy_fwd(logits, target, loss, lse, grad, scale, ignore_index, smoothing, z, cap):
        x, slope = _KernelsInTorch._capped(logits, cap)
        counted = target != ignore_index
        row_lse = torch.logsumexp(x, 1)
        picked = x.gather(1, torch.where(counted, target, 0)[:, None])[:, 0]
        rows = (1 - smoothing) * (row_lse - picked) + smoothing * (row_lse - x.mean(1)) + z * row_lse**2
        scale = 1.0 if scale is None else scale[0]
        loss.copy_(torch.where(counted, rows, 0.0) * scale)
        lse.copy_(row_lse)
        if grad is not None:
            g = torch.softmax(x, 1) * (1 + 2 * z * row_lse[:, None]) - smoothing / x.shape[1]
            g[torch.arange(len(target)), torch.where(counted, target, 0)] -= 1 - smoothing
            grad.copy_(torch.where(counted[:, None], g * slope, 0.0) * scale)

    @staticmethod
    def cross_entropy_bwd(logits, target, lse, dloss, grad, ignore_index, smoothing, z, cap):
        x, slope = _KernelsInTorch._capped(logits, cap)
        g = torch.exp(x - lse[:, None].double()) * (1 + 2 * z * lse[:, None].double()) - smoothing / x.shape[1]
        inside = (target >= 0) & (target < x.shape[1])
        rows = torch.arange(len(target))[inside]
        g[rows, target[inside]] -= 1 - smoothing
        grad.copy_(torch.where((target != ignore_index)[:, None], g * slope, 0.0) * dloss[:, None])

    @staticmethod
    def mean_scale(target, ignore_index):
        return (1.0 / (target != ignore_index).sum().float()).reshape(1)

    @staticmethod
    def gemm_with_config(a, b, out, bias, config):
        out.copy_(a.double() @ b.double() + (0 if bias is None else bias.double()))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("z,cap", [(0.0, 0.0), (1e-3, 0.0), (1e-3, 7.0)])
def test_class_weights_with_label_smoothing_on_cpu(monkeypatch, reduction, z, cap):
    # torch's weighted smoothing put together around the kernels (their contracts in torch):
    # the forward's weighted sums and the backward's rank-one term and target fix, in several
    # row chunks, against float64 autograd
    from cute_kernels.rowwise import cross_entropy_op as op, cross_entropy_terms

    monkeypatch.setattr(op, "cross_entropy_fwd", _KernelsInTorch.cross_entropy_fwd)
    monkeypatch.setattr(op, "cross_entropy_bwd", _KernelsInTorch.cross_entropy_bwd)
    monkeypatch.setattr(cross_entropy_terms, "SMOOTHING_CHUNK", 5 * 41)
    m, v, eps = 23, 41, 0.2
    x = (torch.randn(m, v) * 3).requires_grad_()
    t = torch.randint(0, v, (m,))
    t[::5] = -100
    w = torch.rand(v) * 2
    loss, _ = op._WeightedCrossEntropy.apply(x, t, w, -100, reduction, z, cap, eps)
    g = torch.rand_like(loss) + 0.5
    (dx,) = torch.autograd.grad(loss, x, g)
    x64 = x.detach().double().requires_grad_()
    ref = ref_ce(_capped(x64, cap), t, smoothing=eps, reduction=reduction, z=z, weight=w)
    (dx_ref,) = torch.autograd.grad(ref, x64, g.double())
    torch.testing.assert_close(loss.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx.double(), dx_ref, atol=1e-6, rtol=1e-5)
    assert (dx[::5] == 0).all()


@pytest.mark.parametrize("cap", [0.0, 2.5])
def test_fused_linear_cross_entropy_weighted_smoothing_on_cpu(monkeypatch, cap):
    # class weights with label smoothing through the fused ops (their kernels' contracts in
    # torch): the rows' weighted sums from each chunk's logits, the smoothing's gradient terms
    # added per chunk (a separate buffer with a cap), chunks of 7 and a tail, a bias
    from cute_kernels.losses import fused_linear_cross_entropy as flce

    for name in ("cross_entropy_fwd", "cross_entropy_bwd", "mean_scale", "gemm_with_config"):
        monkeypatch.setattr(flce, name, getattr(_KernelsInTorch, name))
    monkeypatch.setattr(flce, "sm_count", lambda index: 132)
    monkeypatch.setattr(flce, "_free_bytes", lambda device: 1 << 40)
    tokens, hidden, vocab, eps, z = 40, 16, 33, 0.2, 1e-3
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) / 2).requires_grad_()
    b = torch.randn(vocab, requires_grad=True)
    cw = torch.rand(vocab) + 0.2
    t = torch.randint(0, vocab, (tokens,))
    t[::3] = -100
    rows, _ = flce._FusedLinearCrossEntropyWeightedSmoothing.apply(h, w, t, b, cw, -100, eps, z,
                                                                   cap, 7)
    dloss = torch.rand(tokens)
    grads = torch.autograd.grad(rows, [h, w, b], dloss)
    p64 = [p.detach().double().requires_grad_() for p in (h, w, b)]
    ref = ref_ce(_capped(p64[0] @ p64[1].t() + p64[2], cap), t, smoothing=eps, z=z,
                 weight=cw.double(), reduction="none")
    refs = torch.autograd.grad(ref, p64, dloss.double())
    torch.testing.assert_close(rows.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, refs):
        torch.testing.assert_close(g.double(), r, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("free,tokens,chunks,slices", [(1 << 40, 4100, 5, False), (1 << 40, 700, 1, False),
                                                      (1 << 20, 4100, 9, True)])
def test_fused_linear_cross_entropy_picks_its_plan_from_the_free_memory(monkeypatch, free, tokens, chunks,
                                                                        slices):
    # ample memory: chunks of ACCUMULATE_ROWS tokens (the tail its own chunk), no slice pass;
    # too little for a chunk of logits: the slice pass, the chunks' logits in the weight
    # gradient's storage (as many rows as it holds: H = 512 per chunk)
    from cute_kernels.losses import fused_linear_cross_entropy as flce

    for name in ("cross_entropy_fwd", "cross_entropy_bwd", "mean_scale", "gemm_with_config"):
        monkeypatch.setattr(flce, name, getattr(_KernelsInTorch, name))
    monkeypatch.setattr(flce, "sm_count", lambda index: 132)
    monkeypatch.setattr(flce, "_free_bytes", lambda device: free)
    calls = {"chunks": 0, "slices": 0}
    chunk_fwd, slice_pass = flce.cross_entropy_fwd, flce._weight_grad_by_slices

    def counted_fwd(*args):
        calls["chunks"] += 1
        chunk_fwd(*args)

    def counted_slices(*args):
        calls["slices"] += 1
        slice_pass(*args)

    monkeypatch.setattr(flce, "cross_entropy_fwd", counted_fwd)
    monkeypatch.setattr(flce, "_weight_grad_by_slices", counted_slices)
    hidden, vocab = 512, 8000
    h, w = torch.randn(tokens, hidden, dtype=torch.bfloat16), torch.randn(vocab, hidden, dtype=torch.bfloat16)
    t = torch.randint(0, vocab, (tokens,))
    grads = [torch.empty_like(h), torch.empty_like(w), None]
    flce.fused_linear_cross_entropy_fwd(h, w, t, None, torch.empty(()), None, *grads, -100, 0.0, 0.0, 0.0,
                                        "mean", None, None, None)
    assert calls == {"chunks": chunks, "slices": int(slices)}


def _capped(logits, cap):
    return cap * torch.tanh(logits / cap) if cap else logits


@pytest.mark.parametrize("free", [1 << 40, 1 << 20], ids=["memory", "tight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden,vocab,smoothing,z,cap,chunk",
                         [(3000, 64, 501, 0.0, 0.0, 0.0, None), (2500, 32, 777, 0.1, 0.0, 0.0, None),
                          (333, 64, 5003, 0.0, 1e-2, 0.0, None), (100, 64, 300, 0.0, 0.0, 0.0, 7),
                          (1100, 64, 300, 0.0, 0.0, 3.0, None), (0, 16, 40, 0.0, 0.0, 0.0, None)])
def test_fused_linear_cross_entropy_planning_on_cpu(monkeypatch, free, dtype, tokens, hidden, vocab,
                                                    smoothing, z, cap, chunk):
    # chunks, tails, the slice pass (bf16 without smoothing) and its separate buffer, chunk by
    # chunk accumulation (fp32, smoothing), no tokens: gradients against float64 autograd
    from cute_kernels.losses import fused_linear_cross_entropy as flce

    for name in ("cross_entropy_fwd", "cross_entropy_bwd", "mean_scale", "gemm_with_config"):
        monkeypatch.setattr(flce, name, getattr(_KernelsInTorch, name))
    monkeypatch.setattr(flce, "sm_count", lambda index: 132)
    monkeypatch.setattr(flce, "_free_bytes", lambda device: free)
    h = torch.randn(tokens, hidden, dtype=dtype)
    w = torch.randn(vocab, hidden, dtype=dtype) / 4
    b = torch.randn(vocab, dtype=dtype)
    t = torch.randint(0, vocab, (tokens,))
    t[::5] = -100
    loss = torch.full((), float("nan"))
    grads = [torch.full_like(h, float("nan")), torch.full_like(w, float("nan")),
             torch.full((vocab,), float("nan"))]
    flce.fused_linear_cross_entropy_fwd(h, w, t, b, loss, None, *grads, -100, smoothing, z, cap,
                                        "mean", chunk, None, None)
    params = [p.double().requires_grad_() for p in (h, w, b)]
    ref = ref_ce(_capped(params[0] @ params[1].t() + params[2], cap), t, smoothing=smoothing, z=z)
    if not tokens:
        assert loss.isnan() and all(not g.any() for g in grads)
        return
    refs = torch.autograd.grad(ref, params)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the logits are rounded
    assert abs(loss.item() - ref.item()) <= tolerance / 10 * abs(ref.item())
    for g, r in zip(grads, refs):
        assert (g.double() - r).abs().max().item() <= tolerance * r.abs().max().item()


@pytest.mark.parametrize("free", [1 << 40, 1 << 20], ids=["memory", "tight"])
@pytest.mark.parametrize("tokens,hidden,vocab,smoothing,z,cap,chunk",
                         [(2100, 64, 501, 0.0, 0.0, 0.0, None), (333, 32, 777, 0.1, 1e-2, 0.0, None),
                          (100, 64, 300, 0.0, 0.0, 2.5, 7), (0, 16, 40, 0.0, 0.0, 0.0, None)])
def test_fused_linear_cross_entropy_per_row_on_cpu(monkeypatch, free, tokens, hidden, vocab, smoothing,
                                                   z, cap, chunk):
    # reduction "none": per-row losses and lse in the forward, the gradients in the backward op
    # for per-row incoming gradients (chunks, tails, ignored rows), against float64 autograd
    from cute_kernels.losses import fused_linear_cross_entropy as flce

    for name in ("cross_entropy_fwd", "cross_entropy_bwd", "mean_scale", "gemm_with_config"):
        monkeypatch.setattr(flce, name, getattr(_KernelsInTorch, name))
    monkeypatch.setattr(flce, "sm_count", lambda index: 132)
    monkeypatch.setattr(flce, "_free_bytes", lambda device: free)
    h = torch.randn(tokens, hidden, dtype=torch.float32)
    w = torch.randn(vocab, hidden) / 4
    b = torch.randn(vocab)
    t = torch.randint(0, vocab, (tokens,))
    t[::5] = -100
    dloss = torch.randn(tokens)
    loss, lse = torch.full((tokens,), float("nan")), torch.full((tokens,), float("nan"))
    flce.fused_linear_cross_entropy_fwd(h, w, t, b, loss, lse, None, None, None, -100, smoothing, z,
                                        cap, "none", chunk, None, None)
    grads = [torch.full_like(h, float("nan")), torch.full_like(w, float("nan")),
             torch.full((vocab,), float("nan"))]
    flce.fused_linear_cross_entropy_bwd(h, w, t, b, lse, dloss, *grads, -100, smoothing, z, cap, chunk,
                                        None, None, None)
    params = [p.double().requires_grad_() for p in (h, w, b)]
    ref = ref_ce(_capped(params[0] @ params[1].t() + params[2], cap), t, smoothing=smoothing, z=z,
                 reduction="none")
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    if not tokens:
        assert not grads[1].any() and not grads[2].any()
        return
    refs = torch.autograd.grad(ref, params, dloss.double())
    for g, r in zip(grads, refs):
        assert (g.double() - r).abs().max().item() <= 1e-5 * r.abs().max().item()


# ---------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize("v", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_and_backward(v, dtype):
    m = max(2, min(67, 4_000_000 // v))
    x = (torch.randn(m, v, device="cuda", dtype=dtype) * 3).requires_grad_()
    t = torch.randint(0, v, (m,), device="cuda")
    t[1] = -100
    loss = ck.cross_entropy(x, t)
    ref = ref_ce(x.detach(), t)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref.item()) <= 1e-5 * max(1, abs(ref.item())) + 1e-5
    (dx,) = torch.autograd.grad(loss, x)
    x64 = x.detach().double().requires_grad_()
    (dx_ref,) = torch.autograd.grad(ref_ce(x64, t), x64)
    (dx_t,) = torch.autograd.grad(F.cross_entropy(x, t), x)
    ours_err = (dx.double() - dx_ref).abs().max().item()
    torch_err = (dx_t.double() - dx_ref).abs().max().item()
    assert ours_err <= 2 * torch_err + 1e-6, (ours_err, torch_err)
    assert (dx[1] == 0).all()


@gpu
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing,z", [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-4), (0.2, 1e-3)])
def test_options(reduction, smoothing, z):
    m, v = 50, 5000
    x = torch.randn(m, v, device="cuda", dtype=torch.float32, requires_grad=True)
    t = torch.randint(0, v, (m,), device="cuda")
    t[::7] = 3  # ignore_index=3 is also a valid class: ignored all the same
    loss = ck.cross_entropy(x, t, ignore_index=3, label_smoothing=smoothing, reduction=reduction,
                            lse_square_scale=z)
    x64 = x.detach().double().requires_grad_()
    ref = ref_ce(x64, t, 3, smoothing, reduction, z)
    torch.testing.assert_close(loss.double(), ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(ref)
    (dx,) = torch.autograd.grad(loss, x, g.float())
    (dx_ref,) = torch.autograd.grad(ref, x64, g)
    torch.testing.assert_close(dx.double(), dx_ref, atol=1e-6, rtol=1e-4)


@gpu
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v,smoothing,z", [(5003, 0.0, 0.0), (5003, 0.1, 1e-3), (128256, 0.0, 0.0),
                                           (131072, 0.2, 1e-4), (7, 0.0, 0.0)])
def test_softcap(reduction, dtype, v, smoothing, z):
    # Gemma 2's final-logit soft cap inside the kernels: logits far past the cap (derivative
    # near 0), rows split over a cluster (128256, 131072), a padded row tail (5003, 7),
    # ignored rows, an incoming gradient per row; the loss and gradient of the capped logits
    m, cap = max(3, min(64, 2_000_000 // v)), 15.0
    x = (torch.randn(m, v, device="cuda") * 12 + 3).to(dtype).requires_grad_()
    t = torch.randint(0, v, (m,), device="cuda")
    t[::3] = -100
    loss = ck.cross_entropy(x, t, label_smoothing=smoothing, reduction=reduction,
                            lse_square_scale=z, softcap=cap)
    x64 = x.detach().double().requires_grad_()
    ref = ref_ce(_capped(x64, cap), t, smoothing=smoothing, reduction=reduction, z=z)
    torch.testing.assert_close(loss.double(), ref, atol=1e-5, rtol=1e-5)
    g = torch.rand_like(ref) + 0.5
    (dx,) = torch.autograd.grad(loss, x, g.float())
    (dx_ref,) = torch.autograd.grad(ref, x64, g)
    atol = 1e-6 if dtype == torch.float32 else 4e-3 * dx_ref.abs().max().item()
    torch.testing.assert_close(dx.double(), dx_ref, atol=atol, rtol=1e-4 if dtype == torch.float32 else 1e-2)
    assert (dx[::3] == 0).all()


def _z_part(lse, t, z, reduction, weight=None, ignore_index=-100):
    counted = (t != ignore_index).double()
    if weight is not None:
        counted = counted * weight.double()[t.clamp(0, len(weight) - 1)]
    rows = z * lse.double() ** 2 * counted
    return rows if reduction == "none" else rows.sum() / (counted.sum() if reduction == "mean" else 1)


@gpu
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_return_z_loss(reduction, weighted):
    # the z-loss part alone beside the loss (Liger's return_z_loss): z * lse^2 per counted row,
    # reduced as the loss (weighted rows with class weights), without gradient; the loss and
    # its gradient as without the option
    m, v, z = 45, 3001, 1e-3
    x = (torch.randn(m, v, device="cuda") * 4 + 2).requires_grad_()
    t = torch.randint(0, v, (m,), device="cuda")
    t[::4] = -100
    w = torch.rand(v, device="cuda") + 0.5 if weighted else None
    loss, z_loss = ck.cross_entropy(x, t, reduction=reduction, lse_square_scale=z, weight=w,
                                    return_z_loss=True)
    assert not z_loss.requires_grad and z_loss.shape == loss.shape
    lse = torch.logsumexp(x.detach().double(), -1)
    torch.testing.assert_close(z_loss.double(), _z_part(lse, t, z, reduction, w), atol=1e-6, rtol=1e-5)
    plain = ck.cross_entropy(x, t, reduction=reduction, lse_square_scale=z, weight=w)
    torch.testing.assert_close(loss, plain)
    g = torch.rand_like(loss)
    torch.testing.assert_close(torch.autograd.grad(loss, x, g)[0], torch.autograd.grad(plain, x, g)[0])
    module_loss, module_z = ck.CrossEntropyLoss(weight=w, reduction=reduction, lse_square_scale=z,
                                                return_z_loss=True)(x, t)
    torch.testing.assert_close(module_z, z_loss)


@gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_fused_linear_cross_entropy_return_z_loss(reduction, weighted):
    tokens, hidden, vocab, z = 1100, 64, 3001, 1e-3
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    wt = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) / 4).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device="cuda")
    t[::5] = -100
    cw = torch.rand(vocab, device="cuda") + 0.5 if weighted else None
    loss, z_loss = ck.fused_linear_cross_entropy(h, wt, t, reduction=reduction, lse_square_scale=z,
                                                 ce_weight=cw, softcap=20.0, return_z_loss=True)
    assert not z_loss.requires_grad and z_loss.shape == loss.shape
    lse = torch.logsumexp(_capped((h @ wt.t()).detach().double(), 20.0), -1)
    torch.testing.assert_close(z_loss.double(), _z_part(lse, t, z, reduction, cw), atol=1e-4, rtol=1e-2)
    plain = ck.fused_linear_cross_entropy(h, wt, t, reduction=reduction, lse_square_scale=z,
                                          ce_weight=cw, softcap=20.0)
    torch.testing.assert_close(loss, plain)
    loss.sum().backward()


@gpu
def test_softcap_with_class_weights_minus_inf_logits_and_the_module():
    # class weights with the cap (the per-row path: the backward kernel caps again); a row
    # with -inf logits (they stay -inf: exp(-cap) each less in the sum than torch's -cap,
    # far below the tolerance here) and a -inf target logit (capped to -cap, as torch)
    m, v, cap = 40, 3001, 30.0
    x = (torch.randn(m, v, device="cuda") * 50).requires_grad_()
    with torch.no_grad():
        x[5, ::2] = -float("inf")
    t = torch.randint(0, v, (m,), device="cuda")
    t[5] = 4
    t[::7] = -100
    w = torch.rand(v, device="cuda") + 0.5
    loss = ck.cross_entropy(x, t, weight=w, softcap=cap)
    x64 = x.detach().double().requires_grad_()
    ref = ref_ce(_capped(x64, cap), t, weight=w)
    torch.testing.assert_close(loss.double(), ref, atol=1e-5, rtol=1e-5)
    (dx,) = torch.autograd.grad(loss, x)
    (dx_ref,) = torch.autograd.grad(ref, x64)
    torch.testing.assert_close(dx.double(), dx_ref, atol=1e-6, rtol=1e-4)
    module = ck.CrossEntropyLoss(softcap=cap)
    logits = x.detach()[:, :, None].expand(m, v, 2)  # class dim 1, as torch
    torch.testing.assert_close(module(logits, t[:, None].expand(m, 2)).double(),
                               ref_ce(_capped(x64.detach(), cap).repeat_interleave(2, 0),
                                      t.repeat_interleave(2)), atol=1e-5, rtol=1e-5)


@gpu
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("z", [0.0, 1e-3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_class_weights(reduction, z, dtype):
    m, v = 67, 3001
    x = (torch.randn(m, v, device="cuda") * 3).to(dtype).requires_grad_()
    t = torch.randint(0, v, (m,), device="cuda")
    t[::5] = -100
    w = torch.rand(v, device="cuda") * 2
    loss = ck.cross_entropy(x, t, reduction=reduction, lse_square_scale=z, weight=w)
    x64 = x.detach().double().requires_grad_()
    ref = ref_ce(x64, t, reduction=reduction, z=z, weight=w)
    if not z:  # torch's own weighted loss agrees with the reference
        torch.testing.assert_close(F.cross_entropy(x64, t, weight=w.double(), reduction=reduction), ref)
    torch.testing.assert_close(loss.double(), ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(ref)
    (dx,) = torch.autograd.grad(loss, x, g.float())
    (dx_ref,) = torch.autograd.grad(ref, x64, g)
    (dx_t,) = torch.autograd.grad(F.cross_entropy(x.float(), t, weight=w, reduction=reduction), x, g.float())
    if not z:
        assert (dx.double() - dx_ref).abs().max() <= 2 * (dx_t.double() - dx_ref).abs().max() + 1e-6
    torch.testing.assert_close(dx.double(), dx_ref, atol=2e-3 if dtype != torch.float32 else 1e-6, rtol=1e-2)
    assert (dx[::5] == 0).all()


@gpu
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("z,cap", [(0.0, None), (1e-3, None), (1e-3, 20.0)])
def test_class_weights_with_label_smoothing(reduction, dtype, z, cap):
    # torch's weighted smoothing (each class's smoothing term times its weight, the mean over
    # the counted rows' weights), with the z-loss and the soft cap; more rows than one of the
    # torch passes' chunks, ignored rows
    from cute_kernels.rowwise import cross_entropy_terms

    m, v, eps = 70, 3001, 0.15
    x = (torch.randn(m, v, device="cuda") * 4 + 1).to(dtype).requires_grad_()
    t = torch.randint(0, v, (m,), device="cuda")
    t[::6] = -100
    w = torch.rand(v, device="cuda") * 2
    old = cross_entropy_terms.SMOOTHING_CHUNK
    cross_entropy_terms.SMOOTHING_CHUNK = 16 * v  # several chunks and a ragged last one
    try:
        loss = ck.cross_entropy(x, t, label_smoothing=eps, reduction=reduction, weight=w,
                                lse_square_scale=z, softcap=cap)
        g = torch.rand_like(loss) + 0.5
        (dx,) = torch.autograd.grad(loss, x, g)
    finally:
        cross_entropy_terms.SMOOTHING_CHUNK = old
    x64 = x.detach().double().requires_grad_()
    ref = ref_ce(_capped(x64, cap), t, smoothing=eps, reduction=reduction, z=z, weight=w)
    torch.testing.assert_close(loss.double(), ref, atol=1e-5, rtol=1e-5)
    if not z and not cap:  # torch's own weighted smoothing agrees with the reference
        torch.testing.assert_close(F.cross_entropy(x64, t, weight=w.double(), label_smoothing=eps,
                                                   reduction=reduction), ref)
    (dx_ref,) = torch.autograd.grad(ref, x64, g.double())
    atol = 1e-6 if dtype == torch.float32 else 4e-3 * dx_ref.abs().max().item()
    torch.testing.assert_close(dx.double(), dx_ref, atol=atol, rtol=1e-4 if dtype == torch.float32 else 1e-2)
    assert (dx[::6] == 0).all()


@gpu
def test_class_weights_with_label_smoothing_edge_rows():
    # an out-of-range target gives its row NaN (no out-of-bounds access), the other rows as
    # torch; the module with torch's weight and smoothing arguments
    m, v = 9, 50
    x = torch.randn(m, v, device="cuda", requires_grad=True)
    t = torch.randint(0, v, (m,), device="cuda")
    t[2] = v + 3
    w = torch.rand(v, device="cuda")
    loss = ck.cross_entropy(x, t, label_smoothing=0.1, weight=w, reduction="none")
    assert loss[2].isnan() and not loss[[0, 1, 3, 4, 5, 6, 7, 8]].isnan().any()
    keep = torch.arange(m, device="cuda") != 2
    torch.testing.assert_close(loss[keep], F.cross_entropy(x[keep], t[keep], weight=w,
                                                           label_smoothing=0.1, reduction="none"))
    module = ck.CrossEntropyLoss(weight=w, label_smoothing=0.1)
    torch.testing.assert_close(module(x[keep], t[keep]),
                               F.cross_entropy(x[keep], t[keep], weight=w, label_smoothing=0.1))


@gpu
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_class_weights_under_torch_compile(smoothing):
    x = torch.randn(33, 1000, device="cuda", requires_grad=True)
    t = torch.randint(0, 1000, (33,), device="cuda")
    w = torch.rand(1000, device="cuda")
    f = torch.compile(lambda x, t, w: ck.cross_entropy(x, t, weight=w, label_smoothing=smoothing),
                      fullgraph=True)
    loss = f(x, t, w)
    (dx,) = torch.autograd.grad(loss, x)
    x64 = x.detach().double().requires_grad_()
    ref = ref_ce(x64, t, weight=w, smoothing=smoothing)
    torch.testing.assert_close(loss.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx.double(), torch.autograd.grad(ref, x64)[0], atol=1e-6, rtol=1e-4)


@gpu
def test_class_weights_all_ignored_is_nan_and_bad_weights_raise():
    x = torch.randn(4, 10, device="cuda")
    t = torch.full((4,), -100, device="cuda")
    assert torch.isnan(ck.cross_entropy(x, t, weight=torch.ones(10, device="cuda")))
    with pytest.raises(ck.UnsupportedError, match="weight must have shape"):
        ck.cross_entropy(x, t, weight=torch.ones(9, device="cuda"))
    assert torch.isnan(ck.cross_entropy(x, t, label_smoothing=0.1, weight=torch.ones(10, device="cuda")))
    with pytest.raises(ck.DeviceError):
        ck.cross_entropy(x, t, weight=torch.ones(10))
    module = ck.CrossEntropyLoss(weight=torch.rand(10, device="cuda"))
    t = torch.randint(0, 10, (4,), device="cuda")
    torch.testing.assert_close(module(x, t), F.cross_entropy(x, t, weight=module.weight))


@gpu
def test_all_ignored_and_out_of_range_and_empty():
    x = torch.randn(4, 100, device="cuda", requires_grad=True)
    t = torch.full((4,), -100, device="cuda")
    loss = ck.cross_entropy(x, t)
    assert loss.isnan()  # 0 / 0, as torch
    assert ck.cross_entropy(x, t, reduction="sum").item() == 0.0
    t = torch.tensor([0, 100, -5, 99], device="cuda")
    rows = ck.cross_entropy(x, t, reduction="none")
    assert rows[1].isnan() and rows[2].isnan() and not rows[0].isnan() and not rows[3].isnan()
    empty = ck.cross_entropy(torch.randn(0, 10, device="cuda"), torch.zeros(0, dtype=torch.long, device="cuda"), reduction="sum")
    assert empty.item() == 0.0


@gpu
def test_many_rows_incoming_gradient_and_empty_mean():
    # 2500 rows of 4096 are 1250 row tiles: more than the scaling kernel's capped grid, so its
    # CTAs loop; the count of counted rows (1 / count on the device) spans many threads' strides.
    m, v = 2500, 4096
    x = torch.randn(m, v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, v, (m,), device="cuda")
    t[::3] = -100
    loss = ck.cross_entropy(x, t)
    x64 = x.detach().double().requires_grad_()
    ref = ref_ce(x64, t)
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    (dx,) = torch.autograd.grad(loss * 2.5, x)
    (dx_ref,) = torch.autograd.grad(ref * 2.5, x64)
    (dx_t,) = torch.autograd.grad(F.cross_entropy(x, t) * 2.5, x)
    torch_err = (dx_t.double() - dx_ref).abs().max().item()
    assert (dx.double() - dx_ref).abs().max().item() <= 2 * torch_err + 1e-7
    assert (dx[::3] == 0).all()
    empty = torch.randn(0, 10, device="cuda", requires_grad=True)
    assert ck.cross_entropy(empty, torch.zeros(0, dtype=torch.long, device="cuda")).isnan()


@gpu
def test_nan_inf_logits_and_poisoned_outputs():
    x = torch.randn(6, 3000, device="cuda", dtype=torch.bfloat16)
    x[2, 5] = float("nan")
    x[3, 9] = float("inf")
    t = torch.randint(0, 3000, (6,), device="cuda")
    ours = ck.cross_entropy(x, t, reduction="none")
    theirs = F.cross_entropy(x.float(), t, reduction="none")
    assert torch.equal(ours.isnan(), theirs.isnan())
    loss = torch.full((6,), float("nan"), device="cuda")
    lse = torch.full((6,), float("nan"), device="cuda")
    y = torch.randn(6, 3000, device="cuda", dtype=torch.bfloat16)
    cross_entropy_fwd(y, t, loss, lse, None, None, -100, 0.0, 0.0, 0.0)
    assert not loss.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(lse, torch.logsumexp(y.float(), -1), atol=1e-4, rtol=1e-5)


@gpu
def test_inplace_backward_and_leading_dims_and_int32_targets():
    x = torch.randn(2, 9, 32000, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, 32000, (2, 9), device="cuda", dtype=torch.int32)
    ref_loss = ref_ce(x.reshape(-1, 32000), t.reshape(-1).long())
    x64 = x.double().requires_grad_()
    (dx_ref,) = torch.autograd.grad(ref_ce(x64.reshape(-1, 32000), t.reshape(-1).long()) * 2.0, x64)
    a = x.clone().requires_grad_()
    loss = ck.cross_entropy(a, t, inplace_backward=True)
    (da,) = torch.autograd.grad(loss * 2.0, a)
    b = x.clone().requires_grad_()
    (db,) = torch.autograd.grad(F.cross_entropy(b.reshape(-1, 32000), t.reshape(-1).long()) * 2.0, b)
    assert abs(loss.item() - ref_loss.item()) < 1e-4
    torch_err = (db.double() - dx_ref).abs().max().item()
    assert (da.double() - dx_ref).abs().max().item() <= 2 * torch_err + 1e-6


@gpu
def test_torch_compile_fullgraph_and_module():
    loss_fn = ck.CrossEntropyLoss(label_smoothing=0.1)
    f = torch.compile(lambda x, t: loss_fn(x * 2, t), fullgraph=True)
    x = torch.randn(64, 1000, device="cuda", requires_grad=True)
    t = torch.randint(0, 1000, (64,), device="cuda")
    loss = f(x, t)
    ref = torch.nn.CrossEntropyLoss(label_smoothing=0.1)(x * 2, t)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(torch.autograd.grad(loss, x)[0], torch.autograd.grad(ref, x)[0])
    x3 = torch.randn(4, 10, 7, device="cuda")
    t3 = torch.randint(0, 10, (4, 7), device="cuda")
    torch.testing.assert_close(ck.CrossEntropyLoss()(x3, t3), torch.nn.CrossEntropyLoss()(x3, t3))


@gpu
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fused_linear_cross_entropy(bias, reduction):
    tokens, hidden, vocab = 300, 256, 5000
    h = (torch.randn(tokens, hidden, device="cuda") / 4).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda") / 4).requires_grad_()
    b = torch.randn(vocab, device="cuda", requires_grad=True) if bias else None
    t = torch.randint(0, vocab, (tokens,), device="cuda")
    t[::5] = -100
    loss = ck.fused_linear_cross_entropy(h, w, t, b, reduction=reduction, label_smoothing=0.1,
                                         chunk_size=64)
    params = [h, w] + ([b] if bias else [])
    grads = torch.autograd.grad(loss * 3.0, params)
    p64 = [p.detach().double().requires_grad_() for p in params]
    logits = p64[0] @ p64[1].t() + (p64[2] if bias else 0)
    ref = ref_ce(logits, t, smoothing=0.1, reduction=reduction)
    refs = torch.autograd.grad(ref * 3.0, p64)
    torch.testing.assert_close(loss.double(), ref, atol=1e-4, rtol=1e-4)
    for g, r in zip(grads, refs):
        assert (g.double() - r).abs().max().item() <= 2e-3 * r.abs().max().item() + 1e-6


@gpu
@pytest.mark.parametrize("dynamic", [False, None], ids=["static", "automatic"])
def test_fused_linear_cross_entropy_under_torch_compile(dynamic):
    # one compiled function (fullgraph) over changing batch, sequence and vocabulary sizes, with
    # and without a bias and label smoothing (both gradient paths): loss and gradients
    # bit-identical to eager
    def f(h, w, t, b, smoothing):
        return ck.fused_linear_cross_entropy(h, w, t, b, label_smoothing=smoothing)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)
    cases = [((2, 100), 4096, False, 0.0), ((3, 77), 4096, True, 0.0), ((1, 1), 4096, False, 0.0),
             ((5, 64), 3001, True, 0.1), ((2, 300), 3001, False, 0.1)]
    for (batch, seq), vocab, bias, smoothing in cases:
        h = torch.randn(batch, seq, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(vocab, 256, device="cuda", dtype=torch.bfloat16) / 8).requires_grad_()
        b = torch.randn(vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True) if bias else None
        t = torch.randint(0, vocab, (batch, seq), device="cuda")
        t[:, 1::7] = -100
        params = [h, w] + ([b] if bias else [])
        with torch._dynamo.config.patch(recompile_limit=len(cases)):
            loss = compiled(h, w, t, b, smoothing)
        got = torch.autograd.grad(loss * 1.5, params)
        ref = f(h, w, t, b, smoothing)
        want = torch.autograd.grad(ref * 1.5, params)
        torch.testing.assert_close(loss, ref, atol=0, rtol=0)
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, atol=0, rtol=0)


@gpu
def test_fused_linear_cross_entropy_bf16_matches_unfused():
    tokens, hidden, vocab = 1000, 512, 32000
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) / 16).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device="cuda")
    loss = ck.FusedLinearCrossEntropyLoss()(h, w, t)
    dh, dw = torch.autograd.grad(loss, [h, w])
    h64, w64 = (p.detach().double().requires_grad_() for p in (h, w))
    ref = ref_ce(h64 @ w64.t(), t)
    rh, rw = torch.autograd.grad(ref, [h64, w64])
    assert abs(loss.item() - ref.item()) < 2e-2
    assert (dh.double() - rh).abs().max().item() <= 2e-2 * rh.abs().max().item()
    assert (dw.double() - rw).abs().max().item() <= 2e-2 * rw.abs().max().item()


@gpu
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("tokens,hidden,vocab", [(333, 256, 5003), (2000, 64, 3001)])
def test_fused_linear_cross_entropy_weight_grad_by_vocab_slices(monkeypatch, bias, reduction, tokens,
                                                                hidden, vocab):
    # bf16 without smoothing takes the vocabulary-slice pass for the weight gradient when a
    # chunk of 1024 tokens' logits does not fit a quarter of the free memory (forced): several
    # slices, a ragged last one, an odd vocabulary, ignored rows, an incoming gradient != 1.
    # 333 x 256 x 5003: slices whose logits live in the weight gradient's unwritten rows, then
    # the separate buffer; 2000 x 64 x 3001: too many tokens for that, the buffer only.
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) / 8).requires_grad_()
    b = torch.randn(vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True) if bias else None
    t = torch.randint(0, vocab, (tokens,), device="cuda")
    t[::7] = -100
    _force_the_slice_pass(monkeypatch, vocab)
    z = 1e-2 if bias else 0.0  # the z-loss's gradient in the slices, from the stored lse
    cap = 2.0 if bias else None  # the soft cap in the slices' gradient kernel too
    loss = ck.fused_linear_cross_entropy(h, w, t, b, reduction=reduction, chunk_size=64,
                                         lse_square_scale=z, softcap=cap)
    params = [h, w] + ([b] if bias else [])
    grads = torch.autograd.grad(loss * 2.5, params)
    p64 = [p.detach().double().requires_grad_() for p in params]
    ref = ref_ce(_capped(p64[0] @ p64[1].t() + (p64[2] if bias else 0), cap), t,
                 reduction=reduction, z=z)
    refs = torch.autograd.grad(ref * 2.5, p64)
    assert abs(loss.item() - ref.item()) <= 1e-2 * abs(ref.item()) + 1e-3
    for g, r in zip(grads, refs):
        assert not g.isnan().any()
        assert (g.double() - r).abs().max().item() <= 2e-2 * r.abs().max().item()


def _force_the_slice_pass(monkeypatch, vocab):
    from cute_kernels.losses import fused_linear_cross_entropy as flce

    free = 4 * flce.ACCUMULATE_ROWS * vocab * 2 - 1  # a chunk of 1024 bf16 rows just misses
    monkeypatch.setattr(flce, "_free_bytes", lambda device: free)


def _extra_peak_memory(h, w, t):
    torch.autograd.grad(ck.fused_linear_cross_entropy(h, w, t), [h, w])  # cuBLAS workspace etc.
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    dh, dw = torch.autograd.grad(ck.fused_linear_cross_entropy(h, w, t), [h, w])
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base  # before the checks' own temporaries
    assert not dh.isnan().any() and not dw.isnan().any()
    return extra


@gpu
@pytest.mark.parametrize("slices", [False, True], ids=["accumulate", "slices"])
def test_fused_linear_cross_entropy_peak_memory(monkeypatch, slices):
    # Accumulating: the gradients and one chunk of 1024 tokens' logits. The slice pass: the
    # logits live in the weight gradient's unwritten storage; only the last narrow slices take
    # a buffer of their own (at most 1024 columns per token).
    tokens, hidden, vocab = 4096, 1024, 32003
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) / 32).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device="cuda")
    if slices:
        _force_the_slice_pass(monkeypatch, vocab)
    extra = _extra_peak_memory(h, w, t)
    gradients = 2 * (vocab * hidden + tokens * hidden)
    buffer = 2 * tokens * 1024 if slices else 1024 * vocab * 2
    assert extra <= gradients + buffer + (1 << 20), (extra, gradients, buffer)


@gpu
@pytest.mark.parametrize("bias", [False, True])
def test_fused_linear_cross_entropy_per_token_losses(bias):
    # reduction "none": (batch, seq) losses, a per-token incoming gradient (as a weighted or
    # masked loss has), chunks of 1024 and a tail, smoothing and z-loss, ignored tokens (0)
    b_, s_, hidden, vocab = 3, 700, 128, 3001
    h = torch.randn(b_, s_, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) / 8).requires_grad_()
    b = torch.randn(vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True) if bias else None
    t = torch.randint(0, vocab, (b_, s_), device="cuda")
    t[:, ::6] = -100
    loss = ck.fused_linear_cross_entropy(h, w, t, b, reduction="none", label_smoothing=0.05,
                                         lse_square_scale=1e-3)
    assert loss.shape == t.shape and loss.dtype == torch.float32
    assert (loss[t == -100] == 0).all()
    dloss = torch.rand(b_, s_, device="cuda")
    params = [h, w] + ([b] if bias else [])
    grads = torch.autograd.grad(loss, params, dloss)
    p64 = [p.detach().double().requires_grad_() for p in params]
    logits = p64[0].reshape(-1, hidden) @ p64[1].t() + (p64[2] if bias else 0)
    ref = ref_ce(logits, t.reshape(-1), smoothing=0.05, z=1e-3, reduction="none").reshape(t.shape)
    refs = torch.autograd.grad(ref, p64, dloss.double())
    assert (loss.double() - ref).abs().max().item() <= 2e-2
    for g, r in zip(grads, refs):
        assert not g.isnan().any()
        assert (g.double() - r).abs().max().item() <= 2e-2 * r.abs().max().item()


@gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_linear_cross_entropy_softcap(reduction, dtype):
    # Gemma 2's final logit soft-capping: logits well past the cap (the derivative near 0),
    # chunks of 1024 and a tail, a bias, ignored tokens
    tokens, hidden, vocab, cap = 1300, 256, 4001, 5.0
    h = (torch.randn(tokens, hidden, device="cuda", dtype=dtype) * 2).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", dtype=dtype) / 4).requires_grad_()
    b = torch.randn(vocab, device="cuda", dtype=dtype, requires_grad=True)
    t = torch.randint(0, vocab, (tokens,), device="cuda")
    t[::3] = -100
    loss = ck.fused_linear_cross_entropy(h, w, t, b, reduction=reduction, softcap=cap)
    upstream = torch.rand_like(loss) + 0.5
    grads = torch.autograd.grad(loss, [h, w, b], upstream)
    p64 = [p.detach().double().requires_grad_() for p in (h, w, b)]
    ref = ref_ce(_capped(p64[0] @ p64[1].t() + p64[2], cap), t, reduction=reduction)
    refs = torch.autograd.grad(ref, p64, upstream.double())
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert (loss.double() - ref).abs().max().item() <= tolerance * ref.abs().max().item()
    for g, r in zip(grads, refs):
        assert not g.isnan().any()
        assert (g.double() - r).abs().max().item() <= tolerance * r.abs().max().item()


@gpu
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing,cap", [(0.0, None), (0.1, None), (0.1, 3.0)])
def test_fused_linear_cross_entropy_class_weights(reduction, smoothing, cap):
    # per-class weights (F.cross_entropy's ``weight``): weighted tokens, the weighted mean,
    # z-loss weighted with its row, ignored tokens, an incoming gradient != 1; with label
    # smoothing torch's weighted smoothing (chunks of 1024 and a tail), also under a soft cap
    tokens, hidden, vocab = 1500, 128, 2003
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) / 8).requires_grad_()
    b = torch.randn(vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cw = torch.rand(vocab, device="cuda") + 0.1
    t = torch.randint(0, vocab, (tokens,), device="cuda")
    t[::4] = -100
    loss = ck.fused_linear_cross_entropy(h, w, t, b, reduction=reduction, lse_square_scale=1e-3,
                                         ce_weight=cw, label_smoothing=smoothing, softcap=cap)
    upstream = torch.rand_like(loss) + 0.5
    grads = torch.autograd.grad(loss, [h, w, b], upstream)
    p64 = [p.detach().double().requires_grad_() for p in (h, w, b)]
    ref = ref_ce(_capped(p64[0] @ p64[1].t() + p64[2], cap), t, reduction=reduction, z=1e-3,
                 weight=cw.double(), smoothing=smoothing)
    refs = torch.autograd.grad(ref, p64, upstream.double())
    assert (loss.double() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()
    for g, r in zip(grads, refs):
        assert not g.isnan().any()
        assert (g.double() - r).abs().max().item() <= 2e-2 * r.abs().max().item()


@gpu
@pytest.mark.parametrize("smoothing,z", [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-2)])
def test_fused_linear_cross_entropy_default_chunks_against_float64(smoothing, z):
    # The default plan with memory to spare: chunks of 1024 tokens and a 4-token tail, the
    # weight gradient accumulated over five chunks, an odd vocabulary, ignored rows
    tokens, hidden, vocab = 4100, 256, 5003
    h = (torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) + 0.5).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) / 8).requires_grad_()
    b = torch.randn(vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, vocab, (tokens,), device="cuda")
    t[::9] = -100
    loss = ck.fused_linear_cross_entropy(h, w, t, b, label_smoothing=smoothing, lse_square_scale=z)
    grads = torch.autograd.grad(loss * 0.75, [h, w, b])
    p64 = [p.detach().double().requires_grad_() for p in (h, w, b)]
    ref = ref_ce(p64[0] @ p64[1].t() + p64[2], t, smoothing=smoothing, z=z)
    refs = torch.autograd.grad(ref * 0.75, p64)
    assert abs(loss.item() - ref.item()) <= 1e-2 * abs(ref.item())
    for g, r in zip(grads, refs):
        assert not g.isnan().any()
        assert (g.double() - r).abs().max().item() <= 2e-2 * r.abs().max().item()


@gpu
def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, 10, device="cuda")
    t = torch.zeros(4, dtype=torch.long, device="cuda")
    with pytest.raises(ck.UnsupportedError, match="target"):
        ck.cross_entropy(x, torch.zeros(5, dtype=torch.long, device="cuda"))
    with pytest.raises(ck.DTypeError, match="target"):
        ck.cross_entropy(x, t.float())
    with pytest.raises(ck.UnsupportedError, match="reduction"):
        ck.cross_entropy(x, t, reduction="avg")
    with pytest.raises(ck.UnsupportedError, match="label_smoothing"):
        ck.cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(ck.DeviceError, match="target"):
        ck.cross_entropy(x, t.cpu())
    with pytest.raises(ck.UnsupportedError, match="weight"):
        ck.fused_linear_cross_entropy(x, torch.randn(7, 11, device="cuda"), t)
    with pytest.raises(ck.UnsupportedError, match="reduction"):
        ck.fused_linear_cross_entropy(x, torch.randn(7, 10, device="cuda"), t, reduction="avg")
    with pytest.raises(ck.UnsupportedError, match="ce_weight"):
        ck.fused_linear_cross_entropy(x, torch.randn(7, 10, device="cuda"), t,
                                      ce_weight=torch.ones(6, device="cuda"))
    with pytest.raises(ck.UnsupportedError, match="softcap"):
        ck.fused_linear_cross_entropy(x, torch.randn(7, 10, device="cuda"), t, softcap=-1.0)
    for cap in (0.0, True, "30", float("nan")):
        with pytest.raises(ck.UnsupportedError, match="softcap"):
            ck.cross_entropy(x, t, softcap=cap)
    with pytest.raises(ck.UnsupportedError, match="rows|row length|long"):
        ck.cross_entropy(torch.randn(1, 262145, device="cuda"), t[:1], softcap=30.0)
