"""cute-kernels: Hopper GPU kernels written in the CuTe Python DSL, called as torch functions.

    import cute_kernels as ck
    y = ck.softmax(x, dim=-1)
"""

from . import _dsl  # noqa: F401  (the DSL on sys.path before anything imports cutlass)
from .attention.op import flash_attn, flash_attn_varlen
from .attention.packed import (flash_attn_kvpacked, flash_attn_qkvpacked,
                               flash_attn_varlen_kvpacked, flash_attn_varlen_qkvpacked)
from .gemm.op import gemm, gemm_fp8
from .losses.fused_linear_cross_entropy import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from .quant.int8 import Int8Linear, dequantize_int8, gemm_int8, quantize_int8
from .quant.nvfp4 import nvfp4_dequantize, nvfp4_quantize
from .quant.nvfp4_gemm import (NVFP4Linear, NVFP4Weight, gemm_nvfp4, gemm_w4a16, gemv_nvfp4,
                               nvfp4_dual_gemm, nvfp4_prepare_weight)
from .rowwise.cross_entropy_op import cross_entropy
from .rowwise.modules import CrossEntropyLoss, LayerNorm, RMSNorm
from .rowwise.norm_op import layer_norm, rms_norm
from .rowwise.softmax_op import softmax
from .runtime.errors import (
    CompileError,
    CuteKernelsError,
    DeviceError,
    DTypeError,
    NoGPUError,
    UnsupportedError,
)

__version__ = "0.1.0"

__all__ = [
    "flash_attn",
    "flash_attn_varlen",
    "flash_attn_qkvpacked",
    "flash_attn_kvpacked",
    "flash_attn_varlen_qkvpacked",
    "flash_attn_varlen_kvpacked",
    "gemm",
    "gemm_fp8",
    "gemm_int8",
    "quantize_int8",
    "dequantize_int8",
    "Int8Linear",
    "nvfp4_quantize",
    "nvfp4_dequantize",
    "gemm_w4a16",
    "gemm_nvfp4",
    "gemv_nvfp4",
    "nvfp4_dual_gemm",
    "NVFP4Linear",
    "NVFP4Weight",
    "nvfp4_prepare_weight",
    "softmax",
    "rms_norm",
    "layer_norm",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "RMSNorm",
    "LayerNorm",
    "CrossEntropyLoss",
    "FusedLinearCrossEntropyLoss",
    "CuteKernelsError",
    "CompileError",
    "DeviceError",
    "DTypeError",
    "NoGPUError",
    "UnsupportedError",
]
