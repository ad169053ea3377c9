"""NVFP4 quantization on the GPU: bit-exact against ``formats.nvfp4_quantize_ref`` (the rule the
kernel implements, in float32 torch operations) for every dtype, scale layout and the values
that test the rounding, saturation and NaN rules; input checks before any kernel."""

import pytest
import torch

import cute_kernels as ck
from cute_kernels.quant.formats import (
    E2M1_VALUES,
    as_float4_x2,
    from_blocked,
    nvfp4_dequantize_ref,
    nvfp4_quantize_ref,
    to_blocked,
)

gpu = pytest.mark.gpu
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def assert_same_as_reference(x, global_scale=None, scale_layout="plain"):
    packed, scales, gs = ck.nvfp4_quantize(x, global_scale, scale_layout=scale_layout)
    ref_packed, ref_scales, ref_gs = nvfp4_quantize_ref(x, global_scale, scale_layout)
    assert packed.dtype == torch.uint8 and scales.dtype == torch.float8_e4m3fn
    assert packed.shape == ref_packed.shape and scales.shape == ref_scales.shape
    assert torch.equal(gs.cpu(), ref_gs.cpu())
    assert torch.equal(scales.view(torch.uint8), ref_scales.view(torch.uint8)), "block scales differ"
    mismatch = (packed != ref_packed).nonzero()
    assert not len(mismatch), f"{len(mismatch)} code bytes differ, first at {mismatch[0].tolist()}"
    return packed, scales, gs


# ---------------------------------------------------------------- no GPU needed


def test_nvfp4_quantize_checks_inputs_before_any_kernel():
    with pytest.raises(ck.CuteKernelsError, match="x"):
        ck.nvfp4_quantize(torch.randn(4, 32))  # a CPU tensor
    with pytest.raises((ck.CuteKernelsError, TypeError)):
        ck.nvfp4_quantize([[1.0] * 16])


@gpu
def test_nvfp4_quantize_rejects_bad_arguments_by_name():
    x = torch.randn(4, 32, device="cuda")
    with pytest.raises(ck.UnsupportedError, match="multiple of 16"):
        ck.nvfp4_quantize(torch.randn(4, 24, device="cuda"))
    with pytest.raises(ck.UnsupportedError, match="multiple of 16"):
        ck.nvfp4_quantize(torch.randn(2, 4, 32, device="cuda"))
    with pytest.raises(ck.DTypeError, match="x"):
        ck.nvfp4_quantize(x.to(torch.int32))
    with pytest.raises(ck.UnsupportedError, match="scale_layout='swizzled'"):
        ck.nvfp4_quantize(x, scale_layout="swizzled")
    with pytest.raises(ck.UnsupportedError, match="global_scale"):
        ck.nvfp4_quantize(x, torch.ones(2, device="cuda"))
    with pytest.raises(TypeError, match="global_scale"):
        ck.nvfp4_quantize(x, "1.0")
    packed, scales, gs = ck.nvfp4_quantize(x)
    with pytest.raises(ck.UnsupportedError, match="scales must be"):
        ck.nvfp4_dequantize(packed, scales[:, :1], gs)
    with pytest.raises(ck.DTypeError, match="dtype"):
        ck.nvfp4_dequantize(packed, scales, gs, dtype=torch.int8)


# ---------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_layout", ["plain", "blocked"])
@pytest.mark.parametrize("shape", [(1, 16), (3, 48), (129, 80), (128, 64), (1000, 1008), (256, 8192)])
def test_nvfp4_quantize_matches_reference_bit_for_bit(dtype, scale_layout, shape):
    torch.manual_seed(sum(shape))
    x = torch.randn(shape, device="cuda") * torch.logspace(-3, 3, shape[1], device="cuda") + 0.75
    assert_same_as_reference(x.to(dtype), scale_layout=scale_layout)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_rounding_ties_saturation_and_special_values(dtype):
    # With global scale 1 and a block amax of 6 the block scale is exactly 1, so x * inverse
    # is x: the midpoints of the e2m1 grid must round to the even code, values past 6 saturate
    # (only where the amax does not set the scale), NaN gives code 0 and a zero scale for its
    # block, +-inf saturates at the largest scale.
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    row = [6.0] + mids + [-m for m in mids] + [0.0]
    x = torch.tensor([row, [-0.0] * 16, [float("nan")] + [1.0] * 15, [float("inf")] + [2.0] * 15,
                      [float("-inf")] + [-1.0] * 15, [1e-30] * 16, [3e38] * 16,
                      [6.0] * 8 + [100.0] * 8], device="cuda", dtype=torch.float32)
    x = x.repeat(1, 2)  # K = 32
    if dtype != torch.float32:
        x = x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
        x[3, 0], x[4, 0] = float("inf"), float("-inf")
    packed, scales, _ = assert_same_as_reference(x, global_scale=1.0)
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(x.shape)
    assert codes[0, 1:8].tolist() == [0, 2, 2, 4, 4, 6, 6]  # ties to the even code
    assert codes[0, 8:15].tolist() == [8, 10, 10, 12, 12, 14, 14]
    assert scales.float()[2, 0].item() == 0 and codes[2, :16].eq(0).all()  # a NaN block
    assert scales.float()[3, 0].item() == 448.0


