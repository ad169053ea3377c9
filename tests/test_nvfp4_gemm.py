"""NVFP4 products on the GPU against float64 references of the exactly decoded operands:
``gemm_w4a16`` (bf16 / fp16 activations), ``gemm_nvfp4`` / ``gemv_nvfp4`` / ``nvfp4_dual_gemm``
(both operands NVFP4; rtol = atol = 1e-3 as the public NVFP4 problems), the one-kernel
dequantize (bit-exact), ``NVFP4Linear``; both scale layouts, tails, batches, both paths (skinny
and decoded), NaN-poisoned outputs, input checks, torch.compile."""

import pytest
import torch

import cute_kernels as ck
from cute_kernels.quant.formats import nvfp4_dequantize_ref, to_blocked
from cute_kernels.quant.nvfp4_gemm import skinny_plan
from cute_kernels.quant.nvfp4_skinny_sm90 import SkinnyGemmNvfp4Sm90

gpu = pytest.mark.gpu


def random_nvfp4(rows, k, layout="plain", batch=None, scale_range=(0x18, 0x58), nan_scales=False):
    """(packed uint8, scales e4m3 in ``layout``, float64 values): codes uniform over all 16,
    scales uniform over e4m3 bytes in ``scale_range`` (2^-4 .. 2^4 by default)."""
    shape = (rows, k // 2) if batch is None else (batch, rows, k // 2)
    packed = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")
    sshape = shape[:-1] + (k // 16,)
    scales = torch.randint(*scale_range, sshape, dtype=torch.uint8, device="cuda")
    if nan_scales:
        scales.view(-1)[:: 97] = 0x7F
    scales = scales.view(torch.float8_e4m3fn)
    flat = scales.reshape(-1, rows, k // 16)
    values = torch.stack([nvfp4_dequantize_ref(p, s, 1.0).double()
                          for p, s in zip(packed.reshape(-1, rows, k // 2), flat)])
    if batch is None:
        values = values[0]
    if layout == "blocked":
        scales = torch.stack([to_blocked(s) for s in flat]) if batch else to_blocked(scales)
    return packed, scales, values


def torch_error_bound(x, w_values, expected, dtype):
    """2x the error of the same product computed by torch in ``dtype`` (fp32 accumulation),
    plus a small absolute term."""
    torch_out = torch.matmul(x.to(dtype), w_values.to(dtype).t()).double()
    return 2 * (torch_out - expected).abs().max().item() + 1e-3 * expected.abs().max().item() + 1e-6


# ---------------------------------------------------------------- no GPU needed


def test_nvfp4_products_check_devices_before_any_kernel():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    packed = torch.zeros(8, 32, dtype=torch.uint8)
    scales = torch.zeros(8, 4, dtype=torch.float8_e4m3fn)
    with pytest.raises(ck.DeviceError, match="x"):
        ck.gemm_w4a16(x, packed, scales)
    with pytest.raises(ck.DeviceError, match="a"):
        ck.gemm_nvfp4(packed, packed, scales, scales)
    with pytest.raises(ck.UnsupportedError, match="scale_layout"):
        ck.gemm_nvfp4(packed, packed, scales, scales, scale_layout="swizzled")
    with pytest.raises(ck.DTypeError, match="out_dtype"):
        ck.gemm_nvfp4(packed, packed, scales, scales, out_dtype=torch.int8)
    with pytest.raises(ck.UnsupportedError, match="x must be"):
        ck.gemv_nvfp4(packed, packed, scales, scales)


# ---------------------------------------------------------------- W4A16


W4A16_SHAPES = [  # (M, N, K): skinny (M <= 64, K % 32 == 0) and decoded paths, tails
    (1, 4096, 4096), (1, 100, 96), (3, 257, 160), (16, 1000, 1024), (17, 128, 32),
    (33, 320, 512), (64, 2048, 256), (65, 300, 128), (200, 1024, 512), (8, 64, 48), (40, 96, 16),
    (1, 1000, 4064), (2, 300, 2080),  # two steps per ring stage, an odd count per range of K, a K tail
    (5, 1000, 4096), (8, 2048, 2048), (6, 300, 8224),  # 5-8 rows streamed (x_rows 8), a K tail
    (5, 4096, 32768),  # 5-8 rows on the ring (the streaming grid past a wave over long ranges)
    (1, 7000, 2016), (2, 3000, 4160),  # streaming: one long range / split, tails
]


@gpu
@pytest.mark.parametrize("m,n,k", W4A16_SHAPES)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("layout", ("plain", "blocked"))
def test_gemm_w4a16_matches_float64(m, n, k, dtype, layout):
    packed, scales, w = random_nvfp4(n, k, layout)
    x = (torch.randn(m, k, device="cuda") + 0.5).to(dtype)
    bias = torch.randn(n, device="cuda").to(dtype)
    out = ck.gemm_w4a16(x, packed, scales, 0.75, bias=bias, scale_layout=layout)
    expected = x.double() @ w.t() * 0.75 + bias.double()
    assert out.shape == (m, n) and out.dtype == dtype
    assert not out.isnan().any()
    bound = torch_error_bound(x, w * 0.75, expected - bias.double(), dtype) + 2 ** -7 * bias.abs().max().item()
    err = (out.double() - expected).abs().max().item()
    assert err <= bound, f"max error {err:.3e} > {bound:.3e}"


@gpu
def test_gemm_w4a16_global_scale_tensor_batch_dims_and_float4_dtype():
    packed, scales, w = random_nvfp4(512, 256)
    gs = torch.tensor(0.125, device="cuda")
    for m in (5, 96):  # skinny, decoded (the scale folded into the decoded weights)
        x = torch.randn(2, m, 256, device="cuda", dtype=torch.bfloat16)
        out = ck.gemm_w4a16(x, packed.view(torch.float4_e2m1fn_x2), scales, gs)
        expected = x.double() @ w.t() * 0.125
        assert out.shape == (2, m, 512)
        bound = torch_error_bound(x.reshape(-1, 256), w * 0.125, expected.reshape(-1, 512), torch.bfloat16)
        assert (out.double() - expected).abs().max().item() <= bound


@gpu
def test_split_k_workspace_is_left_zero_and_kept_per_stream():
    # K cut over CTAs: partial sums meet in a per-stream workspace that every launch leaves at
    # zero, so repeated calls (and calls on a second stream) agree (to the order of the fp32
    # additions: a workspace left dirty would double the result).
    packed, scales, w = random_nvfp4(512, 4096)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    first = ck.gemm_w4a16(x, packed, scales)
    scale = first.abs().max().item()
    for _ in range(3):
        assert (ck.gemm_w4a16(x, packed, scales) - first).abs().max().item() <= 2 ** -6 * scale
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        other = ck.gemm_w4a16(x, packed, scales)
    stream.synchronize()
    assert (other - first).abs().max().item() <= 2 ** -6 * scale
    bound = torch_error_bound(x, w, x.double() @ w.t(), torch.bfloat16)
    assert (first.double() - x.double() @ w.t()).abs().max().item() <= bound


@gpu
def test_launch_plans_match_the_checked_path():
    # Repeated eager calls take a cached launch plan; its results equal the checked path's, a
    # misaligned pointer or a new signature goes back through the checks.
    packed, scales, w = random_nvfp4(320, 512)
    x = torch.randn(5, 512, device="cuda", dtype=torch.bfloat16)
    first = ck.gemm_w4a16(x, packed, scales)
    for _ in range(2):
        assert (ck.gemm_w4a16(x, packed, scales) - first).abs().max().item() <= 2 ** -6 * first.abs().max().item()
    shifted = torch.randn(5 * 512 + 4, device="cuda", dtype=torch.bfloat16)[4:].view(5, 512)  # 8 bytes off
    shifted.copy_(x)
    assert (ck.gemm_w4a16(shifted, packed, scales) - first).abs().max().item() <= 2 ** -6 * first.abs().max().item()
    a, sfa, va = random_nvfp4(2, 256, "blocked", 3)
    b, sfb, vb = random_nvfp4(200, 256, "blocked", 3)
    for out in (None, torch.full((3, 200, 2), float("nan"), dtype=torch.float16, device="cuda").transpose(1, 2)):
        for _ in range(3):
            got = ck.gemm_nvfp4(a, b, sfa, sfb, scale_layout="blocked", out=out)
            check_close(got, va @ vb.transpose(-1, -2))
            if out is not None:
                out.fill_(float("nan"))


@gpu
def test_gemm_w4a16_strided_activations_and_nan_propagation():
    packed, scales, w = random_nvfp4(256, 512, nan_scales=True)
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)[:, ::2]  # not contiguous
    out = ck.gemm_w4a16(x, packed, scales)
    expected = x.double() @ w.t()
    assert torch.equal(out.isnan(), expected.isnan()), "NaN scales reach exactly their rows"
    finite = ~expected.isnan()
    assert finite.any()
    bound = torch_error_bound(x, w.nan_to_num(), (x.double() @ w.nan_to_num().t()), torch.bfloat16)
    assert (out.double() - expected)[finite].abs().max().item() <= bound


@gpu
def test_gemm_w4a16_empty_and_k_zero():
    packed, scales, _ = random_nvfp4(64, 32)
    out = ck.gemm_w4a16(torch.zeros(0, 32, device="cuda", dtype=torch.bfloat16), packed, scales)
    assert out.shape == (0, 64)
    bias = torch.randn(8, device="cuda", dtype=torch.bfloat16)
    empty_w = torch.zeros(8, 0, dtype=torch.uint8, device="cuda")
    empty_s = torch.zeros(8, 0, dtype=torch.float8_e4m3fn, device="cuda")
    out = ck.gemm_w4a16(torch.zeros(3, 0, device="cuda", dtype=torch.bfloat16), empty_w, empty_s, bias=bias)
    assert torch.equal(out, bias.expand(3, 8))


@gpu
def test_gemm_w4a16_rejects_bad_arguments_by_name():
    packed, scales, _ = random_nvfp4(64, 64)
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ck.DTypeError, match="x"):
        ck.gemm_w4a16(x.float(), packed, scales)
    with pytest.raises(ck.UnsupportedError, match="K = 32"):
        ck.gemm_w4a16(x[:, :32], packed, scales)
    with pytest.raises(ck.UnsupportedError, match="w_scales must be"):
        ck.gemm_w4a16(x, packed, scales[:, :2])
    with pytest.raises(ck.UnsupportedError, match="w_scales must be"):
        ck.gemm_w4a16(x, packed, scales, scale_layout="blocked")
    with pytest.raises(ck.UnsupportedError, match="scale_layout"):
        ck.gemm_w4a16(x, packed, scales, scale_layout="swizzled")
    with pytest.raises(ck.DTypeError, match="w_fp4"):
        ck.gemm_w4a16(x, packed.to(torch.int32), scales)
    with pytest.raises(ck.UnsupportedError, match="bias"):
        ck.gemm_w4a16(x, packed, scales, bias=torch.zeros(3, device="cuda"))
    with pytest.raises(ck.UnsupportedError, match="no backward"):
        ck.gemm_w4a16(x.requires_grad_(), packed, scales)
    with pytest.raises(ck.DeviceError, match="x"):
        ck.gemm_w4a16(x.detach().cpu(), packed, scales)


# ---------------------------------------------------------------- W4A4


def check_close(out, expected, rtol=1e-3, atol=1e-3, slack=0.0):
    """The public problems' rule (``|out - ref| <= atol + rtol |ref|``, ref rounded to out's
    dtype), each element allowed ``slack`` more."""
    ref = expected.to(out.dtype).double()
    bad = (out.double() - ref).abs() > atol + rtol * ref.abs() + slack
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} off, max {(out.double() - ref).abs().max():.3e}"


def tensor_core_error(a_values, b_values, expected):
    """The largest error against ``expected`` (float64) of the same batched product computed by
    cuBLAS on the tensor cores: bf16 operands (decoded NVFP4 values are exact in bf16), fp32
    accumulation. Signed codes with scales over 2^-4 .. 2^4 make sums that cancel (|out| ~1 among
    terms ~10^4 at K = 2016): the tensor cores' own fp32 accumulation then misses the public
    problems' rule (made for their positive, small inputs) by ~10^-3 on a rare element, as ours
    does (measured on H100 at (L, M, K) = (4, 7000, 2016): one element of 28000 each, ours
    0.0017 off at |out| = 0.82; the largest fp32 error of cuBLAS's product 0.072)."""
    product = torch.stack([torch.mm(a.bfloat16(), b.bfloat16().t(), out_dtype=torch.float32)
                           for a, b in zip(a_values, b_values)])
    return (product.double() - expected).abs().max().item()


W4A4_SHAPES = [  # (L, M, N, K): skinny on either side, decoded, tails, batches
    (None, 1, 512, 256), (None, 7, 300, 1024), (None, 64, 128, 64), (None, 300, 5, 512),
    (3, 16, 256, 128), (2, 128, 96, 256), (None, 130, 200, 96), (2, 33, 1, 4096),
    (8, 1, 6400, 1120),  # two steps per ring stage, 9 steps per CTA (the last a K tail)
]


@gpu
@pytest.mark.parametrize("l,m,n,k", W4A4_SHAPES)
@pytest.mark.parametrize("layout", ("plain", "blocked"))
def test_gemm_nvfp4_matches_float64(l, m, n, k, layout):
    a, sfa, va = random_nvfp4(m, k, layout, l)
    b, sfb, vb = random_nvfp4(n, k, layout, l)
    shape = (m, n) if l is None else (l, m, n)
    out = torch.full(shape, float("nan"), dtype=torch.float16, device="cuda")
    result = ck.gemm_nvfp4(a, b, sfa, sfb, scale_layout=layout, out=out)
    assert result is out
    check_close(out, va @ vb.transpose(-1, -2))
    bf = ck.gemm_nvfp4(a, b, sfa, sfb, scale_layout=layout, out_dtype=torch.bfloat16, alpha=0.5)
    check_close(bf, 0.5 * va @ vb.transpose(-1, -2), rtol=8e-3, atol=8e-3)


@gpu
@pytest.mark.parametrize("layout", ("plain", "blocked"))
@pytest.mark.parametrize("l,m,k", (  # streaming: K split or not, long ranges, tails
    (3, 384, 2048), (4, 7000, 2016), (1, 3000, 4160), (2, 1000, 4224)))
def test_gemv_nvfp4_batched_matches_float64(layout, l, m, k):
    a, sfa, va = random_nvfp4(m, k, layout, l)
    x, sfx, vx = random_nvfp4(1, k, layout, l)
    out = ck.gemv_nvfp4(a, x[:, 0], sfa, sfx[:, 0] if layout == "plain" else sfx, scale_layout=layout)
    assert out.shape == (l, m) and out.dtype == torch.float16
    expected = va @ vx.transpose(-1, -2)
    check_close(out, expected[..., 0], slack=2 * tensor_core_error(va, vx, expected))


@gpu
@pytest.mark.parametrize("m", (16, 256))
def test_nvfp4_dual_gemm_matches_float64(m):
    k, n = 512, 384
    a, sfa, va = random_nvfp4(m, k, scale_range=(0x20, 0x40))
    b1, sfb1, v1 = random_nvfp4(n, k, scale_range=(0x20, 0x40))
    b2, sfb2, v2 = random_nvfp4(n, k, scale_range=(0x20, 0x40))
    out = ck.nvfp4_dual_gemm(a, b1, b2, sfa, sfb1, sfb2)
    first = va @ v1.t()
    check_close(out, first * torch.sigmoid(first) * (va @ v2.t()))


@gpu
def test_gemm_nvfp4_rejects_bad_arguments_by_name():
    a, sfa, _ = random_nvfp4(16, 64)
    b, sfb, _ = random_nvfp4(32, 64)
    with pytest.raises(ck.UnsupportedError, match="share L and K"):
        ck.gemm_nvfp4(a, random_nvfp4(32, 128)[0], sfa, random_nvfp4(32, 128)[1])
    with pytest.raises(ck.DTypeError, match="out_dtype"):
        ck.gemm_nvfp4(a, b, sfa, sfb, out_dtype=torch.int8)
    with pytest.raises(ck.UnsupportedError, match="sfb must be"):
        ck.gemm_nvfp4(a, b, sfa, sfa)
    with pytest.raises(ck.UnsupportedError, match="out must be"):
        ck.gemm_nvfp4(a, b, sfa, sfb, out=torch.empty(16, 31, dtype=torch.float16, device="cuda"))


# ---------------------------------------------------------------- dequantize, module, compile


@gpu
@pytest.mark.parametrize("layout", ("plain", "blocked"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_nvfp4_dequantize_kernel_is_bit_exact(layout, dtype):
    packed, scales, _ = random_nvfp4(300, 640, layout, scale_range=(0, 0x7F), nan_scales=True)
    batched = ck.nvfp4_dequantize(packed[None].expand(2, -1, -1), scales[None].expand(2, *scales.shape),
                                  0.5, layout, dtype)
    assert batched.shape == (2, 300, 640)
    assert torch.equal(batched[1].nan_to_num(), ck.nvfp4_dequantize(packed, scales, 0.5, layout, dtype).nan_to_num())
    for gs in (1.0, 0.3):
        got = ck.nvfp4_dequantize(packed, scales, gs, layout, dtype)
        want = nvfp4_dequantize_ref(packed, scales, torch.tensor(gs, device="cuda"), layout).to(dtype)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


@gpu
def test_nvfp4_linear_follows_the_dequantized_layer():
    linear = torch.nn.Linear(512, 384, device="cuda", dtype=torch.bfloat16)
    layer = ck.NVFP4Linear.from_float(linear)
    w = ck.nvfp4_dequantize(layer.weight_fp4, layer.weight_scales, layer.weight_global_scale,
                            dtype=torch.float32).double()
    for rows in (1, 8, 100):
        x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            out = layer(x)
        expected = x.double() @ w.t() + layer.bias.double()
        bound = torch_error_bound(x, w, x.double() @ w.t(), torch.bfloat16) + 2 ** -7 * expected.abs().max().item()
        assert (out.double() - expected).abs().max().item() <= bound


@gpu
def test_nvfp4_linear_prepared_follows_its_buffers():
    linear = torch.nn.Linear(512, 384, device="cuda", dtype=torch.bfloat16)
    layer = ck.NVFP4Linear.from_float(linear, prepare=True)
    plain = ck.NVFP4Linear.from_float(linear)
    assert "prepared=True" in repr(layer) and "_prepared" not in dict(layer.state_dict())
    x = torch.randn(3, 16, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        out, ref = layer(x), plain(x)
        bound = 2 ** -6 * ref.abs().max().item()
        assert out.shape == ref.shape and (out.float() - ref.float()).abs().max().item() <= bound
        assert layer._prepared is not None
        other = ck.NVFP4Linear.from_float(torch.nn.Linear(512, 384, device="cuda", dtype=torch.bfloat16))
        layer.load_state_dict(other.state_dict())  # the prepared copy is made again
        out, ref = layer(x), other(x)
        assert (out.float() - ref.float()).abs().max().item() <= 2 ** -6 * ref.abs().max().item()
        half = layer(x.half())  # fp16 activations take the packed path
        assert half.dtype == torch.float16
    with pytest.raises(ck.UnsupportedError, match="multiple of 8"):
        ck.NVFP4Linear(64, 60, device="cuda").prepare()


@gpu
def test_nvfp4_products_compile_fullgraph():
    packed, scales, w = random_nvfp4(256, 128)
    a, sfa, va = random_nvfp4(4, 128, "blocked")
    b, sfb, vb = random_nvfp4(256, 128, "blocked")

    @torch.compile(fullgraph=True, dynamic=False)
    def f(x):
        return ck.gemm_w4a16(x, packed, scales) + 1, ck.gemm_nvfp4(a, b, sfa, sfb, scale_layout="blocked")

    for m in (3, 80):
        x = torch.randn(m, 128, device="cuda", dtype=torch.bfloat16)
        y, z = f(x)
        expected = ck.gemm_w4a16(x, packed, scales) + 1
        assert torch.allclose(y.float(), expected.float(), rtol=2 ** -7, atol=2 ** -7)
        check_close(z, va @ vb.t())


def test_skinny_plan_heuristic():
    def plan(m, n, k=8192, x_format="bfloat16"):
        return skinny_plan(m, n, k, 1, x_format, "float16" if x_format == "nvfp4" else x_format, 132)

    assert [plan(m, 8192)[0].token_tiles for m in (1, 8, 9, 16, 17, 24, 33, 64)] == [1, 1, 2, 2, 4, 4, 8, 8]
    # up to 4 rows of x: streaming, K cut to ~3 CTAs per SM (or ranges of at most 16 steps
    # where row blocks are plenty); never below 4 steps of 128 values, never past x's staging
    cfg, splits = plan(1, 8192)
    assert cfg.prefetch and (cfg.warps, cfg.slabs, cfg.x_rows, splits) == (4, 1, 1, 3) and cfg.split
    assert plan(1, 4096, 1024)[1] == 2 and plan(1, 4096, 256)[1] == 1
    assert plan(1, 65536, 4096)[1] == 2 and plan(3, 8192)[0].x_rows == 4
    # ranges of 8 steps or more: multiples of 4 steps (256-byte blocks of a row) with 256-byte
    # L2 fetches; every range within x's staging, none empty (the kernel's own range rule)
    assert plan(1, 8192)[0].l2_fetch == 256 and plan(1, 4096, 1024)[0].l2_fetch == 0
    for m, n, k in ((1, 128, 65536), (4, 64, 1 << 20), (2, 300000, 8192), (1, 1000, 4224),
                    *((m, n, k) for m in (1, 4, 8) for n in (64, 7168, 65536)
                      for k in range(32, 9000, 96))):
        cfg, splits = plan(m, n, k)
        if not cfg.prefetch:  # 5-8 rows on the ring
            assert m > 4
            continue
        steps = -(-k // 128)
        per = -(-(-(-steps // splits)) // cfg.granule) * cfg.granule
        assert cfg.prefetch and per <= cfg.x_steps and cfg.x_rows >= m
        assert splits * per >= steps > (splits - 1) * per and cfg.split == (splits > 1)
        assert (cfg.l2_fetch, cfg.granule) == ((256, 4) if per >= 8 else (0, 1))
    # 5 to 8 rows: 16-bit x streams (x_rows 8); NVFP4 x takes the ring, one token tile, small
    # CTAs, K cut to ~6 CTAs per SM
    # (or where its 3 CTAs per SM would take more than a wave over long ranges of K)
    for m in (5, 8):
        cfg, splits = plan(m, 8192)
        assert cfg.prefetch and cfg.x_rows == 8 and (cfg.warps, splits) == (4, 3)
        cfg, splits = plan(m, 8192, x_format="nvfp4")
        assert not cfg.prefetch and (cfg.token_tiles, cfg.warps, cfg.slabs, splits) == (1, 4, 1, 7)
        assert not plan(m, 8192, 16384)[0].prefetch and plan(m, 28672, 8192)[0].prefetch
    # more rows: 8 warps; K cut into ranges while the CTAs stay within one per SM, or two slabs
    # and no cut
    cfg, splits = plan(16, 8192)
    assert (cfg.warps, cfg.slabs, splits) == (8, 1, 2) and cfg.split
    assert plan(64, 8192)[1] == 2 and plan(64, 1024)[1] == 16 and plan(16, 16384)[1] == 1
    cfg, splits = plan(16, 28672)
    assert (cfg.warps, cfg.slabs, splits) == (8, 2, 1) and not cfg.split
    for m in range(1, 65):
        for x_format in ("bfloat16", "nvfp4"):
            cfg, _ = plan(m, 4096, x_format=x_format)
            kernel = SkinnyGemmNvfp4Sm90(cfg)
            assert 8 * cfg.token_tiles >= m and kernel.smem_bytes() <= 110 * 1024


def test_weight_views_follow_the_weight_and_release_it():
    """The launch plans' views of a weight (its codes with a batch dim, its scales as int16
    pairs) are made once per weight, read the same bytes as the weight (strided rows
    included), and go when the weight does."""
    import gc

    from cute_kernels.quant import nvfp4_gemm as G

    G._views.clear()
    packed = torch.randint(0, 256, (64, 256), dtype=torch.uint8)[:, 64:192]  # strided rows
    scales = torch.randint(0, 256, (64, 16), dtype=torch.uint8).view(torch.float8_e4m3fn)
    codes, pairs = G._weight_views(packed, scales)
    assert codes.shape == (1, 64, 128) and torch.equal(codes[0], packed)
    assert torch.equal(pairs[0], scales.view(torch.uint8).view(torch.int16).reshape(-1))
    assert G._weight_views(packed, scales)[0] is codes
    packed[3, 5] = 7  # the views share the weight's storage
    assert codes[0, 3, 5] == 7
    del packed, codes, pairs
    gc.collect()
    assert not G._views


# ---------------------------------------------------------------- W4A16, prepared weights


PREPARED_SHAPES = [  # (M, N, K): every token tile (16 .. 256, 64- and 128-row weight tiles),
    # two CTAs per SM (tiles > SMs), N and K tails of the 64 x 128 chunks, M tails
    (1, 4096, 4096), (3, 136, 128), (16, 1000, 1024), (5, 200, 272), (17, 512, 4112),
    (32, 9000, 256), (64, 1032, 1024), (100, 704, 384), (128, 256, 2048), (300, 520, 640),
    (1024, 2048, 1024), (200, 200, 4112), (2304, 4160, 256),  # clusters of 2 tiles, one short
    (48, 1000, 12288), (32, 4104, 12304),  # split K with stream-K over the SMs
]


@gpu
@pytest.mark.parametrize("m,n,k", PREPARED_SHAPES)
@pytest.mark.parametrize("layout", ("plain", "blocked"))
def test_gemm_w4a16_prepared_matches_float64(m, n, k, layout):
    packed, scales, w = random_nvfp4(n, k, layout)
    prepared = ck.nvfp4_prepare_weight(packed, scales, scale_layout=layout)
    assert isinstance(prepared, ck.NVFP4Weight) and prepared.shape == (n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) + 3.0  # far from zero mean
    bias = torch.randn(n, device="cuda")
    for b in (None, bias):
        out = ck.gemm_w4a16(x, prepared, None, 0.75, bias=b)
        expected = x.double() @ w.t() * 0.75 + (0 if b is None else b.double())
        assert out.shape == (m, n) and out.dtype == torch.bfloat16 and not out.isnan().any()
        bound = torch_error_bound(x, w * 0.75, x.double() @ w.t() * 0.75, torch.bfloat16)
        bound += 2 ** -7 * bias.abs().max().item()
        err = (out.double() - expected).abs().max().item()
        assert err <= bound, f"max error {err:.3e} > {bound:.3e} (bias: {b is not None})"
        assert torch.equal(ck.gemm_w4a16(x, prepared, None, 0.75, bias=b), out)  # the launch plan


@gpu
def test_gemm_w4a16_prepared_batch_dims_global_scale_tensor_and_nan():
    packed, scales, w = random_nvfp4(256, 512)
    prepared = ck.nvfp4_prepare_weight(packed.view(torch.float4_e2m1fn_x2), scales)
    x = torch.randn(2, 3, 512, device="cuda", dtype=torch.bfloat16)
    x[1, 2, 7] = float("nan")
    g = torch.tensor(0.5, device="cuda")
    out = ck.gemm_w4a16(x, prepared, None, g)
    assert out.shape == (2, 3, 256)
    assert out[1, 2].isnan().all() and not out[:1].isnan().any() and not out[1, :2].isnan().any()
    expected = x[0].double() @ w.t() * 0.5
    bound = torch_error_bound(x[0], w * 0.5, expected, torch.bfloat16)
    assert (out[0].double() - expected).abs().max().item() <= bound
    # the same product through the packed path agrees
    same = ck.gemm_w4a16(x[0], packed, scales, 0.5)
    assert (same.double() - out[0].double()).abs().max().item() <= bound
    assert ck.gemm_w4a16(x[:, :0], prepared, None).shape == (2, 0, 256)


@gpu
def test_gemm_w4a16_prepared_nan_scales_and_zero_blocks():
    packed, scales, w = random_nvfp4(192, 384, nan_scales=True)
    scales.view(torch.uint8)[5, :] = 0  # a row of zero scales over nonzero codes
    w[5] = 0.0
    prepared = ck.nvfp4_prepare_weight(packed, scales)
    x = torch.randn(16, 384, device="cuda", dtype=torch.bfloat16)
    out = ck.gemm_w4a16(x, prepared, None).double()
    expected = x.double() @ w.t()
    assert torch.equal(out.isnan(), expected.isnan()) and expected.isnan().any()
    ok = ~expected.isnan()
    bound = torch_error_bound(x, w.nan_to_num(), expected.nan_to_num(), torch.bfloat16)
    assert (out[ok] - expected[ok]).abs().max().item() <= bound
    assert (out[:, 5] == 0).all()


@gpu
def test_gemm_w4a16_prepared_rejects_bad_arguments_by_name():
    packed, scales, _ = random_nvfp4(64, 128)
    prepared = ck.nvfp4_prepare_weight(packed, scales)
    x = torch.randn(4, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ck.UnsupportedError, match="w_scales=None"):
        ck.gemm_w4a16(x, prepared, scales)
    with pytest.raises(ck.DTypeError, match="x"):
        ck.gemm_w4a16(x.half(), prepared, None)
    with pytest.raises(ck.UnsupportedError, match="x must be"):
        ck.gemm_w4a16(x[:, :64], prepared, None)
    with pytest.raises(ck.UnsupportedError, match="bias"):
        ck.gemm_w4a16(x, prepared, None, bias=torch.zeros(63, device="cuda"))
    with pytest.raises(ck.UnsupportedError, match="multiple of 8"):
        ck.nvfp4_prepare_weight(packed[:60], scales[:60])
