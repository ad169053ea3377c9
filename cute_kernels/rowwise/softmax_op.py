"""``softmax``: the torch-facing op, its custom ops and autograd.

The public function validates its input, views it as (M, N) rows (moving ``dim`` last and
copying only when the last dim is not contiguous or the leading dims cannot be flattened), picks
the vector width from the actual strides and pointers, and calls the compiled kernel.
"""

from __future__ import annotations

import torch

from ..runtime import DTypeError, UnsupportedError, kernel_op
from ..runtime.errors import check_tensor
from .config import row_config
from .dispatch import ITEMSIZE, RowKernels, row_specs, vector_width, widest_itemsize

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_ROW_LENGTH = 524288  # forward; half of it when a gradient is needed (config.row_config)

def _build(backward: bool, tensors_held: int):
    def build(key, vec):
        # The kernel module is imported at the first compile, not with the package.
        from .softmax import SoftmaxBwdSm90, SoftmaxFwdSm90

        dtypes, n = key[:-1], key[-1]
        config = row_config(n, vec, widest_itemsize(dtypes), tensors_held, wide_clusters=True)
        return SoftmaxBwdSm90 if backward else SoftmaxFwdSm90, config, row_specs(dtypes, n, vec)

    build.tensors_held = tensors_held
    return build


_forward_kernels = RowKernels(_build(backward=False, tensors_held=1))
_backward_kernels = RowKernels(_build(backward=True, tensors_held=2))


@kernel_op("softmax_fwd", mutates_args=("y",))
def softmax_fwd(x: torch.Tensor, y: torch.Tensor) -> None:
    """y[M, N] = softmax(x[M, N]) along N. Last dims contiguous; M >= 1."""
    _forward_kernels((x.dtype, y.dtype, x.shape[1]), (x, y), x, y)


@kernel_op("softmax_bwd", mutates_args=("dx",))
def softmax_bwd(y: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor) -> None:
    """dx[M, N] = y * (dy - sum(dy * y)) along N. Last dims contiguous; M >= 1."""
    _backward_kernels((y.dtype, dy.dtype, dx.dtype, y.shape[1]), (y, dy, dx), y, dy, dx)


def _validate(x, dim, out_dtype) -> int:
    if not isinstance(x, torch.Tensor) or not x.is_cuda or x.dtype not in FLOAT_DTYPES:
        check_tensor("x", x, FLOAT_DTYPES)  # raises the matching error
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise DTypeError(f"out_dtype={out_dtype} is not supported; use float32, float16 or bfloat16")
    ndim = x.dim() or 1
    if type(dim) is not int or not -ndim <= dim < ndim:
        raise UnsupportedError(
            f"dim={dim!r} is out of range for a tensor of {x.dim()} dims "
            f"(expected an int in [{-ndim}, {ndim - 1}])"
        )
    return dim % ndim


def _as_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """View ``t`` as (M, N) rows along ``dim`` with a contiguous last dim (copying if needed)."""
    if t.dim() == 0:
        t = t.reshape(1)
    if dim != t.dim() - 1:
        t = t.movedim(dim, -1)
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1])


