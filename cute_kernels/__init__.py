"""cute-kernels: Hopper GPU kernels written in the CuTe Python DSL, called as torch functions.

    import cute_kernels as ck
    y = ck.softmax(x, dim=-1)
"""

from .norms.softmax_op import softmax
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
    "softmax",
    "CuteKernelsError",
    "CompileError",
    "DeviceError",
    "DTypeError",
    "NoGPUError",
    "UnsupportedError",
]