@gpu
@pytest.mark.parametrize("global_scale", [None, 1.0, 0.001, 0.0, -2.0, "tensor"])
def test_nvfp4_global_scales(global_scale):
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16) * 40
    if global_scale == "tensor":
        global_scale = torch.tensor([0.02], device="cuda", dtype=torch.float64)
    assert_same_as_reference(x, global_scale)
    zeros = torch.zeros(5, 32, device="cuda")
    packed, scales, gs = assert_same_as_reference(zeros)
    assert gs.item() == 1.0 and packed.eq(0).all() and scales.float().eq(0).all()


@gpu
def test_nvfp4_quantize_strided_misaligned_and_empty_inputs():
    base = torch.randn(300, 1024 + 8, device="cuda", dtype=torch.bfloat16)
    assert_same_as_reference(base[:, :1024])  # row stride 1032: 16-byte multiple, no copy
    assert_same_as_reference(base[:, 8:520])  # a view starting 16 bytes in
    flat = torch.randn(300 * 1024 + 1, device="cuda", dtype=torch.bfloat16)
    assert_same_as_reference(flat[1:].view(300, 1024))  # data on 2 bytes: copied first
    assert_same_as_reference(torch.randn(1024, 40, device="cuda").t()[:, :1024 - 16])  # column-major
    assert_same_as_reference(torch.randn(64, 1, device="cuda").t())  # one row, row stride 1
    for shape in ((0, 64), (7, 0)):
        packed, scales, _ = ck.nvfp4_quantize(torch.empty(shape, device="cuda"))
        assert packed.shape == (shape[0], shape[1] // 2) and scales.shape == (shape[0], shape[1] // 16)


@gpu
def test_nvfp4_blocked_scales_pad_with_zeros_and_round_trip():
    x = torch.randn(130, 96, device="cuda", dtype=torch.bfloat16)  # 2 row tiles, 6 -> 8 columns
    packed, blocked, gs = assert_same_as_reference(x, scale_layout="blocked")
    assert blocked.numel() == 256 * 8
    plain = ck.nvfp4_quantize(x)[1]
    assert torch.equal(from_blocked(blocked, 130, 6).view(torch.uint8), plain.view(torch.uint8))
    full = torch.zeros(256, 8, dtype=torch.uint8, device="cuda")
    full[:130, :6] = plain.view(torch.uint8)
    assert torch.equal(blocked.view(torch.uint8), to_blocked(full)), "padding entries are zero"
    y = ck.nvfp4_dequantize(packed, blocked, gs, scale_layout="blocked", dtype=torch.float32)
    assert torch.equal(y, nvfp4_dequantize_ref(packed, blocked, gs, "blocked"))
    # NVFP4's error: within half a grid step of the block's scaled values (e2m1 steps are at
    # most 2 at the top of the range, times the block scale)
    # NVFP4's error: at most half the widest e2m1 step (2, between 4 and 6) times the block's
    # scale, which also covers the saturation left by rounding the scale down to e4m3
    half_step = (max(E2M1_VALUES) - 4.0) / 2 * plain.float().repeat_interleave(16, dim=1) * gs
    assert ((y - x.float()).abs() <= half_step + 1e-6).all()
    assert torch.equal(as_float4_x2(packed).view(torch.uint8), packed)


@gpu
def test_nvfp4_quantize_under_torch_compile():
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    gs = torch.tensor(0.01, device="cuda")

    @torch.compile(fullgraph=True)
    def quantize(x, gs):
        packed, scales, _ = ck.nvfp4_quantize(x, gs)
        return packed, scales

    packed, scales = quantize(x, gs)
    ref_packed, ref_scales, _ = nvfp4_quantize_ref(x, gs)
    assert torch.equal(packed, ref_packed) and torch.equal(scales.view(torch.uint8), ref_scales.view(torch.uint8))
