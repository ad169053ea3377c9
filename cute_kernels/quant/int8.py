"""int8: ``quantize_int8``, ``dequantize_int8``, the W8A8 GEMM ``gemm_int8`` and ``Int8Linear``.

The GEMM is the library's Hopper GEMM (``gemm/kernel_sm90.py``) with 8-bit integer operands:
s8 wgmma into int32 accumulators (``GemmSm90.accumulator_dtype``), exact over K; the epilogue
subtracts A's zero points times B's column sums in int32 (``Epilogue.zero_point``), then
applies the fp32 scales (per tensor, per row of A, per column of B) and the bias, as the fp8
GEMM does, and writes bf16 / fp16 / fp32 -- or, with nothing to apply, the exact int32 product.
The tile heuristic is the fp8 one without promotion (``choose_config(..., fast_accum=True)``):
both take 32 values of K per MMA at the same rate.
"""

from __future__ import annotations

import torch

from ..gemm.config import Epilogue, choose_config
from ..gemm.op import _aligned, _canonical, _major, _padded_row_major, _scale_kind, _tma_ready
from ..gemm.op import compiled_gemm, kernel_specs
from ..reference.quant import quantize_int8_ref
from ..rowwise.config import row_config
from ..rowwise.dispatch import RowKernels, widest_itemsize
from ..runtime import DTypeError, StreamSpec, Sym, TensorSpec, UnsupportedError, kernel_op
from ..runtime.arch import sm_count
from ..runtime.dtypes import dtype_name
from ..runtime.errors import check_tensor, describe

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLOAT_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GRANULARITIES = ("tensor", "row", "column")


# ---------------------------------------------------------------------------- quantization

def _quantize_build(key, vec):
    from .quantize_sm90 import QuantizeConfig, QuantizeRowsSm90  # imported at the first compile

    x_dtype, symmetric, n = key
    config = QuantizeConfig(_row_config(n, vec, x_dtype), symmetric)
    return QuantizeRowsSm90, config, _quantize_specs(dtype_name(x_dtype), n, vec, symmetric)


def _row_config(n, vec, x_dtype):
    from dataclasses import replace

    # Rows load straight into registers (no shared-memory staging in this kernel).
    return replace(row_config(n, vec, widest_itemsize((x_dtype,)), 1), stage_smem=False)


def _quantize_specs(x_dtype: str, n: int, vec: int, symmetric: bool) -> tuple:
    width = torch.finfo(getattr(torch, x_dtype)).bits // 8
    return (TensorSpec.rowmajor(x_dtype, (Sym("m"), n), vec, align=vec * width),
            TensorSpec.rowmajor("int8", (Sym("m"), n), vec, align=vec),
            TensorSpec("float32", (Sym("m"),), (1,), 4),
            None if symmetric else TensorSpec("int32", (Sym("m"),), (1,), 4),
            StreamSpec())


_quantize_kernels = RowKernels(_quantize_build)


@kernel_op("quantize_int8_rows", mutates_args=("q", "scale", "zero_point"),
           schema="(Tensor x, Tensor(a!) q, Tensor(b!) scale, Tensor(c!)? zero_point) -> ()")
def quantize_int8_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                       zero_point: torch.Tensor | None) -> None:
    """Per-row codes ``q`` (M, N), ``scale`` (M,) and, when given, asymmetric ``zero_point``
    (M,) of x (M, N); last dims contiguous, M >= 1."""
    _quantize_kernels((x.dtype, zero_point is None, x.shape[1]), (x, q), x, q, scale, zero_point)


