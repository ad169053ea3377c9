"""NVFP4 formats and the reference quantizer (CPU; the kernels follow these rules)."""

import pytest
import torch

from cute_kernels.quant.formats import (
    E2M1_VALUES,
    as_float4_x2,
    e2m1_codes,
    e2m1_values,
    from_blocked,
    nvfp4_dequantize_ref,
    nvfp4_quantize_ref,
    pack_e2m1,
    to_blocked,
    unpack_e2m1,
)


def test_e2m1_codes_of_exact_values_midpoints_and_specials():
    exact = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES[1:]))
    assert torch.equal(e2m1_values(e2m1_codes(exact)), exact)
    # ties go to the even code (mantissa bit 0): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
    # 2.5 -> 2, 3.5 -> 4, 5 -> 4
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert e2m1_values(e2m1_codes(mids)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert e2m1_values(e2m1_codes(-mids)).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    near = torch.tensor([0.2500001, 0.7499999, 1.2500001, 4.9999, 5.0001])
    assert e2m1_values(e2m1_codes(near)).tolist() == [0.5, 0.5, 1.5, 4.0, 6.0]
    special = torch.tensor([7.0, 1e30, float("inf"), -float("inf"), float("nan")])
    assert e2m1_values(e2m1_codes(special)).tolist() == [6.0, 6.0, 6.0, -6.0, 0.0]
    assert e2m1_codes(torch.tensor([-6.0])).item() == 15


def test_packing_order_and_float4_interop():
    codes = torch.randint(0, 16, (5, 32), dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.shape == (5, 16) and packed.dtype == torch.uint8
    assert torch.equal(packed & 15, codes[:, 0::2]) and torch.equal(packed >> 4, codes[:, 1::2])
    as_fp4 = as_float4_x2(packed)
    assert as_fp4.dtype == torch.float4_e2m1fn_x2 and as_fp4.data_ptr() == packed.data_ptr()
    assert torch.equal(unpack_e2m1(as_fp4), codes) and torch.equal(unpack_e2m1(packed), codes)
    with pytest.raises(ValueError, match="even"):
        pack_e2m1(codes[:, :3])


def _blocked_by_tiles(scales):
    """The layout written out the other way: per 128 x 4 tile, rows r, r + 32, r + 64, r + 96
    side by side (4 bytes each) in row r % 32 of a 32 x 16 block."""
    rows, cols = scales.shape
    rt, ct = -(-rows // 128), -(-cols // 4)
    padded = torch.zeros(rt * 128, ct * 4, dtype=scales.dtype)
    padded[:rows, :cols] = scales
    out = []
    for i in range(rt):
        for j in range(ct):
            tile = padded[i * 128:(i + 1) * 128, j * 4:(j + 1) * 4]
            block = torch.cat([tile[q * 32:(q + 1) * 32] for q in range(4)], dim=1)  # (32, 16)
            out.append(block.reshape(-1))
    return torch.cat(out)


@pytest.mark.parametrize("shape", [(128, 4), (256, 8), (1, 1), (130, 7), (300, 64)])
def test_blocked_scale_layout_round_trip(shape):
    scales = (torch.rand(shape) * 400).to(torch.float8_e4m3fn)
    flat = to_blocked(scales)
    assert flat.numel() == -(-shape[0] // 128) * 128 * -(-shape[1] // 4) * 4
    assert torch.equal(flat.view(torch.uint8), _blocked_by_tiles(scales).view(torch.uint8))
    assert torch.equal(from_blocked(flat, *shape).view(torch.uint8), scales.view(torch.uint8))
    with pytest.raises(ValueError, match="holds"):
        from_blocked(flat[:-1], *shape)


@pytest.mark.parametrize("layout", ["plain", "blocked"])
def test_quantize_reference_error_bound_and_scale_rule(layout):
    torch.manual_seed(0)
    x = torch.randn(37, 256) * torch.rand(37, 1) * 100 + 3
    x[5] = 0  # all-zero blocks: scale 0, codes 0
    packed, scales, global_scale = nvfp4_quantize_ref(x, scale_layout=layout)
    assert packed.shape == (37, 128) and packed.dtype == torch.uint8
    assert global_scale.item() == pytest.approx(x.abs().max().item() / (6 * 448))
    deq = nvfp4_dequantize_ref(packed, scales, global_scale, scale_layout=layout)
    plain = from_blocked(scales, 37, 16) if layout == "blocked" else scales
    per_value = plain.float().repeat_interleave(16, dim=1) * global_scale
    amax = x.abs().reshape(37, 16, 16).amax(-1).repeat_interleave(16, dim=1)
    # half the widest gap between neighbouring e2m1 values (4 -> 6) at the block's scale, plus
    # the e4m3 rounding of the scale itself (2^-4 relative) on the block's largest value
    assert ((deq - x).abs() <= per_value * 1.0 + amax * 2 ** -4 + 1e-6).all()
    assert deq[5].eq(0).all() and plain[5].float().eq(0).all()
    # the largest value of each block lands at the top of the code range
    top = unpack_e2m1(packed).reshape(37, 16, 16)[torch.arange(37) != 5] & 7
    assert top.amax(-1).ge(6).all()


def test_quantize_reference_with_a_given_global_scale_saturates():
    x = torch.full((2, 16), 1000.0)
    packed, scales, g = nvfp4_quantize_ref(x, global_scale=0.01)
    assert scales.float().eq(448).all() and g.item() == pytest.approx(0.01)
    assert (unpack_e2m1(packed) == 7).all()  # 1000 / (448 * 0.01) > 6: saturated
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_quantize_ref(torch.ones(2, 24))


def _problem_module(folder, name):
    import importlib.util
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / folder
    paths = [str(root), str(root.parent)]  # the problem's files and the shared ../nvfp4_utils.py
    sys.path[:0] = paths
    try:
        for module in ("task", "nvfp4_utils", name):
            sys.modules.pop(module, None)
        spec = importlib.util.spec_from_file_location(name, root / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        del sys.path[:2]
        sys.modules.pop("task", None)


def test_nvfp4_gemv_problem_inputs_reference_and_baseline_agree_on_cpu():
    # The problem's inputs (generated here on the CPU): the blocked view holds the plain scales
    # at the documented places, and the plain-torch baseline matches the float64 reference.
    reference = _problem_module("quant/nvfp4_gemv", "reference")
    baseline = _problem_module("quant/nvfp4_gemv", "baseline")
    reference.DEVICE = "cpu"
    data = reference.generate_input(256, 192, 2, seed=3)
    a, b, sfa, sfb, sfa_blocked, sfb_blocked, c = data
    assert a.shape == (256, 96, 2) and a.dtype == torch.float4_e2m1fn_x2 and b.shape == (128, 96, 2)
    assert sfa_blocked.shape == (32, 4, 2, 4, 3, 2) and c.shape == (256, 1, 2)
    for i in range(2):
        memory = sfa_blocked.permute(5, 2, 4, 0, 1, 3)[i].reshape(-1)
        assert torch.equal(from_blocked(memory, 256, 12).view(torch.uint8), sfa[:, :, i].view(torch.uint8))
        r, col = 200, 7  # element (r % 32, (r % 128) // 32, r // 128, col % 4, col // 4, i)
        assert sfa_blocked[r % 32, (r % 128) // 32, r // 128, col % 4, col // 4, i] == sfa[r, col, i]
    expected = reference.ref_kernel(tuple(t.clone() for t in data))
    ours = baseline.custom_kernel(tuple(t.clone() for t in data))
    ok, why = reference.check_implementation(data, ours)
    assert ok, why
    assert expected.abs().max() > 1  # not all zeros


@pytest.mark.parametrize("problem, args", [("nvfp4_gemm", (256, 384, 256, 2)),
                                           ("nvfp4_dual_gemm", (256, 128, 512, 2))])
def test_nvfp4_gemm_problems_reference_and_baseline_agree_on_cpu(problem, args):
    reference = _problem_module(f"quant/{problem}", "reference")
    baseline = _problem_module(f"quant/{problem}", "baseline")
    reference.DEVICE = "cpu"
    data = reference.generate_input(*args, seed=4)
    *operands, c = data
    scales = [t for t in operands if t.dtype == torch.float8_e4m3fn and t.dim() == 3]
    views = [t for t in operands if t.dim() == 6]
    for plain, view in zip(scales, views):
        memory = view.permute(5, 2, 4, 0, 1, 3)[1].reshape(-1)
        rows, cols = plain.shape[:2]
        assert torch.equal(from_blocked(memory, rows, cols).view(torch.uint8), plain[:, :, 1].view(torch.uint8))
    expected = reference.ref_kernel(tuple(t.clone() for t in data))
    ok, why = reference.check_implementation(data, baseline.custom_kernel(tuple(t.clone() for t in data)))
    assert ok, why
    assert expected.float().abs().max() > 1
