"""torch dtype <-> CuTe DSL dtype, by torch's dtype name (names keep compile keys printable)."""

from __future__ import annotations

import cutlass
import torch

_CUTLASS = {
    "float32": cutlass.Float32,
    "float16": cutlass.Float16,
    "bfloat16": cutlass.BFloat16,
    "float8_e4m3fn": cutlass.Float8E4M3FN,
    "float8_e5m2": cutlass.Float8E5M2,
    "int8": cutlass.Int8,
    "int16": cutlass.Int16,
    "uint8": cutlass.Uint8,
    "int32": cutlass.Int32,
    "int64": cutlass.Int64,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def cutlass_dtype(name: str):
    return _CUTLASS[name]


def itemsize(name: str) -> int:
    return _CUTLASS[name].width // 8
