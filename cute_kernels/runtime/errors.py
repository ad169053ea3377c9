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


def check_tensor(name: str, t, dtypes: tuple, like=None) -> None:
    """Raise a clear error unless ``t`` is a CUDA tensor of one of ``dtypes`` (on the same device
    as ``like`` when given)."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        raise DeviceError(f"{name} must be a CUDA tensor, got device {t.device} ({describe(t)})")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise DTypeError(f"{name} has dtype {t.dtype}; supported: {names}")
    if like is not None and t.device != like.device:
        raise DeviceError(f"{name} is on {t.device} but the other inputs are on {like.device}")