def quantize_int8(x, granularity: str = "row", symmetric: bool = True):
    """Quantize ``x`` to int8: ``(q, scale, zero_point)`` with ``x ~ (q - zero_point) * scale``.

    Args:
        x: fp32 / fp16 / bf16 CUDA tensor. ``granularity``: "row" (one scale per row of the
            last dim, i.e. per token; leading dims are rows), "column" (2-D x: one per column,
            e.g. per output channel of a (K, N) weight) or "tensor" (one for all of x).
        symmetric: True -> ``scale = amax / 127``, codes in [-127, 127], ``zero_point`` None;
            False -> ``scale = (max - min) / 255`` over a range that includes 0, int32 zero
            points, codes in [-128, 127].

    Returns q int8 (x's shape), scale fp32 and zero_point int32 (or None) shaped to broadcast
    against x: (*x.shape[:-1], 1) per row, (1, N) per column, () per tensor.

    Codes are ``rint(x * (1 / scale))``, rounded half to even, with the inverse an IEEE
    division (one per row / column / tensor); results are bit-identical to
    ``cute_kernels.reference.quantize_int8_ref``. A slice of zeros has scale 0 (its codes are 0,
    or the zero point); a slice holding NaN or +-inf gets a NaN scale, so it dequantizes to NaN.

    Constraints:
      - "row": one fused pass (read x once, write codes and scales: ``quantize_sm90.py``),
        rows of at most 524288 elements; "tensor" and "column" need the range of the whole
        tensor / column before any code, so they run as torch reductions plus one elementwise
        pass
      - no autograd (quantization is not differentiable)
    """
    if (type(x) is torch.Tensor and granularity == "row" and symmetric is True and x.is_cuda
            and x.dim() == 2 and x.dtype in FLOAT_DTYPES and x.is_contiguous() and x.numel()
            and x.shape[1] <= 524288 and not torch.compiler.is_compiling()):
        # The common eager call, symmetric (M, K) rows: straight to the kernel lookup (host
        # time is what per-token quantization of a few tokens costs).
        m = x.shape[0]
        q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
        scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
        _quantize_kernels((x.dtype, True, x.shape[1]), (x, q), x, q, scale.view(m), None)
        return q, scale, None
    check_tensor("x", x, FLOAT_DTYPES)
    if granularity not in GRANULARITIES:
        raise UnsupportedError(f"granularity={granularity!r}; supported: {GRANULARITIES}")
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be a bool, got {symmetric!r}")
    if granularity == "column" and x.dim() != 2:
        raise UnsupportedError(f"granularity='column' needs a 2-D x, got shape {tuple(x.shape)}")
    if granularity == "row" and x.dim() >= 1 and x.numel() and x.shape[-1] <= 524288:
        return _quantize_rows(x, symmetric)
    if granularity == "row" and x.dim() >= 1 and x.shape[-1] > 524288:
        raise UnsupportedError(f"granularity='row' supports rows of at most 524288 elements, "
                               f"got {x.shape[-1]}")
    if x.dim() == 0:
        x = x.reshape(1)
    dims = {"row": (-1,), "column": (0,), "tensor": tuple(range(x.dim()))}[granularity]
    if x.numel() == 0:
        shape = list(x.shape)
        for d in dims:
            shape[d] = 1
        scale = torch.empty(shape if granularity != "tensor" else (), device=x.device)
        zero = None if symmetric else torch.empty_like(scale, dtype=torch.int32)
        return torch.empty_like(x, dtype=torch.int8), scale, zero
    return quantize_int8_ref(x, granularity, symmetric)  # the rule itself, in torch operations