def _from_rows(rows: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of :func:`_as_rows` for a fresh (M, N) result shaped after ``like``."""
    if like.dim() == 0:
        return rows.reshape(())
    if dim != like.dim() - 1:
        shape = list(like.shape)
        shape.append(shape.pop(dim))
        return rows.view(shape).movedim(-1, dim)
    return rows.view(like.shape)


def _forward(x: torch.Tensor, dim: int, out_dtype) -> torch.Tensor:
    if dim == 1 and x.dim() == 2 and x.is_contiguous() and x.numel():  # already (M, N) rows
        y = torch.empty_like(x) if out_dtype is None else torch.empty_like(x, dtype=out_dtype)
        softmax_fwd(x, y)
        return y
    if x.numel() == 0:
        return torch.empty_like(x, dtype=out_dtype or x.dtype)
    x2 = _as_rows(x, dim)
    y2 = torch.empty(x2.shape, dtype=out_dtype or x.dtype, device=x.device)
    softmax_fwd(x2, y2)
    return _from_rows(y2, x, dim)


def _backward(y: torch.Tensor, dy: torch.Tensor, dim: int, dx_dtype) -> torch.Tensor:
    if y.numel() == 0:
        return torch.empty_like(y, dtype=dx_dtype)
    y2, dy2 = _as_rows(y, dim), _as_rows(dy, dim)
    dx2 = torch.empty(y2.shape, dtype=dx_dtype, device=y.device)
    softmax_bwd(y2, dy2, dx2)
    return _from_rows(dx2, y, dim)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, out_dtype):
        y = _forward(x, dim, out_dtype)
        ctx.save_for_backward(y)
        ctx.dim = dim
        ctx.x_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        check_tensor("grad of softmax output", dy, FLOAT_DTYPES)
        return _backward(y, dy, ctx.dim, ctx.x_dtype), None, None


def softmax(x: torch.Tensor, dim: int = -1, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Softmax of ``x`` along ``dim``, differentiable.

    Args:
        x: CUDA tensor, float32, float16 or bfloat16, any shape (0-d included).
        dim: the dim to normalize over.
        out_dtype: dtype of the result (default: x's dtype). The math is fp32 either way.

    Returns a tensor of x's shape. The gradient flows back in x's dtype.

    Constraints:
      - row length (size of ``dim``) up to 524288 (262144 when a gradient is needed)
      - a non-last ``dim`` or a non-contiguous last dim costs one copy of x
      - NaN anywhere in a row, or a row of only -inf, gives a NaN row (as torch.softmax)
    """
    if (type(x) is torch.Tensor and (dim == -1 or dim == 1) and out_dtype is None
            and x.is_cuda and x.dim() == 2 and x.dtype in FLOAT_DTYPES and x.is_contiguous()
            and x.numel() and not (x.requires_grad and torch.is_grad_enabled())
            and not torch.compiler.is_compiling()):
        # The common eager call, (M, N) rows without a gradient: straight to the kernel lookup
        # (host time per call is what small softmaxes cost).
        y = torch.empty_like(x)
        _forward_kernels((x.dtype, x.dtype, x.shape[1]), (x, y), x, y)
        return y
    d = _validate(x, dim, out_dtype)
    if x.requires_grad and torch.is_grad_enabled():
        if x.numel():
            row_config(x.shape[d] if x.dim() else 1, 1, 4, tensors_held=2)  # refuse before running
        return _Softmax.apply(x, d, out_dtype)
    return _forward(x, d, out_dtype)


# Row lengths that reach every branch of ``row_config`` (each threads-per-row and cluster bucket,
# tiles that cover the row exactly and ones that overhang it) plus the awkward sizes the tests use.
SAMPLE_ROW_LENGTHS = (1, 7, 64, 100, 192, 760, 1128, 3072, 4096, 6144, 8192, 16384, 32768,
                      65536, 131072, 262144, 524288)
_BF16, _FP16, _FP32 = torch.bfloat16, torch.float16, torch.float32
_FORWARD_DTYPES = ((_BF16, _BF16), (_FP16, _FP16), (_FP32, _FP32), (_BF16, _FP32))
_BACKWARD_DTYPES = ((_BF16, _BF16, _BF16), (_FP16, _FP16, _FP16), (_FP32, _FP32, _FP32),
                    (_FP32, _FP32, _BF16))


def compile_configurations(quick: bool = False):
    """(kernel class, config, argument specs) for every softmax configuration the op can pick
    over ``SAMPLE_ROW_LENGTHS``, every dtype mix and the narrower vector widths that misaligned
    inputs fall back to. ``quick`` keeps one dtype mix and the largest vector width."""
    found = {}
    lengths = SAMPLE_ROW_LENGTHS if not quick else (7, 1128, 4096, 65536, 262144)
    for kernels, mixes in ((_forward_kernels, _FORWARD_DTYPES), (_backward_kernels, _BACKWARD_DTYPES)):
        held = kernels.build.tensors_held
        for dtypes in mixes[:1] if quick else mixes:
            widest = max(ITEMSIZE[d] for d in dtypes)
            for n in lengths:
                if n > MAX_ROW_LENGTH // held:
                    continue
                top = vector_width(n, widest, 0)
                vecs = [top] if quick or n != 4096 else [v for v in (1, 2, 4, 8) if v <= top]
                for vec in vecs:
                    found[(held, vec, n, dtypes)] = kernels.build(dtypes + (n,), vec)
    return list(found.values())


def self_checks():
    """Rows of the ``python -m cute_kernels`` table for softmax."""
    from ..reference import softmax_backward_ref, softmax_ref
    from ..runtime.selfcheck import SelfCheck

    checks = []
    for m, n, dtype, tol in ((4096, 4096, torch.bfloat16, 1e-2), (512, 1000, torch.float32, 1e-5),
                             (256, 131072, torch.bfloat16, 1e-2)):
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        y = torch.softmax(x, -1)
        dy = torch.randn_like(x)
        name = str(dtype).removeprefix("torch.")
        checks.append(SelfCheck("softmax_fwd", f"{m}x{n}", name, lambda x=x: softmax(x),
                                lambda x=x: torch.softmax(x, -1), softmax_ref(x), tol))
        checks.append(SelfCheck(
            "softmax_bwd", f"{m}x{n}", name, lambda y=y, dy=dy: _backward(y, dy, 1, y.dtype),
            lambda y=y, dy=dy: torch._softmax_backward_data(dy, y, -1, y.dtype),
            softmax_backward_ref(y, dy), tol))
    return checks
