"""Plain-torch float64 references, shared by tests, benchmarks and the self-check."""

from .attention import attention_mask, attention_ref, attention_varlen_ref
from .cross_entropy import cross_entropy_ref
from .gemm import gemm_ref
from .norms import layer_norm_ref, rms_norm_ref
from .quant import dequantize_int8_ref, gemm_int8_ref, quantize_int8_ref
from .softmax import softmax_backward_ref, softmax_ref
