"""int8 quantization and the int8 GEMM.

Quantization is bit-exact against ``quantize_int8_ref`` (the rule the kernel implements, in
float32 torch operations). The int32 GEMM is exactly ``torch._int_mm``'s product (and the
float64 one); scaled and zero-point products are checked against float64 with the error bound
of rounding the exact value to the output dtype (half an ulp) plus the fp32 epilogue's few ulps.
"""

import pytest
import torch

import cute_kernels as ck
from cute_kernels.reference import dequantize_int8_ref, gemm_int8_ref, quantize_int8_ref

gpu = pytest.mark.gpu


def codes(*shape, lo=-128, hi=127):
    return torch.randint(lo, hi + 1, shape, device="cuda", dtype=torch.int8)


# ---------------------------------------------------------------- no GPU needed


def test_reference_quantize_rule_on_cpu():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, float("nan"), 1.0, 1.0]])
    q, scale, zero = quantize_int8_ref(x, "row", symmetric=True)
    assert zero is None and scale.shape == (3, 1)
    assert q[0].tolist() == [64, -127, 32, 0]  # 63.5 rounds half to even
    assert scale[1].item() == 0 and q[1].tolist() == [0, 0, 0, 0]
    assert torch.isnan(scale[2]).item() and q[2].tolist() == [0, 0, 0, 0]
    q, scale, zero = quantize_int8_ref(x[:1], "row", symmetric=False)
    assert scale.item() == pytest.approx(3.0 / 255)
    # the range [-2, 1] maps to [-128, 127]; 0 is exactly the zero point
    assert q[0, 1].item() == -128 and q[0, 3].item() == zero.item()
    assert (dequantize_int8_ref(q, scale, zero) - x[:1].double()).abs().max() <= scale.item() / 2 + 1e-6


def test_launch_plans_only_when_the_vectors_are_the_given_ones_flattened():
    from cute_kernels.quant.int8 import _flat_views_of_given

    scale = torch.rand(8, 1)
    sums = torch.zeros(8, dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int32)
    assert _flat_views_of_given((scale, None, None, None), (scale.view(-1), None, None, None))
    # column sums computed by gemm_int8 (none given), a zero point expanded, a copy: no plan
    assert not _flat_views_of_given((None, None, zero, None), (None, None, zero, sums))
    assert not _flat_views_of_given((None, None, zero, sums), (None, None, zero.expand(8), sums))
    strided = torch.rand(8, 2)[:, 0]
    assert not _flat_views_of_given((strided,), (strided.contiguous(),))


def test_gemm_int8_validates_before_any_kernel_runs():
    if not torch.cuda.is_available():
        with pytest.raises(ck.DeviceError):
            ck.gemm_int8(torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4, 16, dtype=torch.int8))
        return
    a, b = codes(8, 32), codes(16, 32)
    with pytest.raises(ck.DTypeError, match="a_q has dtype"):
        ck.gemm_int8(a.float(), b)
    with pytest.raises(ck.UnsupportedError, match="K differ"):
        ck.gemm_int8(a, codes(16, 48))
    with pytest.raises(ck.UnsupportedError, match="b_q must be K-major.*contiguous"):
        ck.gemm_int8(a, codes(32, 16).t())
    with pytest.raises(ck.UnsupportedError, match="a_q must be K-major"):
        ck.gemm_int8(codes(32, 8).t(), b)
    with pytest.raises(ck.UnsupportedError, match="scale_a must hold 1 or 8"):
        ck.gemm_int8(a, b, scale_a=torch.ones(7, device="cuda"))
    with pytest.raises(ck.DTypeError, match="scale_b has dtype"):
        ck.gemm_int8(a, b, scale_b=torch.ones(16, device="cuda", dtype=torch.float16))
    with pytest.raises(ck.UnsupportedError, match="exact integer product"):
        ck.gemm_int8(a, b, scale_a=torch.ones(8, device="cuda"), out_dtype=torch.int32)
    with pytest.raises(ck.UnsupportedError, match="granularity"):
        ck.quantize_int8(torch.ones(4, 4, device="cuda"), granularity="block")


