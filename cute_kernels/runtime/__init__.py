"""The only code that talks to the DSL's compile and launch machinery."""

from .arch import has_gpu, target_arch
from .compile import (
    KERNELS,
    CompileReport,
    ScalarSpec,
    StreamSpec,
    Sym,
    TensorSpec,
    get_kernel,
    inspect_kernel,
)
from .custom_op import kernel_op
from .dtypes import dtype_name
from .errors import (
    CompileError,
    CuteKernelsError,
    DeviceError,
    DTypeError,
    NoGPUError,
    UnsupportedError,
)
