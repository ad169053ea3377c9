"""Error types raised at the op boundary, before any kernel runs.

Every error names the argument, the value it had and what is supported, so a user
mistake never surfaces as a DSL traceback.
"""


class CuteKernelsError(Exception):
    """Base class of every error this library raises on purpose."""


class UnsupportedError(CuteKernelsError, ValueError):
    """A value (shape, dim, option, layout) outside what the kernel supports."""


class DTypeError(CuteKernelsError, TypeError):
    """A tensor dtype the op does not accept."""


class DeviceError(CuteKernelsError, ValueError):
    """A tensor on the wrong device, or tensors on different devices."""


class NoGPUError(CuteKernelsError, RuntimeError):
    """A kernel was called where no CUDA device is present."""


class CompileError(CuteKernelsError, RuntimeError):
    """The DSL failed to compile a kernel configuration (a library bug: please report)."""


def describe(value) -> str:
    """A short, readable rendering of an argument for error messages."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        device = getattr(value, "device", None)
        return f"tensor(shape={tuple(shape)}, dtype={dtype}, device={device})"
    return repr(value)