# ---------------------------------------------------------------- GPU


ROW_SHAPES = [(1, 1), (3, 17), (64, 4096), (1000, 1000), (7, 8192), (2, 100003), (4, 131072),
              (5, 3, 96)]


@gpu
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_quantize_rows_bit_exact(shape, dtype, symmetric):
    # Far from zero mean, with a wide spread of row magnitudes.
    x = (torch.randn(shape, device="cuda") * torch.rand(*shape[:-1], 1, device="cuda") * 30 + 3).to(dtype)
    q, scale, zero = ck.quantize_int8(x, "row", symmetric=symmetric)
    q_ref, scale_ref, zero_ref = quantize_int8_ref(x, "row", symmetric)
    assert q.shape == x.shape and scale.shape == (*shape[:-1], 1)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q, q_ref)
    if symmetric:
        assert zero is None
    else:
        assert torch.equal(zero, zero_ref)


@gpu
@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_rows_special_values(symmetric):
    x = torch.randn(6, 512, device="cuda", dtype=torch.bfloat16)
    x[1] = 0  # scale 0
    x[2, 7] = float("nan")
    x[3, 100] = float("inf")
    x[4, 0] = -float("inf")
    x[5] = 1e-37  # a subnormal scale whose inverse overflows to inf: codes saturate
    x = x.float()
    q, scale, zero = ck.quantize_int8(x, "row", symmetric=symmetric)
    q_ref, scale_ref, zero_ref = quantize_int8_ref(x, "row", symmetric)
    assert torch.equal(q, q_ref)
    assert torch.equal(scale.isnan(), scale_ref.isnan()) and scale[2:5].isnan().all()
    assert torch.equal(scale.nan_to_num(), scale_ref.nan_to_num())
    assert scale[1].item() == 0
    deq = ck.dequantize_int8(q, scale, zero)
    assert deq[2:5].isnan().all() and deq[1].eq(0).all()
    if not symmetric:
        assert torch.equal(zero, zero_ref)


@gpu
def test_quantize_rows_strided_and_misaligned_rows():
    base = torch.randn(33, 1030, device="cuda", dtype=torch.bfloat16)
    for x in (base[:, 3:1027], base[::2, :1024], base[:, 1:]):
        q, scale, _ = ck.quantize_int8(x)
        q_ref, scale_ref, _ = quantize_int8_ref(x)
        assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


