"""RMSNorm and LayerNorm forward and backward against float64 references.

Tolerance rule: our max error against the float64 reference is at most twice torch's error in
the same precision (F.rms_norm / F.layer_norm on the same inputs) plus a small floor.
"""

import pytest
import torch
import torch.nn.functional as F

import cute_kernels as ck
from cute_kernels.rowwise.config import row_config
from cute_kernels.reference import layer_norm_ref, rms_norm_ref

gpu = pytest.mark.gpu
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FLOOR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
HIDDEN = [1, 7, 192, 760, 1128, 4096, 8192, 65536]


def rows_for(n):
    return max(1, min(65, 1_000_000 // n))


def err(a, ref):
    return (a.double() - ref).abs().max().item() if ref.numel() else 0.0


def check(ours, theirs, ref, dtype, scale=1.0):
    assert ours.shape == ref.shape and ours.dtype == theirs.dtype
    assert err(ours, ref) <= 2 * err(theirs, ref) + FLOOR[dtype] * scale, (err(ours, ref), err(theirs, ref))


def torch_norm(layer_norm, x, w, b, eps, residual):
    h = x if residual is None else x + residual
    if layer_norm:
        return F.layer_norm(h, (x.shape[-1],), w, b, eps), h
    return F.rms_norm(h, (x.shape[-1],), w, eps), h


def ref_norm(layer_norm, x, w, b, eps, residual):
    if layer_norm:
        return layer_norm_ref(x, w, b, eps, residual)
    return rms_norm_ref(x, w, eps, residual)


def ck_norm(layer_norm, x, w, b, eps, residual):
    if layer_norm:
        return ck.layer_norm(x, w, b, eps=eps, residual=residual)
    return ck.rms_norm(x, w, eps=eps, residual=residual)


# ---------------------------------------------------------------- no GPU needed


def test_cpu_tensor_is_refused():
    with pytest.raises(ck.DeviceError):
        ck.rms_norm(torch.randn(4, 8), torch.ones(8))


def test_backward_row_limit():
    from cute_kernels.rowwise.norm_op import backward_rows, long_row_stages

    assert backward_rows(131072, 8, 2).num_threads == 256
    long = backward_rows(262144, 8, 2)
    assert (long.num_threads, long.cluster_n, long.elems_per_thread) == (512, 16, 32)
    with pytest.raises(ck.UnsupportedError, match="row length"):
        backward_rows(262145, 1, 2)
    assert long_row_stages(long, 2, 2, True, True) == 1
    assert long_row_stages(long, 2, 2, True, False) == 2
    with pytest.raises(ck.UnsupportedError, match="weight and bias"):
        long_row_stages(long, 4, 4, True, True)


def test_backward_launch_shapes():
    from cute_kernels.rowwise.norm_op import backward_ctas_per_sm, backward_rows

    def shape(n):
        rows = backward_rows(n, 8, 2)
        return rows.threads_per_row, rows.num_threads, rows.cluster_n

    assert shape(1024) == (32, 256, 1)  # short rows share a 256-thread CTA
    assert shape(4096) == (128, 128, 1)
    assert shape(16384) == (128, 128, 4)
    assert shape(65536) == (128, 128, 16)
    assert shape(131072) == (256, 256, 16)  # one 256-thread CTA per SM, 16 per row
    rows = backward_rows(16384, 8, 2)
    assert backward_ctas_per_sm(rows, 2, 2, residual=False) == 3  # split rows: three per SM
    assert backward_ctas_per_sm(rows, 2, 2, residual=True) == 2  # registers for dh
    assert backward_ctas_per_sm(backward_rows(4096, 8, 2), 2, 2, residual=False) == 2  # one-CTA rows
    assert backward_ctas_per_sm(backward_rows(16384, 8, 4), 4, 4, residual=False) == 2  # fp32: shared memory
    assert backward_ctas_per_sm(backward_rows(131072, 8, 2), 2, 2, residual=False) == 1


def test_forward_launch_shapes():
    from cute_kernels.rowwise.norm_op import _build_forward

    bf16 = torch.bfloat16

    def config(n, layer_norm, residual=None):
        key = (bf16, residual, bf16, bf16 if layer_norm else None, bf16, residual, layer_norm, 0, 0.0, n)
        return _build_forward(key, 8)[1]

    rms, ln = config(131072, False), config(131072, True)
    assert (rms.row.cluster_n, rms.row.elems_per_thread, rms.stage_x) == (16, 32, False)
    assert (ln.row.cluster_n, ln.row.elems_per_thread, ln.one_exchange, ln.stage_affine) == (8, 64, True, True)
    assert config(131072, False, bf16).row.cluster_n == 16  # with a residual too
    assert config(65536, False).row.cluster_n == 4  # only rows of 8 CTAs are split further
    ln = config(65536, True)  # LayerNorm: 32 values per thread while that takes <= 8 CTAs
    assert (ln.row.cluster_n, ln.row.elems_per_thread, ln.one_exchange, ln.stage_affine) == (8, 32, True, True)
    assert config(100000, True).stage_x  # an uneven split stages x instead
    weight_only = _build_forward((bf16, None, bf16, None, bf16, None, True, 0, 0.0, 131072), 8)[1]
    assert weight_only.one_exchange and weight_only.stage_affine
    plain = _build_forward((bf16, None, None, None, bf16, None, True, 0, 0.0, 131072), 8)[1]
    assert plain.one_exchange and not plain.stage_affine  # nothing to copy
    assert not config(16384, True).one_exchange  # rows of one CTA keep their path
    with_residual = config(65536, True, bf16)  # a residual keeps the late-affine path
    assert not (with_residual.stage_x or with_residual.one_exchange or with_residual.stage_affine)


def test_references_agree_with_torch():
    x, w, b = torch.randn(3, 10, dtype=torch.float64), torch.randn(10, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-6), F.rms_norm(x, (10,), w, 1e-6))
    torch.testing.assert_close(layer_norm_ref(x, w, b, 1e-5), F.layer_norm(x, (10,), w, b, 1e-5))


# ---------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize("layer_norm", [False, True], ids=["rms", "ln"])
@pytest.mark.parametrize("n", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_and_backward(layer_norm, n, dtype):
    m = rows_for(n)
    x = (torch.randn(m, n, device="cuda", dtype=dtype) * 2 + 0.5).requires_grad_()
    w = (torch.randn(n, device="cuda", dtype=dtype)).requires_grad_()
    b = torch.randn(n, device="cuda", dtype=dtype).requires_grad_() if layer_norm else None
    y = ck_norm(layer_norm, x, w, b, 1e-5, None)
    y_t, _ = torch_norm(layer_norm, x, w, b, 1e-5, None)
    ref = ref_norm(layer_norm, x.detach(), w.detach(), None if b is None else b.detach(), 1e-5, None)
    check(y, y_t, ref, dtype)
    dy = torch.randn_like(y)
    inputs = [x, w] + ([b] if b is not None else [])
    ours = torch.autograd.grad(y, inputs, dy)
    theirs = torch.autograd.grad(y_t, inputs, dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    refs = torch.autograd.grad(ref_norm(layer_norm, x64, w64, b64, 1e-5, None),
                               [x64, w64] + ([b64] if b is not None else []), dy.double())
    for name, o, t, r in zip(("dx", "dw", "db"), ours, theirs, refs):
        scale = 1.0 if name == "dx" else max(1.0, m ** 0.5)
        check(o, t, r, dtype, scale)


@gpu
@pytest.mark.parametrize("n", [32768, 65536, 100000, 131072, 262144])
def test_layer_norm_split_rows_far_from_zero_mean(n):
    # Rows split over a cluster reduce merged moments in one exchange (x in registers and the
    # weight and bias bulk-copied to shared memory when the split is even; 100000: x staged,
    # with padding); a mean 40 standard deviations from 0 tests the merge's stability.
    x = torch.randn(3, n, device="cuda", dtype=torch.bfloat16) * 0.5 + 20
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = ck.layer_norm(x, w, b)
    y_t = F.layer_norm(x, (n,), w, b)
    check(y, y_t, ref_norm(True, x, w, b, 1e-5, None), torch.bfloat16)


@gpu
def test_layer_norm_issue_rows_mean_far_above_std():
    # fp32 rows of 769 values 1000 + row * 100 + ((col % 17) - 8) / 8 (std ~0.6): padding
    # columns must not enter the centred sums (they once added (0 - mean)^2 and took it out
    # again, losing every digit of the variance).
    m, n = 3, 769
    col = torch.arange(n, device="cuda", dtype=torch.float32)
    row = torch.arange(m, device="cuda", dtype=torch.float32)[:, None]
    x = (1000 + row * 100 + ((col % 17) - 8) / 8).requires_grad_()
    w = torch.randn(n, device="cuda").requires_grad_()
    b = torch.randn(n, device="cuda").requires_grad_()
    y = ck.layer_norm(x, w, b)
    y_t = F.layer_norm(x, (n,), w, b)
    x64 = x.detach().double().requires_grad_()
    ref = layer_norm_ref(x64, w.detach(), b.detach())
    check(y, y_t, ref, torch.float32)
    assert (y.double() - ref).abs().max().item() < 1e-4
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    (dx_t,) = torch.autograd.grad(y_t, x, dy)
    (dx_ref,) = torch.autograd.grad(ref, x64, dy.double())
    check(dx, dx_t, dx_ref, torch.float32)


@gpu
@pytest.mark.parametrize("layer_norm", [False, True], ids=["rms", "ln"])
@pytest.mark.parametrize("n", [1, 7, 769, 1128, 4100, 16383, 32768, 100000])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sigmas", [1e2, 1e4])
def test_mean_far_from_zero_every_path(layer_norm, n, dtype, sigmas):
    # Means 1e2 and 1e4 standard deviations from 0 over row lengths that reach every forward
    # path (one CTA, split rows staged or in registers, odd tails): the output, the saved
    # statistics and the gradients stay within twice torch's error.
    m = max(1, min(8, 400_000 // n))
    x = (torch.randn(m, n, device="cuda", dtype=torch.float32) + sigmas).to(dtype).requires_grad_()
    w = torch.randn(n, device="cuda", dtype=dtype).requires_grad_()
    b = torch.randn(n, device="cuda", dtype=dtype).requires_grad_() if layer_norm else None
    y = ck_norm(layer_norm, x, w, b, 1e-5, None)
    y_t, _ = torch_norm(layer_norm, x, w, b, 1e-5, None)
    x64 = x.detach().double().requires_grad_()
    ref = ref_norm(layer_norm, x64, w.detach(), None if b is None else b.detach(), 1e-5, None)
    check(y, y_t, ref, dtype)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    (dx_t,) = torch.autograd.grad(y_t, x, dy)
    (dx_ref,) = torch.autograd.grad(ref, x64, dy.double())
    check(dx, dx_t, dx_ref, dtype)


def _rms_grads(y, inputs, dy):
    return torch.autograd.grad(y, [t for t in inputs if t is not None], dy)


def _check_rms_options(x, w, b, residual, offset, residual_out_dtype, dtype):
    """Forward and gradients of ck.rms_norm with these options against the float64 reference;
    the tolerance scale comes from the same computation in x's precision by torch."""
    kwargs = dict(bias=b, weight_offset=offset, residual_out_dtype=residual_out_dtype)
    out = ck.rms_norm(x, w, 1e-6, residual, **kwargs)
    y, h = out if residual is not None else (out, None)
    leaves = [x, w, b, residual]
    leaves64 = [None if t is None else t.detach().double().requires_grad_() for t in leaves]
    ref = rms_norm_ref(leaves64[0], leaves64[1], 1e-6, leaves64[3], leaves64[2], offset)
    # torch in x's precision: the same formula, fp32 math for 16-bit inputs as torch's own.
    low = [None if t is None else t.detach().float().requires_grad_() for t in leaves]
    y_t = rms_norm_ref(low[0], low[1], 1e-6, low[3], low[2], offset).float().to(y.dtype)
    check(y, y_t, ref, dtype)
    if h is not None:
        assert h.dtype == (residual_out_dtype or residual.dtype)
        torch.testing.assert_close(h.double(), x.double() + residual.double(), atol=1e-2, rtol=1e-2)
    dy = torch.randn_like(y)
    ours = _rms_grads(y, leaves, dy)
    refs = _rms_grads(ref, leaves64, dy.double())
    for o, r in zip(ours, refs):
        bound = 2e-2 * r.abs().max().item() + 1e-3 if dtype != torch.float32 else 1e-4 * r.abs().max().item() + 1e-5
        assert (o.double() - r).abs().max().item() <= bound, ((o.double() - r).abs().max().item(), bound)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("w_dtype", [None, torch.float32])
@pytest.mark.parametrize("heads,d", [(1, 128), (8, 64), (32, 128), (3, 100), (16, 256)])
def test_rms_norm_per_head_weight(dtype, w_dtype, heads, d):
    # QK-norm: x (B, S, H, D), weight (H, D): each head normalized on its own with its own
    # weight row; gradients of the (H, D) weight summed per head.
    x = torch.randn(2, 37, heads, d, device="cuda", dtype=dtype).requires_grad_()
    w = torch.randn(heads, d, device="cuda", dtype=w_dtype or dtype).requires_grad_()
    _check_rms_options(x, w, None, None, 0.0, None, dtype)


@gpu
@pytest.mark.parametrize("n", [7, 128, 4096, 16384])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_bias_offset_and_residual_out_dtype(n, dtype):
    m = 33
    x = torch.randn(m, n, device="cuda", dtype=dtype).requires_grad_()
    w = (torch.randn(n, device="cuda", dtype=torch.float32) * 0.1).requires_grad_()
    b = torch.randn(n, device="cuda", dtype=dtype).requires_grad_()
    r = torch.randn(m, n, device="cuda", dtype=dtype).requires_grad_()
    _check_rms_options(x, w, b, None, 1.0, None, dtype)          # Gemma: x_hat * (1 + w) + b
    _check_rms_options(x, w, None, r, 0.0, torch.float32, dtype)  # fp32 residual stream
    _check_rms_options(x, w, b, r, -0.5, None, dtype)


@gpu
def test_rms_norm_per_head_bias_offset_and_compile():
    x = torch.randn(4, 9, 8, 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
    b = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
    _check_rms_options(x, w, b, None, 1.0, None, torch.bfloat16)
    f = torch.compile(lambda x, w, b: ck.rms_norm(x, w, bias=b, weight_offset=1.0), fullgraph=True)
    torch.testing.assert_close(f(x, w, b), ck.rms_norm(x, w, bias=b, weight_offset=1.0))


@gpu
def test_rms_norm_new_options_refuse_bad_input():
    x = torch.randn(4, 8, 64, device="cuda")
    with pytest.raises(ck.UnsupportedError, match="per-head"):
        ck.rms_norm(x, torch.ones(4, 64, device="cuda"))
    with pytest.raises(ck.UnsupportedError, match="reshape"):
        ck.rms_norm(x, torch.ones(1, 8, 64, device="cuda"))
    with pytest.raises(ck.UnsupportedError, match="needs a weight"):
        ck.rms_norm(x, weight_offset=1.0)
    with pytest.raises(ck.UnsupportedError, match="needs a residual"):
        ck.rms_norm(x, residual_out_dtype=torch.float32)
    with pytest.raises(ck.DTypeError, match="residual_out_dtype"):
        ck.rms_norm(x, residual=x, residual_out_dtype=torch.int32)
    with pytest.raises(ck.UnsupportedError, match="weight_offset"):
        ck.rms_norm(x, torch.ones(64, device="cuda"), weight_offset=float("nan"))


@gpu
@pytest.mark.parametrize("layer_norm", [False, True], ids=["rms", "ln"])
@pytest.mark.parametrize("n,dtype", [(150000, torch.bfloat16), (262144, torch.bfloat16),
                                     (262144, torch.float16), (262144, torch.float32)])
def test_long_rows_backward(layer_norm, n, dtype):
    # Rows over 131072 with gradients: 16 CTAs of 512 threads, the dw / db accumulators in
    # shared memory (fp32 LayerNorm rows with a bias gradient stop at 131072).
    m = 5
    x = (torch.randn(m, n, device="cuda", dtype=dtype) + 3).requires_grad_()
    w = torch.randn(n, device="cuda", dtype=dtype).requires_grad_()
    b = None
    if layer_norm and dtype != torch.float32:
        b = torch.randn(n, device="cuda", dtype=dtype).requires_grad_()
    y = ck_norm(layer_norm, x, w, b, 1e-5, None)
    y_t, _ = torch_norm(layer_norm, x, w, b, 1e-5, None)
    leaves = [t for t in (x, w, b) if t is not None]
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    ref = ref_norm(layer_norm, leaves64[0], leaves64[1], leaves64[2] if b is not None else None, 1e-5, None)
    check(y, y_t, ref, dtype)
    dy = torch.randn_like(y)
    for name, o, t, r in zip(("dx", "dw", "db"), torch.autograd.grad(y, leaves, dy),
                             torch.autograd.grad(y_t, leaves, dy),
                             torch.autograd.grad(ref, leaves64, dy.double())):
        check(o, t, r, dtype, 1.0 if name == "dx" else m ** 0.5)
    if layer_norm and dtype == torch.float32:
        bias = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
        with pytest.raises(ck.UnsupportedError, match="weight and bias"):
            ck.layer_norm(x, w, bias)


@gpu
def test_saved_statistics_match_torch_when_mean_dominates():
    from cute_kernels.rowwise.norm_op import norm_fwd

    for n in (769, 4096, 100000):
        col = torch.arange(n, device="cuda", dtype=torch.float32)
        x = 1000 + 100 * torch.arange(4, device="cuda", dtype=torch.float32)[:, None] + ((col % 17) - 8) / 8
        y = torch.empty_like(x)
        rstd, mean = (torch.full((4,), float("nan"), device="cuda") for _ in range(2))
        norm_fwd(x, None, None, None, y, None, rstd, mean, 1e-5, True)
        x64 = x.double()
        torch.testing.assert_close(mean.double(), x64.mean(-1), rtol=1e-5, atol=0)
        torch.testing.assert_close(rstd.double(), torch.rsqrt(x64.var(-1, unbiased=False) + 1e-5),
                                   rtol=1e-5, atol=0)


@gpu
@pytest.mark.parametrize("n", [65536, 131072])
@pytest.mark.parametrize("affine", ["weight", "bias", "none"])
def test_layer_norm_split_rows_partial_affine(n, affine):
    # The one-exchange path with a weight only, a bias only (one bulk copy) and neither.
    x = (torch.randn(3, n, device="cuda", dtype=torch.bfloat16) + 3).requires_grad_()
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16).requires_grad_() if affine == "weight" else None
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16).requires_grad_() if affine == "bias" else None
    y = ck.layer_norm(x, w, b)
    y_t = F.layer_norm(x, (n,), w, b)
    check(y, y_t, layer_norm_ref(x.detach(), None if w is None else w.detach(), None if b is None else b.detach(),
                                 1e-5), torch.bfloat16)
    dy = torch.randn_like(y)
    inputs = [t for t in (x, w, b) if t is not None]
    ours = torch.autograd.grad(y, inputs, dy)
    theirs = torch.autograd.grad(y_t, inputs, dy)
    doubles = [t.detach().double().requires_grad_() for t in inputs]
    x64 = doubles[0]
    w64 = doubles[1] if w is not None else None
    b64 = doubles[1] if b is not None else None
    refs = torch.autograd.grad(layer_norm_ref(x64, w64, b64, 1e-5), doubles, dy.double())
    for i, (o, t, r) in enumerate(zip(ours, theirs, refs)):
        check(o, t, r, torch.bfloat16, 1.0 if i == 0 else 3 ** 0.5)


@gpu
def test_layer_norm_split_rows_write_every_output():
    from cute_kernels.rowwise.norm_op import norm_fwd

    m, n = 5, 131072
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w, b = (torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    y = torch.full_like(x, float("nan"))
    rstd, mean = (torch.full((m,), float("nan"), device="cuda") for _ in range(2))
    norm_fwd(x, None, w, b, y, None, rstd, mean, 1e-5, True)
    check(y, F.layer_norm(x, (n,), w, b), ref_norm(True, x, w, b, 1e-5, None), torch.bfloat16)
    xf = x.double()
    torch.testing.assert_close(mean.double(), xf.mean(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd.double(), torch.rsqrt(xf.var(-1, unbiased=False) + 1e-5), rtol=1e-4, atol=1e-4)
    # A weight 2 bytes off 16-byte alignment cannot be bulk-copied: narrower vectors, same result.
    w_odd = torch.empty(n + 1, device="cuda", dtype=torch.bfloat16)[1:].copy_(w)
    check(ck.layer_norm(x, w_odd, b), F.layer_norm(x, (n,), w, b), ref_norm(True, x, w, b, 1e-5, None), torch.bfloat16)


@gpu
@pytest.mark.parametrize("layer_norm", [False, True], ids=["rms", "ln"])
@pytest.mark.parametrize("residual_dtype", [torch.bfloat16, torch.float32])
def test_residual(layer_norm, residual_dtype):
    m, n = 50, 3000
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(m, n, device="cuda", dtype=residual_dtype, requires_grad=True)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True) if layer_norm else None
    y, h = ck_norm(layer_norm, x, w, b, 1e-6, r)
    assert h.dtype == residual_dtype and y.dtype == torch.bfloat16
    torch.testing.assert_close(h.double(), (x.double() + r.double()).to(residual_dtype).double())
    ref = ref_norm(layer_norm, x.detach(), w.detach(), None if b is None else b.detach(), 1e-6, r.detach())
    assert err(y, ref) < 0.05
    dy, dh = torch.randn_like(y), torch.randn_like(h)
    inputs = [x, r, w] + ([b] if b is not None else [])
    grads = torch.autograd.grad([y, h], inputs, [dy, dh])
    x64, r64, w64 = (t.detach().double().requires_grad_() for t in (x, r, w))
    b64 = None if b is None else b.detach().double().requires_grad_()
    y64 = ref_norm(layer_norm, x64, w64, b64, 1e-6, r64)
    h64 = x64 + r64
    refs = torch.autograd.grad([y64, h64], [x64, r64, w64] + ([b64] if b is not None else []),
                               [dy.double(), dh.double()])
    for g, rg in zip(grads, refs):
        assert (g.double() - rg).abs().max().item() <= 0.03 * rg.abs().max().item() + 0.05


@gpu
def test_no_weight_and_fp32_weight_and_out_dtype():
    x = torch.randn(33, 1000, device="cuda", dtype=torch.float16, requires_grad=True)
    y = ck.rms_norm(x)
    check(y, F.rms_norm(x, (1000,)), rms_norm_ref(x.detach()), torch.float16)
    w = torch.randn(1000, device="cuda", dtype=torch.float32, requires_grad=True)
    y = ck.rms_norm(x, w, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    assert err(y, rms_norm_ref(x.detach(), w.detach())) < 1e-3
    dw = torch.autograd.grad(y.sum(), w)[0]
    assert dw.dtype == torch.float32


@gpu
def test_weight_gradient_is_deterministic():
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    first = torch.autograd.grad(ck.rms_norm(x, w), [x, w], dy)
    for _ in range(3):
        again = torch.autograd.grad(ck.rms_norm(x, w), [x, w], dy)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@gpu
@pytest.mark.parametrize("b,rows,n", [(1, 1, 4), (2, 7, 132), (1, 396, 4096), (2, 1000, 4100), (2, 28, 131072)])
def test_column_sum_of_partials(b, rows, n):
    from cute_kernels.rowwise.norm_op import column_sum

    part = torch.randn(b, rows, n + 4, device="cuda")[:, :, :n]  # padded rows, as the backward's
    out = torch.full((b, n), float("nan"), device="cuda")
    column_sum(part, out)
    ref = part.double().sum(1)
    assert (out.double() - ref).abs().max().item() <= 1e-5 * rows ** 0.5 * (1 + ref.abs().max().item())
    again = torch.empty_like(out)
    column_sum(part, again)
    assert torch.equal(out, again)
    part[b - 1, rows // 2, n // 2] = float("nan")
    column_sum(part, out)
    assert out[b - 1, n // 2].isnan() and not out[b - 1, : n // 2].isnan().any()


@gpu
def test_max_active_clusters_is_within_the_device():
    # The persistent backward's grid comes from it: at most what the SMs hold, nearly every
    # SM for pairs.
    from cute_kernels.runtime.arch import max_active_clusters, sm_count

    sms = sm_count(0)
    for cluster, per_sm in ((1, 3), (2, 1), (4, 3), (16, 1)):
        clusters = max_active_clusters(0, cluster, per_sm)
        assert 1 <= clusters <= sms * per_sm // cluster, (cluster, per_sm, clusters)
    assert max_active_clusters(0, 2, 1) >= sms // 2 - 2  # pairs of SMs: nearly all of them


@gpu
@pytest.mark.parametrize("m", [0, 1])
def test_tiny_batches(m):
    x = torch.randn(m, 512, device="cuda", requires_grad=True)
    w = torch.randn(512, device="cuda", requires_grad=True)
    y = ck.layer_norm(x, w)
    assert y.shape == (m, 512)
    dx, dw = torch.autograd.grad(y, [x, w], torch.ones_like(y))
    assert dx.shape == x.shape and dw.shape == w.shape
    if m == 0:
        assert (dw == 0).all()


@gpu
def test_outputs_poisoned_with_nan_are_fully_written_and_nan_propagates():
    from cute_kernels.rowwise.norm_op import norm_fwd

    x = torch.randn(37, 1128, device="cuda", dtype=torch.bfloat16)
    y = torch.full_like(x, float("nan"))
    rstd = torch.full((37,), float("nan"), device="cuda")
    norm_fwd(x, None, None, None, y, None, rstd, None, 1e-6, False)
    assert not y.isnan().any() and not rstd.isnan().any()
    x[5, 17] = float("nan")
    x[9, 3] = float("inf")
    y = ck.rms_norm(x)
    assert y[5].isnan().all() and y[9].isnan().any()
    assert not y[torch.arange(37, device="cuda") != 5][[0, 1, 2]].isnan().any()


@gpu
def test_leading_dims_multidim_weight_and_non_contiguous():
    x = torch.randn(4, 6, 8, 96, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8, 96, device="cuda", dtype=torch.bfloat16)
    check(ck.layer_norm(x, w), F.layer_norm(x, (8, 96), w), layer_norm_ref(x, w), torch.bfloat16)
    module = ck.RMSNorm((8, 96), eps=1e-6).cuda()
    with torch.no_grad():
        module.weight.normal_()
    theirs = F.rms_norm(x.float(), (8, 96), module.weight, 1e-6).to(torch.bfloat16)
    check(module(x), theirs, F.rms_norm(x.double(), (8, 96), module.weight.double(), 1e-6),
          torch.bfloat16)
    xt = torch.randn(768, 40, device="cuda", dtype=torch.bfloat16).t()
    check(ck.layer_norm(xt), F.layer_norm(xt, (768,)), layer_norm_ref(xt), torch.bfloat16)
    xs = torch.randn(40, 770, device="cuda", dtype=torch.bfloat16)[:, 1:769]
    check(ck.layer_norm(xs), F.layer_norm(xs, (768,)), layer_norm_ref(xs), torch.bfloat16)


@gpu
def test_torch_compile_fullgraph():
    def f(x, w, b, r):
        y, h = ck.layer_norm(x, w, b, residual=r)
        return ck.rms_norm(y, w) + h

    compiled = torch.compile(f, fullgraph=True)
    x, r = (torch.randn(64, 1024, device="cuda", requires_grad=True) for _ in range(2))
    w, b = (torch.randn(1024, device="cuda", requires_grad=True) for _ in range(2))
    out = compiled(x, w, b, r)
    torch.testing.assert_close(out, f(x, w, b, r))
    g1 = torch.autograd.grad(out.sum(), [x, w, b, r])
    g2 = torch.autograd.grad(f(x, w, b, r).sum(), [x, w, b, r])
    for a, e in zip(g1, g2):
        torch.testing.assert_close(a, e, atol=1e-3, rtol=1e-3)


@gpu
@pytest.mark.parametrize("dynamic", [False, None, True], ids=["static", "automatic", "dynamic"])
@pytest.mark.parametrize("layer_norm", [False, True], ids=["rms", "ln"])
def test_torch_compile_across_changing_shapes(layer_norm, dynamic):
    # one compiled function called with changing batch and row lengths, per-row and per-head
    # weights and a changing eps: static graphs per shape, or symbolic sizes and eps (torch's
    # automatic dynamic after the first change, or dynamic=True); forward and backward
    # bit-identical to eager
    def f(x, w, eps):
        return ck.layer_norm(x, w, eps=eps) if layer_norm else ck.rms_norm(x, w, eps=eps)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)
    cases = [((3, 256), (256,)), ((199, 256), (256,)), ((37, 1024), (1024,)),
             ((8192, 1024), (1024,)), ((5, 4096), (4096,)), ((1, 65536), (65536,))]
    if not layer_norm:
        cases += [((7, 4, 64), (4, 64)), ((9, 4, 64), (4, 64)), ((2, 16, 4, 64), (4, 64)),
                  ((1, 1, 32, 128), (32, 128))]
    for i, (shape, wshape) in enumerate(cases):
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(wshape, device="cuda", dtype=torch.float32, requires_grad=True)
        dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        eps = (1e-5, 1e-6)[i % 2]
        with torch._dynamo.config.patch(recompile_limit=len(cases)):
            out = compiled(x, w, eps)
        got = torch.autograd.grad(out, [x, w], dy)
        ref = f(x, w, eps)
        want = torch.autograd.grad(ref, [x, w], dy)
        torch.testing.assert_close(out, ref, atol=0, rtol=0)
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e, atol=0, rtol=0)


@gpu
def test_modules_are_drop_in():
    for ours, theirs in ((ck.RMSNorm(256, eps=1e-6), torch.nn.RMSNorm(256, eps=1e-6)),
                         (ck.LayerNorm(256), torch.nn.LayerNorm(256))):
        theirs = theirs.cuda()
        ours = ours.cuda()
        assert ours.state_dict().keys() == theirs.state_dict().keys()
        with torch.no_grad():
            for p in theirs.parameters():
                p.normal_()
        ours.load_state_dict(theirs.state_dict())
        x = torch.randn(8, 256, device="cuda")
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)


@gpu
def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, 64, device="cuda")
    with pytest.raises(ck.UnsupportedError, match="weight"):
        ck.rms_norm(x, torch.ones(32, device="cuda"))
    with pytest.raises(ck.DTypeError, match="weight"):
        ck.rms_norm(x, torch.ones(64, device="cuda", dtype=torch.int32))
    with pytest.raises(ck.DeviceError, match="weight"):
        ck.rms_norm(x, torch.ones(64))
    with pytest.raises(ck.UnsupportedError, match="residual"):
        ck.rms_norm(x, residual=torch.ones(4, 63, device="cuda"))
    with pytest.raises(ck.UnsupportedError, match="eps"):
        ck.layer_norm(x, eps=-1.0)
    with pytest.raises(ck.DTypeError, match="x"):
        ck.layer_norm(x.double())
