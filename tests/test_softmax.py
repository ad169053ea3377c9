"""Softmax forward and backward against float64 references.

Tolerance rule: the kernel's max error against the float64 reference may be at most twice the
error of torch's own softmax in the same precision, plus a small floor for the fp32 case.
"""

import math

import pytest
import torch

import cute_kernels as ck
from cute_kernels.rowwise.config import row_config
from cute_kernels.rowwise.softmax_op import softmax_bwd, softmax_fwd
from cute_kernels.reference import softmax_backward_ref, softmax_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FLOOR = {torch.float32: 2e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}
AWKWARD_N = [1, 7, 192, 760, 1128, 4096, 65536, 262144]


def rows_for(n: int) -> int:
    return max(1, min(67, 2_000_000 // n))


def assert_close_to_ref(ours, torch_result, ref, dtype):
    assert ours.shape == ref.shape
    if ref.numel() == 0:
        return
    ours_err = (ours.double() - ref).abs().max().item()
    torch_err = (torch_result.double() - ref).abs().max().item()
    assert ours_err <= 2 * torch_err + FLOOR[dtype], (ours_err, torch_err)


# ---------------------------------------------------------------- no GPU needed


def test_cpu_tensor_is_refused():
    with pytest.raises(ck.DeviceError, match="CUDA tensor"):
        ck.softmax(torch.randn(4, 8))


def test_row_config_refuses_rows_too_long():
    with pytest.raises(ck.UnsupportedError, match="row length 524289"):
        row_config(524289, 1, 2)
    with pytest.raises(ck.UnsupportedError, match="row length 262145"):
        row_config(262145, 1, 2, tensors_held=2)


@pytest.mark.parametrize("n", [1, 7, 64, 65, 760, 3072, 4096, 16384, 16385, 131072, 262144, 524288])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_row_config_tiles_every_column_once(n, itemsize):
    vec = 16 // itemsize
    while n % vec:
        vec //= 2
    for held in (1, 2):
        if n > 524288 // held:
            continue
        c = row_config(n, vec, itemsize, tensors_held=held)
        assert c.num_threads % c.threads_per_row == 0 and c.num_threads % 32 == 0
        assert c.cols_per_cta * c.cluster_n >= n  # covers the row
        assert c.cols_per_cta * (c.cluster_n - 1) < n  # no CTA of the cluster is empty
        assert c.elems_per_thread <= 128 // held
        assert c.threads_per_row <= 32 or c.threads_per_row % 32 == 0


def test_reference_backward_matches_autograd():
    x = torch.randn(5, 9, dtype=torch.float64, requires_grad=True)
    y = torch.softmax(x, -1)
    dy = torch.randn_like(y)
    y.backward(dy)
    torch.testing.assert_close(softmax_backward_ref(y.detach(), dy), x.grad)


# ---------------------------------------------------------------- GPU


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("n", AWKWARD_N)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward(n, dtype):
    x = torch.randn(rows_for(n), n, device="cuda", dtype=dtype) * 3
    y = ck.softmax(x)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close_to_ref(y, torch.softmax(x, -1), softmax_ref(x), dtype)
    sums = y.double().sum(-1)
    assert (sums - 1).abs().max().item() < 0.01 * math.sqrt(n / 1000 + 1)


@gpu
@pytest.mark.parametrize("n", AWKWARD_N)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward(n, dtype):
    x = torch.randn(rows_for(n), n, device="cuda", dtype=dtype, requires_grad=True)
    y = ck.softmax(x)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    x_t = x.detach().clone().requires_grad_()
    (dx_t,) = torch.autograd.grad(torch.softmax(x_t, -1), x_t, dy)
    ref = softmax_backward_ref(softmax_ref(x.detach()), dy)
    assert dx.dtype == dtype
    assert_close_to_ref(dx, dx_t, ref, dtype)


@gpu
@pytest.mark.parametrize("n", [7, 4096, 131072])
def test_outputs_poisoned_with_nan_are_fully_written(n):
    m = 33
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    y = torch.full_like(x, float("nan"))
    softmax_fwd(x, y)
    assert not y.isnan().any()
    dy = torch.randn_like(x)
    dx = torch.full_like(x, float("nan"))
    softmax_bwd(y, dy, dx)
    assert not dx.isnan().any()


@gpu
def test_writes_stay_inside_the_output():
    n, m = 1128, 5
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    buffer = torch.full((m + 2, n + 16), 7.0, device="cuda", dtype=torch.bfloat16)
    out = buffer[1 : m + 1, 8 : n + 8]
    softmax_fwd(x, out)
    assert torch.equal(buffer[0], torch.full_like(buffer[0], 7.0))
    assert torch.equal(buffer[-1], torch.full_like(buffer[-1], 7.0))
    assert (buffer[:, :8] == 7).all() and (buffer[:, n + 8 :] == 7).all()
    torch.testing.assert_close(out.float(), torch.softmax(x.float(), -1), atol=4e-3, rtol=0)


@gpu
@pytest.mark.parametrize("m", [0, 1])
def test_tiny_batches(m):
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    y = ck.softmax(x)
    assert y.shape == (m, 4096)
    assert_close_to_ref(y, torch.softmax(x, -1), softmax_ref(x), torch.bfloat16)


@gpu
def test_empty_row_and_scalar():
    assert ck.softmax(torch.randn(3, 0, device="cuda")).shape == (3, 0)
    s = ck.softmax(torch.tensor(2.5, device="cuda"), dim=0)
    assert s.shape == () and s.item() == 1.0


@gpu
def test_nan_and_inf_rows_follow_torch():
    x = torch.randn(6, 1000, device="cuda")
    x[0, 3] = float("nan")
    x[1, 10] = float("inf")
    x[2] = float("-inf")
    x[3, :999] = float("-inf")  # one finite entry: a one-hot row
    x[4, 5] = float("-inf")
    ours, ref = ck.softmax(x), torch.softmax(x, -1)
    assert torch.equal(ours.isnan(), ref.isnan())
    finite = ~ref.isnan()
    torch.testing.assert_close(ours[finite], ref[finite], atol=1e-6, rtol=1e-5)
    assert ours[3, 999].item() == 1.0


@gpu
@pytest.mark.parametrize("n", [65536, 262144])
def test_nan_in_one_cta_of_a_cluster_poisons_the_whole_row(n):
    x = torch.randn(3, n, device="cuda", dtype=torch.bfloat16)
    x[1, n - 5] = float("nan")
    y = ck.softmax(x)
    assert y[1].isnan().all() and not y[0].isnan().any() and not y[2].isnan().any()


@gpu
@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_any_dim_and_leading_dims(dim):
    x = torch.randn(6, 10, 36, device="cuda", dtype=torch.float16)
    y = ck.softmax(x, dim=dim)
    assert_close_to_ref(y, torch.softmax(x, dim), softmax_ref(x, dim), torch.float16)
    x.requires_grad_()
    dy = torch.randn_like(x)
    (dx,) = torch.autograd.grad(ck.softmax(x, dim=dim), x, dy)
    (dx_t,) = torch.autograd.grad(torch.softmax(x, dim), x, dy)
    torch.testing.assert_close(dx, dx_t, atol=2e-3, rtol=2e-2)


@gpu
def test_non_contiguous_and_misaligned_inputs():
    base = torch.randn(40, 2 * 1128 + 3, device="cuda", dtype=torch.bfloat16)
    for x in (base[:, 1:1129], base[:, ::2][:, :1128], base[::3, 3:1131], base.t()[:1128].t()):
        y = ck.softmax(x)
        assert_close_to_ref(y, torch.softmax(x, -1), softmax_ref(x), torch.bfloat16)


@gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_out_dtype(out_dtype):
    x = torch.randn(50, 3000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = ck.softmax(x, out_dtype=out_dtype)
    assert y.dtype == out_dtype
    ref = softmax_ref(x.detach())
    err = (y.double() - ref).abs().max().item()
    assert err < (2e-6 if out_dtype == torch.float32 else 1e-3)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert dx.dtype == torch.bfloat16
    ref_dx = softmax_backward_ref(y.detach(), dy)
    assert (dx.double() - ref_dx).abs().max().item() < 2e-2 * ref_dx.abs().max().item()


@gpu
def test_gradient_of_a_sum_uses_expanded_grad():
    x = torch.randn(16, 512, device="cuda", requires_grad=True)
    (dx,) = torch.autograd.grad(ck.softmax(x).sum(), x)
    assert dx.abs().max().item() < 1e-6  # d/dx of sum(softmax) is zero


@gpu
def test_torch_compile_fullgraph():
    def f(x):
        return ck.softmax(x * 2.0, dim=-1).sum(-1) + ck.softmax(x, dim=0)[:, 0]

    compiled = torch.compile(f, fullgraph=True)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = compiled(x)
    torch.testing.assert_close(out, f(x), atol=1e-2, rtol=1e-2)
    (dx,) = torch.autograd.grad(out.float().sum(), x)
    (dx_e,) = torch.autograd.grad(f(x).float().sum(), x)
    torch.testing.assert_close(dx, dx_e, atol=1e-2, rtol=1e-2)
    x2 = torch.randn(7, 4096, device="cuda", dtype=torch.bfloat16)  # another batch size
    torch.testing.assert_close(compiled(x2), f(x2), atol=1e-2, rtol=1e-2)


@gpu
def test_new_batch_size_does_not_recompile():
    from cute_kernels.runtime import KERNELS

    ck.softmax(torch.randn(3, 2048, device="cuda"))
    before = KERNELS.stats.compiles + KERNELS.stats.disk_loads
    for m in (1, 5, 1000, 4097):
        ck.softmax(torch.randn(m, 2048, device="cuda"))
    assert KERNELS.stats.compiles + KERNELS.stats.disk_loads == before


@gpu
def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ck.DTypeError, match="int32"):
        ck.softmax(torch.ones(4, 4, device="cuda", dtype=torch.int32))
    with pytest.raises(ck.UnsupportedError, match="dim=2"):
        ck.softmax(torch.randn(4, 4, device="cuda"), dim=2)
    with pytest.raises(ck.DTypeError, match="out_dtype"):
        ck.softmax(torch.randn(4, 4, device="cuda"), out_dtype=torch.int8)
    with pytest.raises(ck.DTypeError, match="float64"):
        ck.softmax(torch.randn(4, 4, device="cuda", dtype=torch.float64))
    with pytest.raises(ck.UnsupportedError, match="row length"):
        ck.softmax(torch.randn(1, 524289 + 7, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(1, 262144 + 8, device="cuda", requires_grad=True)
    with pytest.raises(ck.UnsupportedError, match="row length"):
        ck.softmax(x)


@gpu
def test_misaligned_call_after_an_aligned_one_falls_back_to_narrower_vectors():
    n = 2048
    base = torch.randn(16, n + 8, device="cuda", dtype=torch.bfloat16)
    for x in (base[:, :n], base[:, 1 : n + 1], base[:, :n]):  # aligned, misaligned, aligned
        assert_close_to_ref(ck.softmax(x), torch.softmax(x, -1), softmax_ref(x), torch.bfloat16)