@gpu
@pytest.mark.parametrize("granularity", ["tensor", "column"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_tensor_and_column_round_trip(granularity, symmetric):
    x = torch.randn(300, 129, device="cuda") * 4 - 1
    q, scale, zero = ck.quantize_int8(x, granularity, symmetric=symmetric)
    assert scale.shape == ((1, 129) if granularity == "column" else ())
    deq = dequantize_int8_ref(q, scale, zero)
    half_step = scale.double() / 2
    assert ((deq - x.double()).abs() <= half_step * (1 + 1e-6) + 1e-12).all()
    # the largest magnitude lands on the end of the code range
    dims = (0,) if granularity == "column" else (0, 1)
    if symmetric:
        assert q.abs().amax(dim=dims).eq(127).all()
    else:
        assert q.amax(dim=dims).eq(127).all() and q.amin(dim=dims).eq(-128).all()


@gpu
@pytest.mark.parametrize("shape", [(1, 4096, 4096), (17, 1000, 777), (333, 1000, 768), (128, 256, 128),
                                   (1000, 1, 64), (1, 1, 16), (257, 383, 4104), (4096, 4096, 4096)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gemm_int8_int32_equals_int_mm(shape):
    m, n, k = shape
    a, b = codes(m, k), codes(n, k)
    ours = ck.gemm_int8(a, b)
    assert ours.dtype == torch.int32 and ours.shape == (m, n)
    exact = (a.double() @ b.double().t()).to(torch.int64)
    assert torch.equal(ours.to(torch.int64), exact)
    if m > 16 and k % 8 == 0 and n % 8 == 0:  # torch._int_mm's own constraints
        assert torch.equal(ours, torch._int_mm(a, b.t()))


@gpu
def test_gemm_int8_extreme_codes_and_tails():
    m, n, k = 130, 260, 8200  # K not a multiple of the 128-wide k-tile, M / N tails
    a = torch.full((m, k), -128, device="cuda", dtype=torch.int8)
    b = torch.full((n, k), -128, device="cuda", dtype=torch.int8)
    assert ck.gemm_int8(a, b).eq(128 * 128 * k).all()
    a[:, ::2] = 127
    expect = (a.double() @ b.double().t()).to(torch.int64)
    assert torch.equal(ck.gemm_int8(a, b).to(torch.int64), expect)


@gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 4096, 4096), (77, 3000, 1024), (1024, 1024, 1000), (2048, 512, 4096)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gemm_int8_scaled_with_bias(shape, out_dtype):
    m, n, k = shape
    a, b = codes(m, k), codes(n, k)
    scale_a = torch.rand(m, device="cuda") * 1e-2 + 1e-4
    scale_b = torch.rand(n, 1, device="cuda") * 1e-2 + 1e-4
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 10
    ours = ck.gemm_int8(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)
    ref = gemm_int8_ref(a, b, scale_a, scale_b, bias=bias)
    # fp32 epilogue: the int32 -> fp32 conversion and two products round (a few fp32 ulps) on
    # top of the output rounding; the bias adds one more rounding of its magnitude.
    acc_ulps = (gemm_int8_ref(a, b).abs() * scale_a.double()[:, None] * scale_b.double().reshape(1, -1)) * 4 * 2 ** -24
    err = (ours.double() - ref).abs()
    ulp = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2 ** -24}[out_dtype]
    bound = ref.abs() * ulp + acc_ulps + bias.double().abs() * 2 ** -24 + 1e-6
    assert (err <= bound).all(), (err.max().item(), (err / bound).max().item())


@gpu
def test_gemm_int8_per_tensor_scales():
    a, b = codes(300, 512), codes(200, 512)
    sa, sb = torch.tensor(0.01, device="cuda"), torch.tensor([0.003], device="cuda")
    ours = ck.gemm_int8(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    ref = gemm_int8_ref(a, b, sa, sb)
    assert ((ours.double() - ref).abs() <= ref.abs() * 4 * 2 ** -24 + 1e-9).all()


@gpu
@pytest.mark.parametrize("shape", [(1, 4096, 4096), (129, 1000, 777), (2048, 2048, 2048)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gemm_int8_zero_point_exact_and_scaled(shape):
    m, n, k = shape
    x = torch.randn(m, k, device="cuda") * 3 + 5  # far from zero mean: asymmetric pays
    a, scale_a, zero = ck.quantize_int8(x, "row", symmetric=False)
    b = codes(n, k, lo=-127)
    # int32: exact
    ours = ck.gemm_int8(a, b, zero_point_a=zero)
    exact = ((a.double() - zero.double()) @ b.double().t()).to(torch.int64)
    assert ours.dtype == torch.int32 and torch.equal(ours.to(torch.int64), exact)
    # scaled, with the column sums given and computed
    scale_b = torch.rand(n, device="cuda") * 1e-2
    ref = gemm_int8_ref(a, b, scale_a, scale_b, zero_point_a=zero)
    for sums in (None, b.sum(1, dtype=torch.int32)):
        got = ck.gemm_int8(a, b, scale_a=scale_a, scale_b=scale_b, zero_point_a=zero, b_sums=sums,
                           out_dtype=torch.float32)
        assert ((got.double() - ref).abs() <= ref.abs() * 4 * 2 ** -24 + 1e-9).all()


@gpu
def test_gemm_int8_empty_and_k_zero():
    assert ck.gemm_int8(codes(0, 32), codes(5, 32)).shape == (0, 5)
    assert ck.gemm_int8(codes(3, 32), codes(0, 32)).shape == (3, 0)
    bias = torch.randn(5, device="cuda")
    out = ck.gemm_int8(codes(3, 0), codes(5, 0), scale_a=torch.ones(3, device="cuda"), bias=bias)
    assert torch.equal(out, bias.to(torch.bfloat16).expand(3, 5))
    assert ck.gemm_int8(codes(3, 0), codes(5, 0)).eq(0).all()


@gpu
@pytest.mark.parametrize("asymmetric", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_linear_matches_its_quantized_math(dtype, asymmetric):
    linear = torch.nn.Linear(1024, 3000, device="cuda", dtype=dtype)
    layer = ck.Int8Linear.from_float(linear, asymmetric=asymmetric)
    x = (torch.randn(4, 33, 1024, device="cuda") + (2 if asymmetric else 0)).to(dtype)
    y = layer(x)
    assert y.shape == (4, 33, 3000) and y.dtype == dtype
    # the same quantization in float64: exact up to the output rounding
    q, s, z = quantize_int8_ref(x.reshape(-1, 1024), "row", not asymmetric)
    wq, ws, _ = quantize_int8_ref(linear.weight, "row", True)
    ref = gemm_int8_ref(q, wq, s, ws, z, linear.bias.float()).reshape(4, 33, 3000)
    ulp = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -11
    err = (y.double() - ref).abs()
    assert (err <= ref.abs() * ulp + 1e-3).all(), err.max().item()
    # and close to the float layer (int8 quantization error)
    full = linear(x).double()
    rel = (y.double() - full).norm() / full.norm()
    assert rel < 0.02, rel.item()


@gpu
def test_int8_ops_under_torch_compile():
    linear = torch.nn.Linear(512, 256, device="cuda", dtype=torch.bfloat16)
    layer = ck.Int8Linear.from_float(linear)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True)
    assert torch.equal(compiled(x), layer(x))


@gpu
def test_gemm_int8_repeated_calls_take_the_launch_plan_and_stay_correct():
    from cute_kernels.quant import int8 as int8_op

    a, b = codes(64, 256), codes(96, 256)
    sa, sb = torch.rand(64, device="cuda"), torch.rand(96, device="cuda")
    first = ck.gemm_int8(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    plans = len(int8_op._plans)
    a2, b2 = codes(64, 256), codes(96, 256)
    again = ck.gemm_int8(a2, b2, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    assert len(int8_op._plans) == plans  # the same plan, no new entry
    for out, (x, y) in ((first, (a, b)), (again, (a2, b2))):
        ref = gemm_int8_ref(x, y, sa, sb)
        assert ((out.double() - ref).abs() <= ref.abs() * 4 * 2 ** -24 + 1e-9).all()
    # a misaligned view of the same shape falls back to the checked path (copies), still right
    buf = codes(64 * 256 + 16)
    view = buf[1:1 + 64 * 256].view(64, 256)
    ref = gemm_int8_ref(view, b, sa, sb)
    out = ck.gemm_int8(view, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    assert ((out.double() - ref).abs() <= ref.abs() * 4 * 2 ** -24 + 1e-9).all()


@gpu
def test_int8_linear_launch_plan_matches_the_checked_path():
    linear = torch.nn.Linear(256, 200, device="cuda", dtype=torch.bfloat16)
    for asymmetric in (False, True):
        layer = ck.Int8Linear.from_float(linear, asymmetric=asymmetric)
        for shape in ((3, 5, 256), (1, 256), (64, 256)):
            first = layer(torch.randn(shape, device="cuda", dtype=torch.bfloat16))  # checked, plans
            x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) + 1
            planned = layer(x)
            layer._plans.clear()
            assert torch.equal(planned, layer(x)) and planned.shape == first.shape
        # a misaligned input of a planned signature falls back to the checked path
        buf = torch.randn(64 * 256 + 8, device="cuda", dtype=torch.bfloat16)
        layer(buf[:64 * 256].view(64, 256))
        odd = buf[1:1 + 64 * 256].view(64, 256)
        layer._plans.clear()
        expect = layer(odd.clone())
        layer(buf[:64 * 256].view(64, 256))  # plan again
        assert torch.equal(layer(odd), expect)