def _quantize_rows(x, symmetric):
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    q = torch.empty(x2.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    zero = None if symmetric else torch.empty(m, dtype=torch.int32, device=x.device)
    quantize_int8_rows(x2, q, scale, zero)
    keep = (*x.shape[:-1], 1)
    return q.view(x.shape), scale.view(keep), None if zero is None else zero.view(keep)


def dequantize_int8(q, scale, zero_point=None, dtype=torch.float32):
    """``(q - zero_point) * scale`` in fp32, cast to ``dtype``; ``scale`` / ``zero_point``
    broadcast against q as ``quantize_int8`` returns them."""
    check_tensor("q", q, (torch.int8,))
    check_tensor("scale", scale, (torch.float32,), q)
    if dtype not in FLOAT_OUT_DTYPES:
        raise DTypeError(f"dtype={dtype}; supported: {FLOAT_OUT_DTYPES}")
    centered = q.float()
    if zero_point is not None:
        check_tensor("zero_point", zero_point, (torch.int32,), q)
        centered = (q.to(torch.int32) - zero_point).float()
    try:
        return (centered * scale).to(dtype)
    except RuntimeError:
        raise UnsupportedError(f"scale {tuple(scale.shape)} does not broadcast against q "
                               f"{tuple(q.shape)}") from None


# ---------------------------------------------------------------------------- GEMM

@kernel_op(
    "gemm_int8",
    mutates_args=("d",),
    schema="(Tensor a, Tensor b, Tensor(a!) d, Tensor? bias, Tensor? scale_a, Tensor? scale_b, "
    "Tensor? zero_a, Tensor? sum_b) -> ()",
)
def gemm_int8_out(a, b, d, bias, scale_a, scale_b, zero_a, sum_b) -> None:
    """d (M, N) = epilogue(a (M, K) @ b (K, N)) for TMA-ready int8 a (row-major) and b
    (column-major); see ``gemm_int8``."""
    a, b = _aligned(a), _aligned(b)
    if d.data_ptr() % 16:
        staged = _aligned(d)
        gemm_int8_out(a, b, staged, bias, scale_a, scale_b, zero_a, sum_b)
        d.copy_(staged)
        return
    _int8_kernel(a, b, d, bias, scale_a, scale_b, zero_a, sum_b)(
        a, b, d, None, bias, scale_a, scale_b, 1.0, 0.0, zero_a, sum_b)


_kernels: dict = {}


def _int8_kernel(a, b, d, bias, scale_a, scale_b, zero_a, sum_b):
    m, k = a.shape
    n = b.shape[1]
    key = (d.dtype, m, n, k, None if bias is None else bias.dtype, _scale_kind(scale_a),
           _scale_kind(scale_b), zero_a is not None)
    fn = _kernels.get(key)
    if fn is None:
        epilogue = Epilogue(bias is not None, row_scale=_scale_kind(scale_a) == "vector",
                            col_scale=_scale_kind(scale_b) == "vector",
                            scalar_scale_a=_scale_kind(scale_a) == "tensor",
                            scalar_scale_b=_scale_kind(scale_b) == "tensor",
                            zero_point=zero_a is not None)
        config = choose_config(m, n, k, 1, 1, sm_count(a.device.index or 0), epilogue,
                               fast_accum=True)
        specs = kernel_specs(a, b, d, None, bias, scale_a, scale_b, config, zero_a, sum_b)
        fn = _kernels[key] = compiled_gemm(config, specs)
    return fn


def _vector(name, t, size, dtype, like):
    """``t`` as a contiguous 1-D tensor of ``size`` values (or 1 for a per-tensor value)."""
    check_tensor(name, t, (dtype,), like)
    if t.numel() not in (1, size) or sum(1 for s in t.shape if s != 1) > 1:
        raise UnsupportedError(f"{name} must hold 1 or {size} values ((), ({size},), ({size}, 1) "
                               f"or (1, {size})), got shape {tuple(t.shape)}")
    return t if t.dim() == 1 and t.is_contiguous() else t.reshape(-1).contiguous()


def gemm_int8(a_q, b_q, *, scale_a=None, scale_b=None, zero_point_a=None, b_sums=None,
              bias=None, out_dtype=None):
    """``scale_a * scale_b * ((a_q - zero_point_a) @ b_q.T) + bias`` with int8 operands on the
    s8 tensor cores, accumulated exactly in int32.

    Args:
        a_q: int8 (M, K), K-major (row-major), e.g. per-token activations from
            ``quantize_int8(x, "row")``.
        b_q: int8 (N, K), K-major, as ``nn.Linear`` stores its weight.
        scale_a: fp32, one value or one per row of a ((M,) or (M, 1)).
        scale_b: fp32, one value or one per row of b_q, i.e. per output column ((N,) or (N, 1)).
        zero_point_a: int32, one value or one per row of a: asymmetric activations. The
            epilogue subtracts ``zero_point_a[m] * b_sums[n]`` in int32.
        b_sums: int32 (N,), ``b_q.sum(1)``; computed here when a zero point is given without it
            (``Int8Linear`` keeps it with the weight).
        bias: (N,), fp32 / fp16 / bf16, added after the scales.
        out_dtype: int32 (the default when there are no scales and no bias: the exact integer
            product, zero points applied), or bf16 (the default otherwise) / fp16 / fp32.

    Constraints:
      - 2-D operands on one CUDA device; any M, N, K >= 0. K is zero-padded to a multiple of
        16 (a copy of both operands) when its rows are not 16-byte multiples
      - a_q and b_q K-major (what s8 wgmma reads); any other layout is an error that names the
        fix. int32 accumulation saturates (wgmma ``.satfinite``) beyond 2^31 - 1, i.e. only for
        K > 131072 with extreme codes
      - no autograd
    """
    plan_key = _plan_key(a_q, b_q, scale_a, scale_b, zero_point_a, b_sums, bias, out_dtype)
    plan = _plans.get(plan_key) if plan_key is not None else None
    if plan is not None:
        launch, out_dtype, n_pad = plan
        m, n = a_q.shape[0], b_q.shape[0]
        d = torch.empty((m, n_pad), dtype=out_dtype, device=a_q.device)[:, :n]
        flat = [None if t is None else t.view(-1) for t in (scale_a, scale_b, zero_point_a, b_sums)]
        try:
            launch(a_q, b_q.t(), d, None, bias, flat[0], flat[1], 1.0, 0.0, flat[2], flat[3])
            return d
        except ValueError:  # a misaligned data pointer: the general path copies
            pass
    check_tensor("a_q", a_q, (torch.int8,))
    check_tensor("b_q", b_q, (torch.int8,), a_q)
    for name, t in (("a_q", a_q), ("b_q", b_q)):
        if t.dim() != 2:
            raise UnsupportedError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    (m, k), (n, k_b) = a_q.shape, b_q.shape
    if k != k_b:
        raise UnsupportedError(f"a_q is (M, K) = {tuple(a_q.shape)} and b_q (N, K) = "
                               f"{tuple(b_q.shape)}: their K differ")
    if a_q.stride(-1) != 1 and m > 1 and k > 1:
        raise UnsupportedError(f"a_q must be K-major (row-major (M, K), stride(-1) == 1), got "
                               f"strides {a_q.stride()}: pass a_q.contiguous()")
    if b_q.stride(-1) != 1 and n > 1 and k > 1:
        raise UnsupportedError(f"b_q must be K-major (row-major (N, K) as nn.Linear stores its "
                               f"weight), got strides {b_q.stride()}: pass b_q.contiguous(), or "
                               f"w.t().contiguous() for a (K, N) matrix")
    given = (scale_a, scale_b, zero_point_a, b_sums)
    if scale_a is not None:
        scale_a = _vector("scale_a", scale_a, m, torch.float32, a_q)
    if scale_b is not None:
        scale_b = _vector("scale_b", scale_b, n, torch.float32, a_q)
    if zero_point_a is not None:
        zero_point_a = _vector("zero_point_a", zero_point_a, m, torch.int32, a_q)
        if zero_point_a.numel() != m:
            zero_point_a = zero_point_a.expand(m).contiguous()
        if b_sums is None:
            b_sums = b_q.sum(dim=1, dtype=torch.int32)
        else:
            b_sums = _vector("b_sums", b_sums, n, torch.int32, a_q)
            if b_sums.numel() != n:
                raise UnsupportedError(f"b_sums must hold {n} values, got {b_sums.numel()}")
    elif b_sums is not None:
        raise UnsupportedError("b_sums is only used with zero_point_a")
    if bias is not None:
        check_tensor("bias", bias, FLOAT_OUT_DTYPES, a_q)
        if tuple(bias.shape) != (n,):
            raise UnsupportedError(f"bias must be ({n},), got {describe(bias)}")
    floats = scale_a is not None or scale_b is not None or bias is not None
    if out_dtype is None:
        out_dtype = torch.bfloat16 if floats else torch.int32
    if out_dtype not in FLOAT_OUT_DTYPES + (torch.int32,):
        raise DTypeError(f"out_dtype={out_dtype}; supported: int32, {FLOAT_OUT_DTYPES}")
    if out_dtype == torch.int32 and floats:
        raise UnsupportedError("out_dtype=torch.int32 is the exact integer product: it takes no "
                               "scales and no bias (leave out_dtype unset for bf16)")
    size = out_dtype.itemsize
    n_pad = -(-n * size // 16) * 16 // size  # rows padded to 16 bytes for the TMA store
    d = torch.empty((m, n_pad), dtype=out_dtype, device=a_q.device)[:, :n]
    if d.numel() == 0:
        return d
    if k == 0:  # the epilogue alone: every product is 0, and so is every correction
        d.zero_()
        if bias is not None:
            d += bias.to(out_dtype)
        return d
    a, b = _canonical(a_q), _canonical(b_q.t())
    if _major(a) != "row" or not _tma_ready(a):
        a = _padded_row_major(a, 16)
    if _major(b) != "col" or not _tma_ready(b):
        b = _padded_row_major(b.t(), 16).t()
    if a.shape[1] != b.shape[0]:
        k_pad = max(a.shape[1], b.shape[0])
        a = torch.nn.functional.pad(a, (0, k_pad - a.shape[1]))
        b = torch.nn.functional.pad(b.t(), (0, k_pad - b.shape[0])).t()
    gemm_int8_out(a, b, d, bias, scale_a, scale_b, zero_point_a, b_sums)
    if (plan_key is not None and a is a_q and b.stride() == b_q.t().stride()
            and _flat_views_of_given(given, (scale_a, scale_b, zero_point_a, b_sums))):
        # Operands went to the kernel as they came and the vectors as flat views of what came:
        # the next call with the same shapes, strides and options may skip to the launch.
        _plans[plan_key] = (_int8_kernel(a, b, d, bias, scale_a, scale_b, zero_point_a, b_sums),
                            out_dtype, n_pad)
    return d


_plans: dict = {}  # eager launch plans of gemm_int8 calls (see ``gemm_int8``)


def _flat_views_of_given(given, used) -> bool:
    """Whether each vector the kernel used is the one given or a flat view of it (given
    contiguous, same size): not computed here (column sums), expanded or copied."""
    for g, v in zip(given, used):
        if v is None:
            continue
        if g is None or not (g is v or (g.is_contiguous() and g.numel() == v.numel())):
            return False
    return True


def _plan_key(a_q, b_q, *optional):
    """What decides an eager call's checks and kernel: the operands' and optional tensors'
    shapes, strides, dtypes and devices, and the output dtype; None while torch.compile traces
    or for arguments that are not tensors."""
    if torch.compiler.is_compiling():
        return None
    *tensors, out_dtype = optional
    key = [out_dtype]
    for t in (a_q, b_q, *tensors):
        if t is None:
            key.append(None)
        elif isinstance(t, torch.Tensor):
            key.append((t.shape, t.stride(), t.dtype, t.device))
        else:
            return None
    return tuple(key)


# ---------------------------------------------------------------------------- module

class Int8Linear(torch.nn.Module):
    """``nn.Linear`` at inference with int8 weights (static, per output channel) and int8
    activations (dynamic, per token), on ``gemm_int8``.

    ``forward(x)``: x (..., in_features) fp32 / fp16 / bf16 -> quantized per row (one fused
    pass) -> int8 GEMM with both scales, the zero points (``asymmetric=True``) and the bias in
    the epilogue -> x's dtype.

    Constraints:
      - CUDA; inference only (no gradients)
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 asymmetric: bool = False, device=None):
        super().__init__()
        self.in_features, self.out_features, self.asymmetric = in_features, out_features, asymmetric
        self.register_buffer("weight_q", torch.zeros(out_features, in_features, dtype=torch.int8,
                                                     device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, device=device))
        self.register_buffer("weight_sums", torch.zeros(out_features, dtype=torch.int32,
                                                        device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)

    @classmethod
    def from_float(cls, linear: torch.nn.Linear, asymmetric: bool = False) -> "Int8Linear":
        """Quantize ``linear``'s weight per output channel (symmetric int8); ``asymmetric``
        chooses how activations are quantized at run time."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"from_float takes an nn.Linear, got {type(linear).__name__}")
        weight = linear.weight.detach()
        check_tensor("linear.weight", weight, FLOAT_DTYPES)
        module = cls(linear.in_features, linear.out_features, linear.bias is not None,
                     asymmetric, weight.device)
        q, scale, _ = quantize_int8(weight, "row", symmetric=True)
        module.weight_q.copy_(q)
        module.weight_scale.copy_(scale.reshape(-1))
        module.weight_sums.copy_(q.sum(dim=1, dtype=torch.int32))
        if linear.bias is not None:
            module.bias = linear.bias.detach().float().clone()
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = None
        if not torch.compiler.is_compiling() and isinstance(x, torch.Tensor):
            key = (x.shape, x.stride(), x.dtype, x.device, self.asymmetric, self.bias is not None,
                   self.weight_q.device)
            plan = self._plans.get(key)
            if plan is not None:
                try:
                    return plan(x)
                except ValueError:  # a misaligned data pointer: the checked path
                    pass
        check_tensor("x", x, FLOAT_DTYPES, self.weight_q)
        if x.shape[-1] != self.in_features:
            raise UnsupportedError(f"x has {x.shape[-1]} features in its last dim, this layer "
                                   f"takes {self.in_features}")
        rows = x.reshape(-1, self.in_features)
        q, scale, zero = quantize_int8(rows, "row", symmetric=not self.asymmetric)
        y = gemm_int8(q, self.weight_q, scale_a=scale, scale_b=self.weight_scale,
                      zero_point_a=zero, b_sums=self.weight_sums if zero is not None else None,
                      bias=self.bias, out_dtype=x.dtype)
        if key is not None and x.is_contiguous() and rows.shape[0] and self.in_features:
            self._plans[key] = self._plan(rows.shape[0], x, q, scale, zero, y)
        return y.reshape(*x.shape[:-1], self.out_features)

    @property
    def _plans(self) -> dict:
        """Eager launch plans by input signature (not module state: never saved)."""
        plans = self.__dict__.get("_launch_plans")
        if plans is None:
            plans = self.__dict__["_launch_plans"] = {}
        return plans

    def _plan(self, m, x, q, scale, zero, y):
        """A call of this layer for inputs like ``x`` (contiguous, seen and checked once): the
        two compiled kernels launched straight, on fresh outputs."""
        k, n, out_dtype = self.in_features, self.out_features, x.dtype
        symmetric = zero is None
        quantize = _quantize_kernels.aligned.get((x.dtype, symmetric, k))
        if quantize is None:  # rows not 16-byte aligned: stay on the checked path
            return None
        scale_flat, zero_flat = scale.view(-1), None if symmetric else zero.view(-1)
        sums = None if symmetric else self.weight_sums
        gemm_launch = _int8_kernel(q, self.weight_q.t(), y, self.bias, scale_flat,
                                   self.weight_scale, zero_flat, sums)
        n_pad = -(-n * out_dtype.itemsize // 16) * 16 // out_dtype.itemsize
        shape = (*x.shape[:-1], n)

        def run(x):
            q = torch.empty((m, k), dtype=torch.int8, device=x.device)
            scale = torch.empty(m, dtype=torch.float32, device=x.device)
            zero = None if symmetric else torch.empty(m, dtype=torch.int32, device=x.device)
            quantize(x.view(m, k), q, scale, zero)
            d = torch.empty((m, n_pad), dtype=out_dtype, device=x.device)
            if n_pad != n:
                d = d[:, :n]
            gemm_launch(q, self.weight_q.t(), d, None, self.bias, scale, self.weight_scale, 1.0,
                        0.0, zero, sums)
            return d.view(shape) if n_pad == n else d.reshape(shape)

        return run

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, asymmetric={self.asymmetric}")


# ---------------------------------------------------------------------------- compile tests

def compile_configurations(quick: bool = False):
    """(kernel, config, specs) for every int8 GEMM configuration ``choose_config`` can return
    (the fp8-without-promotion tiles and clusters) with each epilogue ``gemm_int8`` builds,
    and the row quantize kernels (symmetric and not, one CTA and a cluster per row)."""
    from ..gemm.config import GemmConfig
    from ..gemm.kernel_sm90 import GemmSm90
    from ..runtime import ScalarSpec
    from .quantize_sm90 import QuantizeConfig, QuantizeRowsSm90

    a = TensorSpec("int8", (Sym(), Sym()), (Sym(divisibility=16), 1), 16)
    b = TensorSpec("int8", (Sym(), Sym()), (1, Sym(divisibility=16)), 16)
    out = {dt: TensorSpec(dt, (Sym(), Sym()), (Sym(divisibility=16 // size), 1), 16)
           for dt, size in (("int32", 4), ("bfloat16", 2), ("float16", 2), ("float32", 4))}
    vec = {dt: TensorSpec(dt, (Sym(),), (Sym(),), 4) for dt in ("float32", "int32")}
    bias = TensorSpec("bfloat16", (Sym(),), (Sym(),), 2)
    tail = (None, None, None, None, ScalarSpec("float32"), ScalarSpec("float32"), ScalarSpec("int64"),
            StreamSpec())
    # (epilogue, d, bias, scale_a, scale_b, zero_a, sum_b)
    epilogues = [
        (Epilogue(), out["int32"], None, None, None, None, None),
        (Epilogue(bias=True, row_scale=True, col_scale=True), out["bfloat16"], bias, vec["float32"],
         vec["float32"], None, None),
        (Epilogue(bias=True, row_scale=True, col_scale=True, zero_point=True), out["bfloat16"], bias,
         vec["float32"], vec["float32"], vec["int32"], vec["int32"]),
        (Epilogue(zero_point=True), out["int32"], None, None, None, vec["int32"], vec["int32"]),
        (Epilogue(scalar_scale_a=True, scalar_scale_b=True), out["float16"], None, vec["float32"],
         vec["float32"], None, None),
        (Epilogue(row_scale=True, col_scale=True), out["float32"], None, vec["float32"], vec["float32"],
         None, None),
    ]
    found = []
    tiles = ((128, 256, 1), (128, 256, 2), (128, 128, 1), (128, 128, 2), (64, 128, 1), (64, 128, 2))
    for tm, tn, cm in tiles[:1] if quick else tiles:
        for i, (epi, d, bias_spec, sa, sb, za, zb) in enumerate(epilogues[:2] if quick else epilogues):
            if i > 1 and (tm, tn, cm) != (128, 256, 1):
                continue  # the epilogue is the same code for every tile shape
            cfg = GemmConfig(tm, tn, cm, max_clusters=132 // cm, epilogue=epi)
            found.append((GemmSm90, cfg, (a, b, d, None, bias_spec, sa, sb, za, zb) + tail))
    rows = ((4096, torch.bfloat16), (100000, torch.bfloat16), (1000, torch.float32), (8192, torch.float16))
    for n, x_dtype in rows[:1] if quick else rows:
        width = x_dtype.itemsize
        for symmetric in (True, False):
            config = QuantizeConfig(_row_config(n, 16 // width, x_dtype), symmetric)
            found.append((QuantizeRowsSm90, config,
                          _quantize_specs(dtype_name(x_dtype), n, 16 // width, symmetric)))
    return found


def self_checks():
    """Rows of the ``python -m cute_kernels`` table for int8: the exact int32 product against
    ``torch._int_mm`` and the per-row quantize against its torch rule (both must be exact)."""
    from ..reference.quant import gemm_int8_ref
    from ..runtime.selfcheck import SelfCheck

    a = torch.randint(-128, 128, (4096, 4096), device="cuda", dtype=torch.int8)
    b = torch.randint(-128, 128, (4096, 4096), device="cuda", dtype=torch.int8)
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16) * 5 + 1
    return [
        SelfCheck("gemm_int8", "4096x4096x4096", "int8", lambda: gemm_int8(a, b),
                  lambda: torch._int_mm(a, b.t()), gemm_int8_ref(a, b), 0.0),
        SelfCheck("quantize_int8", "8192x4096", "bfloat16", lambda: quantize_int8(x)[0],
                  lambda: quantize_int8_ref(x)[0], quantize_int8_ref(x)[0].double(), 0.0),
    ]
