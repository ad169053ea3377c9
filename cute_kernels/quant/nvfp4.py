"""NVFP4: ``nvfp4_quantize`` (one fused pass, ``nvfp4_quantize_sm90.py``) and
``nvfp4_dequantize``; formats and the reference rules in ``formats.py``."""

from __future__ import annotations

import torch

from ..runtime import DTypeError, StreamSpec, Sym, TensorSpec, UnsupportedError, get_kernel, kernel_op
from ..runtime.dtypes import dtype_name
from ..runtime.errors import check_tensor, describe
from .formats import BLOCK, SCALE_LAYOUTS, default_global_scale

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _specs(x_dtype: str, scale_layout: str) -> tuple:
    width = torch.finfo(getattr(torch, x_dtype)).bits // 8
    scales = (TensorSpec.rowmajor("uint8", (Sym(), Sym()), 1, align=1) if scale_layout == "plain"
              else TensorSpec("uint8", (Sym(),), (1,), 1))
    return (TensorSpec.rowmajor(x_dtype, (Sym(), Sym(divisibility=BLOCK)), 16 // width, align=16),
            TensorSpec.rowmajor("uint8", (Sym(), Sym(divisibility=BLOCK // 2)), BLOCK // 2, align=16),
            scales, TensorSpec("float32", (1,), (1,), 4), StreamSpec())


def _kernel(x_dtype: torch.dtype, scale_layout: str):
    """The compiled quantize kernel for this input dtype and scale layout (kept here: the
    compile cache's own lookup hashes the argument specs, tens of microseconds)."""
    fn = _kernels.get((x_dtype, scale_layout))
    if fn is None:
        from .nvfp4_quantize_sm90 import QuantizeNvfp4Sm90  # imported at the first compile

        fn = _kernels[x_dtype, scale_layout] = get_kernel(
            QuantizeNvfp4Sm90, scale_layout, _specs(dtype_name(x_dtype), scale_layout))
    return fn


_kernels: dict = {}


@kernel_op("nvfp4_quantize_blocks", mutates_args=("packed", "scales"),
           schema="(Tensor x, Tensor(a!) packed, Tensor(b!) scales, Tensor global_scale, "
           "str scale_layout) -> ()")
def nvfp4_quantize_blocks(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                          global_scale: torch.Tensor, scale_layout: str) -> None:
    """Packed codes (M, K / 2) and e4m3 scale bytes of x (M, K) (``nvfp4_quantize_sm90``);
    ``global_scale`` a one-element fp32 tensor on x's device; x's rows on 16 bytes (a data
    pointer that is not is copied here)."""
    _kernel(x.dtype, scale_layout)(x.clone() if x.data_ptr() % 16 else x, packed, scales, global_scale)


def _blocked_entries(rows: int, columns: int) -> int:
    return -(-rows // 128) * 128 * (-(-columns // 4) * 4)


def nvfp4_quantize(x, global_scale=None, scale_layout: str = "plain"):
    """Quantize ``x`` (M, K) to NVFP4: ``(packed, scales, global_scale)``.

    ``x ~ e2m1(packed) * float(scales) * global_scale`` per block of 16 values along K: packed
    uint8 (M, K / 2), two e2m1 codes per byte (element 2j in the low nibble: the bytes of
    ``torch.float4_e2m1fn_x2``, ``formats.as_float4_x2``); scales float8_e4m3fn, (M, K / 16)
    for ``scale_layout="plain"`` or the flat 128 x 4 "blocked" layout of cuBLAS / CUTLASS block
    scaling (``formats.to_blocked``); global_scale a float32 scalar tensor.

    Args:
        x: bf16 / fp16 / fp32 CUDA tensor (M, K), K a multiple of 16.
        global_scale: float or one-element tensor; default amax(|x|) / (6 * 448), computed on
            the GPU (1 for an all-zero x or one holding NaN), so the block scales use e4m3's
            whole range.

    Bit-identical to ``cute_kernels.quant.formats.nvfp4_quantize_ref``: block scale
    ``e4m3(amax / 6 / global_scale)`` rounded to nearest even and clamped to [0, 448], codes
    ``e2m1(x / (scale * global_scale))`` rounded to nearest even, saturated at 6; a block
    holding NaN gets scale 0 (codes 0), +-inf saturates.

    Constraints:
      - one pass over x (``nvfp4_quantize_sm90.py``); the default global scale adds torch's
        amax pass before it; rows with a stride or data pointer that is not a multiple of 16
        bytes are copied first
      - no autograd (quantization is not differentiable)
    """
    check_tensor("x", x, FLOAT_DTYPES)
    if x.dim() != 2 or x.shape[1] % BLOCK:
        raise UnsupportedError(f"x must be (M, K) with K a multiple of {BLOCK}, got {describe(x)}")
    if scale_layout not in SCALE_LAYOUTS:
        raise UnsupportedError(f"scale_layout={scale_layout!r}; supported: {SCALE_LAYOUTS}")
    if global_scale is None:
        global_scale = default_global_scale(x)
    elif isinstance(global_scale, torch.Tensor):
        if global_scale.numel() != 1 or not global_scale.is_floating_point():
            raise UnsupportedError(f"global_scale must be one floating-point value, got "
                                   f"{describe(global_scale)}")
        global_scale = global_scale.to(device=x.device, dtype=torch.float32).reshape(())
    elif isinstance(global_scale, (int, float)):
        global_scale = torch.tensor(float(global_scale), dtype=torch.float32, device=x.device)
    else:
        raise TypeError(f"global_scale must be None, a float or a tensor, got {global_scale!r}")
    m, k = x.shape
    packed = torch.empty((m, k // 2), dtype=torch.uint8, device=x.device)
    if scale_layout == "plain":
        scales = torch.empty((m, k // BLOCK), dtype=torch.uint8, device=x.device)
    else:
        entries = _blocked_entries(m, k // BLOCK)
        whole = m % 128 == 0 and (k // BLOCK) % 4 == 0
        scales = (torch.empty if whole else torch.zeros)(entries, dtype=torch.uint8, device=x.device)
    if m and k:
        if m == 1:  # a single row's stride is free (torch may give it any value)
            x = x.as_strided((1, k), (k, x.stride(1)))
        if x.stride(1) != 1 or x.stride(0) * x.element_size() % 16:
            x = x.contiguous()
        if torch.compiler.is_compiling():
            nvfp4_quantize_blocks(x, packed, scales, global_scale.reshape(1), scale_layout)
        else:  # eager: straight to the kernel (the op's dispatch costs more than the launch)
            _kernel(x.dtype, scale_layout)(x.clone() if x.data_ptr() % 16 else x, packed, scales,
                                           global_scale.reshape(1))
    return packed, scales.view(torch.float8_e4m3fn), global_scale


def nvfp4_dequantize(packed, scales, global_scale=1.0, scale_layout: str = "plain",
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The values of NVFP4 data (``nvfp4_quantize``'s outputs) as ``dtype``: (M, K), or
    (L, M, K) for batched data.

    Args:
        packed: uint8 / float4_e2m1fn_x2 (M, K / 2) or (L, M, K / 2).
        scales: e4m3 (M, K / 16) / (L, M, K / 16) plain, or the flat blocked layout (entries,) /
            (L, entries).
        global_scale: float or one-element tensor (read on the GPU).

    ``(code * scale) * global_scale`` in fp32 (exact but for the global scale's one rounding),
    rounded once to ``dtype``: bit-identical to ``formats.nvfp4_dequantize_ref``.

    Constraints:
      - one kernel (``nvfp4_dequantize_sm90``) for K a multiple of 32; other widths take the
        torch rule
    """
    from .nvfp4_gemm import DEQUANT_OUT_DTYPES, _check_layout, _check_nvfp4, _decode

    _check_layout(scale_layout)
    if dtype not in DEQUANT_OUT_DTYPES:
        raise DTypeError(f"dtype={dtype}; supported: {DEQUANT_OUT_DTYPES}")
    batched = isinstance(packed, torch.Tensor) and packed.dim() == 3
    p, s = _check_nvfp4("packed", packed, "scales", scales, scale_layout, batched)
    out = _decode(p, s, scale_layout, dtype, global_scale)
    return out if batched else out[0]


def compile_configurations(quick: bool = False):
    """(kernel, config, specs) of the quantize kernel (each input dtype and scale layout) and of
    the NVFP4 product kernels (``nvfp4_gemm.compile_configurations``)."""
    from .nvfp4_quantize_sm90 import QuantizeNvfp4Sm90

    from .nvfp4_gemm import compile_configurations as product_configurations

    found = [(QuantizeNvfp4Sm90, layout, _specs(dtype, layout))
             for dtype in ("bfloat16", "float16", "float32") for layout in SCALE_LAYOUTS]
    return found[:1] + product_configurations(quick=True) if quick else found + product_configurations()


def self_checks():
    """Rows of the ``python -m cute_kernels`` table for NVFP4: the quantize kernel against its
    torch rule (codes must be identical)."""
    from ..runtime.selfcheck import SelfCheck
    from .formats import nvfp4_quantize_ref

    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16) * 3 + 0.5
    expected = nvfp4_quantize_ref(x)[0]
    return [SelfCheck("nvfp4_quantize", "8192x4096", "bfloat16", lambda: nvfp4_quantize(x)[0],
                      lambda: nvfp4_quantize_ref(x)[0], expected.double(), 0.0)]


