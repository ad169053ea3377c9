"""``gemm`` and ``gemm_fp8``: torch-facing ops, layout handling and autograd."""

from __future__ import annotations

import itertools
import secrets
from dataclasses import replace

import torch

from ..runtime import (
    DTypeError,
    ScalarSpec,
    StreamSpec,
    Sym,
    TensorSpec,
    UnsupportedError,
    get_kernel,
    kernel_op,
)
from ..runtime.arch import sm_count, target_arch
from ..runtime.dtypes import dtype_name
from ..runtime.errors import check_tensor, describe
from .config import (ACTIVATIONS, PINGPONG_EPI_STAGES, WIDE_EPI_STAGES, WIDE_TILE, Epilogue, GemmConfig,
                     choose_config, narrow_tile_k_blocks)
from .tuning import tuned_config

INPUT_DTYPES = (torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)



def _major(t: torch.Tensor) -> str | None:
    """"row" if the last dim is contiguous, "col" if the one before is, else None."""
    if t.stride(-1) == 1:
        return "row"
    if t.stride(-2) == 1:
        return "col"
    return None


def _tma_ready(t: torch.Tensor) -> bool:
    """TMA needs 16-byte-aligned data and 16-byte multiples for every stride but the unit one.

    Alignment is judged from the storage offset (torch's allocators align storages to far more
    than 16 bytes) and not at all while torch.compile traces; ``gemm_out`` checks the real
    address before launching either way."""
    size = t.element_size()
    if not torch.compiler.is_compiling() and (t.storage_offset() * size) % 16:
        return False
    return all(s == 1 or (s * size) % 16 == 0 or d == 1 for s, d in zip(t.stride(), t.shape))


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its address is 16-byte aligned, else a copy with the same strides in
    fresh (aligned) memory. Only storages from foreign allocators ever take the copy."""
    if t.data_ptr() % 16 == 0:
        return t
    copy = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    copy.copy_(t)
    return copy


def _operand_spec(t: torch.Tensor) -> TensorSpec:
    """([L,] rows, cols) spec with the unit stride static, the others dynamic 16-byte multiples."""
    div = 16 // t.element_size()
    lead = (Sym(divisibility=div),) * (t.dim() - 2)
    if _major(t) == "row":
        stride = (*lead, Sym(divisibility=div), 1)
    else:
        stride = (*lead, 1, Sym(divisibility=div))
    return TensorSpec(dtype_name(t.dtype), (Sym(),) * t.dim(), stride, 16)


def _free_spec(t) -> TensorSpec | None:
    """Any-layout spec for tensors read element by element (C, bias, scales)."""
    if t is None:
        return None
    return TensorSpec(dtype_name(t.dtype), tuple(Sym() for _ in t.shape),
                      tuple(Sym() for _ in t.shape), t.element_size())


def kernel_specs(a, b, d, c, bias, scale_a, scale_b, config: GemmConfig, zero_a=None,
                 sum_b=None) -> tuple:
    """The kernel's argument specs for these operands (``None`` for the optional ones left out;
    the stream-K workspace and flags only where ``config.stream_k``; with ``config.pad_k`` a and b
    are the padded buffers, and the caller's rows and the grid barrier's flags come too)."""
    work = TensorSpec("float32", (Sym(),), (1,), 16) if config.stream_k else None
    flags = TensorSpec("int64", (Sym(),), (1,), 8) if config.stream_k or config.pad_k else None
    sources = (_source_rows_spec(a, "row"), _source_rows_spec(b, "col")) if config.pad_k else (None, None)
    return (_operand_spec(a), _operand_spec(b), _operand_spec(d), _free_spec(c), _free_spec(bias),
            _free_spec(scale_a), _free_spec(scale_b), _free_spec(zero_a), _free_spec(sum_b),
            work, flags, *sources, ScalarSpec("float32"),
            ScalarSpec("float32"), ScalarSpec("int64"), StreamSpec())


def _source_rows_spec(t: torch.Tensor, major: str) -> TensorSpec:
    """``pad_k``'s source operand: 2-D, K contiguous (a (M, K) row-major, b (K, N) column-major),
    the other stride any value."""
    stride = (Sym(), 1) if major == "row" else (1, Sym())
    return TensorSpec(dtype_name(t.dtype), (Sym(), Sym()), stride, t.element_size())


# Stream-K flag values: one per launch, never 0 (a cleared flag), starting at a random point so
# that leftover memory matches a launch's token with probability ~2^-62.
_tokens = itertools.count(secrets.randbits(62) | 1)


def stream_k_token() -> int:
    """A fresh stream-K flag value for one launch (never 0)."""
    return next(_tokens)


def compiled_gemm(config: GemmConfig, specs: tuple):
    """``launch(a, b, d, c, bias, scale_a, scale_b, alpha, beta, zero_a=None, sum_b=None)`` for
    one configuration and argument signature (``kernel_specs``). Stream-K configurations get a fresh workspace from
    torch's caching allocator at every launch (``tile_m * tile_n`` fp32 values and one int64
    flag per CTA of the grid) and a new token."""
    from .kernel_sm90 import GemmSm90  # the kernel module: imported at the first compile

    kernel = get_kernel(GemmSm90, config, specs)
    unit_alpha = not config.epilogue.alpha
    if config.pad_k:
        def launch_padding(a_pad, b_pad, d, bias, flags, a, b, alpha, beta):
            if unit_alpha and alpha != 1.0:
                raise _alpha_error(alpha)
            kernel(a_pad, b_pad, d, None, bias, None, None, None, None, None, flags, a, b, alpha, beta,
                   next(_tokens))
        return launch_padding
    if not config.stream_k:
        def launch(a, b, d, c, bias, scale_a, scale_b, alpha, beta, zero_a=None, sum_b=None):
            if unit_alpha and alpha != 1.0:
                raise _alpha_error(alpha)
            kernel(a, b, d, c, bias, scale_a, scale_b, zero_a, sum_b, None, None, None, None, alpha,
                   beta, 0)
        return launch
    ctas = config.cluster_m * config.cluster_n * config.max_clusters

    def launch_stream_k(a, b, d, c, bias, scale_a, scale_b, alpha, beta):
        if unit_alpha and alpha != 1.0:
            raise _alpha_error(alpha)
        work = torch.empty(ctas * config.tile_m * config.tile_n, dtype=torch.float32,
                           device=d.device)
        flags = torch.empty(ctas, dtype=torch.int64, device=d.device)
        kernel(a, b, d, c, bias, scale_a, scale_b, None, None, work, flags, None, None, alpha, beta,
               next(_tokens))
    return launch_stream_k


def _alpha_error(alpha) -> ValueError:
    return ValueError(f"alpha={alpha}: this kernel was compiled for alpha = 1 "
                      f"(Epilogue(alpha=True) takes any alpha)")


def _padded_row_major(t: torch.Tensor, cols_multiple: int) -> torch.Tensor:
    """A zero-padded row-major copy whose row length is a multiple of ``cols_multiple``."""
    cols = t.shape[-1]
    padded = torch.zeros((*t.shape[:-1], -(-cols // cols_multiple) * cols_multiple),
                         dtype=t.dtype, device=t.device)
    padded[..., :cols] = t
    return padded


@kernel_op(
    "gemm",
    mutates_args=("d",),
    schema="(Tensor a, Tensor b, Tensor(a!) d, Tensor? c, Tensor? bias, Tensor? scale_a, "
    "Tensor? scale_b, float alpha, float beta, str? activation, bool tuned, "
    "bool fast_accum=False) -> ()",
)
def gemm_out(a, b, d, c, bias, scale_a, scale_b, alpha: float, beta: float, activation,
             tuned: bool, fast_accum: bool = False) -> None:
    """d[L, M, N] = epilogue(a[L, M, K] @ b[L, K, N]) (or without L); operands TMA-compatible."""
    a, b = _aligned(a), _aligned(b)
    if d.data_ptr() % 16:
        staged = _aligned(d)
        gemm_out(a, b, staged, c, bias, scale_a, scale_b, alpha, beta, activation, tuned, fast_accum)
        d.copy_(staged)
        return
    _kernel_for(a, b, d, c, bias, scale_a, scale_b, activation, tuned, fast_accum, alpha != 1.0)(
        a, b, d, c, bias, scale_a, scale_b, alpha, beta)


# Products of a few rows (M <= SKINNY_M) against many weight rows run transposed, D^T = B^T A^T:
# the weight's rows fill the MMA's M and the few tokens its N (64 x 16..64 tiles,
# ``choose_config``), a data-parallel grid of 64-row weight slabs, instead of 64-row tiles that
# are mostly padding. Measured (H200, ours / cuBLAS TFLOP/s, weight (N, K), transposed vs the
# 64 x 128 tiles): 1 x 4096 x 4096 1.50 vs 1.35 (cuBLAS 1.15), 16 x 6144 x 4096 35.3 vs 33.9
# (26.2), 1 x 4096 x 14336 3.27 vs 2.65 (3.41), 16 x 4096 x 14336 53.0 vs 44.5 (52.9),
# 1 x 14336 x 4096 3.55 vs 2.87 (3.63). Between 17 and 64 rows only where 128-column tiles leave
# most SMs idle: 64 x 4096 x 14336 197 vs 179 (201), but 64 x 14336 x 4096 217 vs 225 and
# 64 x 10240 x 8192 199 vs 220.
SKINNY_M, DECODE_M, SKINNY_MIN_N, SKINNY_MAX_COLUMN_TILES = 64, 16, 2048, 48


def _runs_transposed(a, b, c, bias, scale_a, scale_b) -> bool:
    """Whether this product runs as D^T = B^T A^T (``SKINNY_M``): 16-bit operands, no C, bias
    or scales (they would be indexed along the other dim)."""
    m, n = a.shape[-2], b.shape[-1]
    return (m <= SKINNY_M and n >= SKINNY_MIN_N and a.element_size() == 2 and c is None
            and bias is None and scale_a is None and scale_b is None
            and (m <= DECODE_M or -(-n // 128) < SKINNY_MAX_COLUMN_TILES))


def heuristic_config(a, b, c, bias, scale_a, scale_b, epilogue: Epilogue, fast_accum: bool,
                     sms: int) -> GemmConfig:
    """``choose_config`` for these operands, or for the transposed problem with ``swap_ab``
    where the product is skinny (``_runs_transposed``). Needs only shapes and dtypes."""
    m, k = a.shape[-2:]
    n = b.shape[-1]
    batch = a.shape[0] if a.dim() == 3 else 1
    if _runs_transposed(a, b, c, bias, scale_a, scale_b):
        return replace(choose_config(n, m, k, batch, a.element_size(), sms, epilogue), swap_ab=True)
    return choose_config(m, n, k, batch, a.element_size(), sms, epilogue, fast_accum)


def _kernel_for(a, b, d, c, bias, scale_a, scale_b, activation, tuned=False, fast_accum=False,
                scaled=False, pad_k=False):
    """The compiled kernel for these operands: configuration from ``heuristic_config``, or with
    ``tuned`` the fastest of a few timed on these operands (``tuning.py``; skinny products
    keep the heuristic's transposed configuration). ``scaled``: alpha is not 1 (otherwise the
    epilogue skips the multiply). ``pad_k``: a and b are zero-padded buffers that the kernel
    fills itself from the caller's operands (``GemmConfig.pad_k``; launched as
    ``fn(a_pad, b_pad, d, bias, flags, a, b, alpha, beta)``, never tuned)."""
    m, k = a.shape[-2:]
    n = b.shape[-1]
    batch = a.shape[0] if a.dim() == 3 else 1
    key = (a.dim(), a.dtype, b.dtype, d.dtype, _major(a), _major(b), m, n, k, batch,
           None if c is None else (c.dtype, c.dim()), None if bias is None else bias.dtype,
           _scale_kind(scale_a), _scale_kind(scale_b), activation, fast_accum, scaled, tuned) + (
               ("pad_k",) if pad_k else ())
    fn = _kernels.get(key)
    if fn is None:
        epilogue = Epilogue(bias is not None, c is not None, activation,
                            row_scale=_scale_kind(scale_a) == "vector",
                            col_scale=_scale_kind(scale_b) == "vector",
                            scalar_scale_a=_scale_kind(scale_a) == "tensor",
                            scalar_scale_b=_scale_kind(scale_b) == "tensor", alpha=scaled)
        sms = sm_count(a.device.index or 0)
        config = heuristic_config(a, b, c, bias, scale_a, scale_b, epilogue, fast_accum, sms)
        if pad_k:
            config = pad_k_config(config)
        elif tuned and not config.swap_ab:
            scratch = torch.empty_like(d)  # timed launches never touch the caller's output
            config = tuned_config(
                repr((target_arch(), key[:-1])), config, m, sms, a.element_size() == 1,
                lambda cfg: compiled_gemm(
                    cfg, kernel_specs(a, b, d, c, bias, scale_a, scale_b, cfg)),
                lambda fn: fn(a, b, scratch, c, bias, scale_a, scale_b, 1.0, 0.0))
        specs = kernel_specs(a, b, d, c, bias, scale_a, scale_b, config)
        fn = _kernels[key] = compiled_gemm(config, specs)
    return fn


_kernels: dict = {}


def _scale_kind(scale):
    """fp8 scales: None, "tensor" (one value for the whole operand) or "vector" (per row / column)."""
    if scale is None:
        return None
    return "tensor" if scale.numel() == 1 else "vector"


def _check_operands(a, b, allowed, what):
    for name, t in (("a", a), ("b", b)):
        check_tensor(name, t, allowed, a if name == "b" else None)
        if t.dim() not in (2, 3):
            raise UnsupportedError(f"{name} must be 2-D or 3-D (batched), got shape {tuple(t.shape)}")
    if a.dtype != b.dtype and allowed is INPUT_DTYPES:
        raise DTypeError(f"a ({a.dtype}) and b ({b.dtype}) must have the same dtype")
    if a.dim() != b.dim():
        raise UnsupportedError(f"a and b must both be 2-D or both 3-D: {tuple(a.shape)}, {tuple(b.shape)}")
    if a.shape[-1] != b.shape[-2]:
        raise UnsupportedError(f"inner dims differ: a {tuple(a.shape)} @ b {tuple(b.shape)}")
    if a.dim() == 3 and a.shape[0] != b.shape[0]:
        raise UnsupportedError(f"batch sizes differ: a {tuple(a.shape)}, b {tuple(b.shape)}")


def _canonical(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the strides of its size-1 dims chosen for TMA (``t`` itself when none has
    one). Such a dim is never stepped along, so its stride is free, but DLPack and torch give
    it any value (often 1), which TMA and the kernel's stride checks refuse. A column vector
    (rows, 1) with unit row stride reads as column-major, a row vector (1, cols) or a single
    element as row-major, and a size-1 batch dim takes a 16-byte stride."""
    shape, stride = tuple(t.shape), list(t.stride())
    if 1 not in shape:
        return t
    step = 16 // t.element_size()
    rows, cols = shape[-2], shape[-1]

    def padded(n):
        return max(step, -(-n // step) * step)

    if cols == 1 and rows != 1 and stride[-2] == 1:
        stride[-1] = padded(rows)
    elif rows == 1 and (cols == 1 or stride[-1] == 1):
        stride[-1], stride[-2] = 1, padded(cols)
    if len(shape) == 3 and shape[0] == 1:
        stride[0] = padded(rows * cols)
    if tuple(stride) == t.stride():
        return t
    return t.as_strided(shape, stride)


def _prepare(a, b, k_multiple):
    """Batched, TMA-ready views of a and b; a zero-padded copy where the layout does not allow
    TMA (a non-unit stride that is not a 16-byte multiple, or no unit stride at all)."""
    a3, b3 = _canonical(a), _canonical(b)
    if _major(a3) is None or not _tma_ready(a3) or (_major(a3) == "col" and a.element_size() == 1):
        a3 = _padded_row_major(a3, k_multiple)
    if _major(b3) is None or not _tma_ready(b3) or (_major(b3) == "row" and b.element_size() == 1):
        # Column-major (N, K) storage for fp8, which needs K-major B.
        b3 = _padded_row_major(b3.transpose(-1, -2), k_multiple).transpose(-1, -2)
    k = max(a3.shape[-1], b3.shape[-2])
    if a3.shape[-1] != k:
        a3 = torch.nn.functional.pad(a3, (0, k - a3.shape[-1]))
    if b3.shape[-2] != k:
        b3 = torch.nn.functional.pad(b3.transpose(-1, -2), (0, k - b3.shape[-2])).transpose(-1, -2)
    return a3, b3


def gemm_with_config(a, b, out, bias, config: GemmConfig) -> None:
    """``out = a @ b (+ bias)`` with a fixed configuration, for callers that need two products
    to round identically (the K sum runs in the same order for the same MMA instruction).
    2-D TMA-ready operands (see ``_tma_ready``); no checks beyond the launcher's own."""
    key = ("fixed", config, a.dtype, out.dtype, _major(a), _major(b), None if bias is None else bias.dtype)
    fn = _kernels.get(key)
    if fn is None:
        specs = kernel_specs(a, b, out, None, bias, None, None, config)
        fn = _kernels[key] = compiled_gemm(config, specs)
    fn(a, b, out, None, bias, None, None, 1.0, 0.0)


def _run(a, b, out_dtype, bias, alpha, beta, c, activation, out, scale_a=None, scale_b=None,
         tuned=False, fast_accum=False):
    m, n = a.shape[-2], b.shape[-1]
    shape = (*a.shape[:-2], m, n)
    d = None
    if out is not None:
        if tuple(out.shape) != shape or out.dtype != out_dtype or out.device != a.device:
            raise UnsupportedError(f"out must be {shape} {out_dtype} on {a.device}, got {describe(out)}")
        d = _canonical(out)
        if _major(d) != "row" or not _tma_ready(d):  # the TMA store cannot write it: stage
            d = None
    if d is None:
        size = out_dtype.itemsize
        n_pad = -(-n * size // 16) * 16 // size  # rows padded to 16 bytes for the TMA store
        d = torch.empty((*shape[:-1], n_pad), dtype=out_dtype, device=a.device)
        d = d[..., :n] if n_pad != n else d
    if d.numel():
        if a.shape[-1] == 0:  # K = 0: only the epilogue remains
            z = torch.zeros(shape, dtype=torch.float32, device=a.device)
            z = z + beta * torch.broadcast_to(c, shape).float() if c is not None else z
            z = z + bias.float() if bias is not None else z
            d.copy_(_activation_torch(z, activation))
        else:
            a2, b2 = _prepare(a, b, 16 // a.element_size())
            c2 = None if c is None else torch.broadcast_to(c, shape)
            gemm_out(a2, b2, d, c2, bias, scale_a, scale_b, float(alpha), float(beta), activation,
                     tuned, fast_accum)
    if out is None:
        return d
    if d.data_ptr() != out.data_ptr():  # computed into a staging buffer
        out.copy_(d)
    return out


def _activation_torch(z, name):
    if name == "relu":
        return torch.relu(z)
    if name == "silu":
        return torch.nn.functional.silu(z)
    if name == "gelu_tanh":
        return torch.nn.functional.gelu(z, approximate="tanh")
    return z


def _activation_grad(z, name):
    if name == "relu":
        return (z > 0).to(z.dtype)
    if name == "silu":
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))
    if name == "gelu_tanh":
        k0, k1 = 0.7978845608028654, 0.044715
        t = torch.tanh(k0 * (z + k1 * z ** 3))
        return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * k0 * (1 + 3 * k1 * z * z)
    return torch.ones_like(z)


class _Gemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, bias, c, alpha, beta, activation, out_dtype, tuned):
        ctx.save_for_backward(a, b, bias, c)
        ctx.args = (alpha, beta, activation, out_dtype, tuned)
        return _run(a, b, out_dtype, bias, alpha, beta, c, activation, None, tuned=tuned)

    @staticmethod
    def backward(ctx, grad):
        a, b, bias, c = ctx.saved_tensors
        alpha, beta, activation, out_dtype, tuned = ctx.args
        if activation is not None:  # recompute the pre-activation, then chain through it
            z = _run(a, b, torch.float32, bias, alpha, beta, c, None, None, tuned=tuned)
            grad = (grad.float() * _activation_grad(z, activation))
        grad_ab = grad.to(a.dtype)
        da = db = dbias = dc = None
        if ctx.needs_input_grad[0]:
            da = _run(grad_ab, b.transpose(-1, -2), a.dtype, None, alpha, 0.0, None, None, None, tuned=tuned)
        if ctx.needs_input_grad[1]:
            db = _run(a.transpose(-1, -2), grad_ab, b.dtype, None, alpha, 0.0, None, None, None, tuned=tuned)
        if bias is not None and ctx.needs_input_grad[2]:
            dbias = grad.float().sum(dim=tuple(range(grad.dim() - 1))).to(bias.dtype)
        if c is not None and ctx.needs_input_grad[3]:
            dc = (grad.float() * beta).sum_to_size(c.shape).to(c.dtype)
        return da, db, dbias, dc, None, None, None, None, None


def gemm(a, b, *, bias=None, alpha: float = 1.0, beta: float = 0.0, c=None, activation=None,
         out_dtype=None, out=None, tuned: bool = False):
    """``activation(alpha * a @ b + beta * c + bias)`` on Hopper tensor cores.

    Args:
        a: (M, K) or (L, M, K), bf16 or fp16, row- or column-major (transposed views are free).
        b: (K, N) or (L, K, N), a's dtype, row- or column-major.
        bias: optional (N,) added to every row (any float dtype).
        alpha, beta: scalars; ``beta`` multiplies ``c`` (broadcastable to the output, any layout).
        activation: None, "relu", "gelu_tanh" or "silu", applied last.
        out_dtype: bf16 / fp16 / fp32 (default a's dtype). out: optional preallocated output.
        tuned: time a few tile / cluster configurations on these operands the first time this
            problem (shapes, layouts, dtypes, options) is seen and keep the fastest; the choice
            persists on disk (``gemm/tuning.py``). Default: the heuristic (``choose_config``).
            Products of a few rows (M <= 16, or M <= 64 against few 128-column tiles; 16-bit,
            no C, bias or scales) always run transposed, D^T = B^T A^T on 64-row tiles of B^T.

    Differentiable in a, b, bias and c (the backward runs on the same kernel; with an activation
    the pre-activation is recomputed).

    Repeated eager calls with the same shapes, strides and options (``out`` included, where the
    kernel writes it directly) take a cached launch plan
    (checked once, on the first call), so small products cost little host time.

    Constraints:
      - fp32 accumulation; any M, N, K >= 0 (tails through TMA bounds; an empty product is
        the epilogue alone), size-1 dims with any stride
      - ``out`` of any layout (one TMA cannot write is computed into a buffer, then copied)
      - a layout TMA cannot read (a stride that is not a multiple of 16 bytes, or no unit stride)
        costs one zero-padded copy of that operand (for a and a transposed (N, K) weight whose
        K alone is unaligned, repeated calls pad both into buffers kept with the launch plan,
        inside the GEMM's own launch up to ``PAD_FUSE_MAX_BYTES``); an output whose rows are
        not 16-byte multiples is allocated with padded rows and returned as a view
    """
    if (c is None and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and (bias is None or isinstance(bias, torch.Tensor))
            and (out is None or isinstance(out, torch.Tensor)) and not torch.compiler.is_compiling()):
        key = (a.shape, b.shape, a.stride(), b.stride(), a.dtype, b.dtype, a.device, out_dtype,
               activation, tuned, alpha == 1.0,
               None if bias is None else (bias.shape, bias.dtype, bias.device),
               None if out is None else (out.shape, out.stride(), out.dtype, out.device))
        plan = _plans.get(key)
        if plan is not None and not (torch.is_grad_enabled() and (
                a.requires_grad or b.requires_grad or (bias is not None and bias.requires_grad))):
            fn, alloc, dtype, n, pad = plan
            if out is None:
                d = torch.empty(alloc, dtype=dtype, device=a.device)
                d = d[..., :n] if alloc[-1] != n else d
            else:  # the kernel writes ``out`` itself (plans are kept only where it did)
                d = out
            try:
                if pad is not None:  # rows TMA cannot read: both zero-padded along K (_pair_padder)
                    pad(a, b, d, bias, float(alpha), float(beta))
                else:
                    fn(a, b, d, None, bias, None, None, float(alpha), float(beta))
                return d
            except ValueError:  # a misaligned data pointer: the general path copies
                pass
    else:
        key = None
    _check_operands(a, b, INPUT_DTYPES, "gemm")
    out_dtype = out_dtype or (out.dtype if out is not None else a.dtype)
    if out_dtype not in OUT_DTYPES:
        raise DTypeError(f"out_dtype={out_dtype}; supported: {OUT_DTYPES}")
    if activation not in ACTIVATIONS:
        raise UnsupportedError(f"activation={activation!r}; supported: {ACTIVATIONS}")
    shape = (*a.shape[:-1], b.shape[-1])
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (b.shape[-1],) or bias.device != a.device:
            raise UnsupportedError(f"bias must be ({b.shape[-1]},) on {a.device}, got {describe(bias)}")
        if bias.dtype not in OUT_DTYPES:
            raise DTypeError(f"bias has dtype {bias.dtype}; supported: {OUT_DTYPES}")
    if c is not None:
        if not isinstance(c, torch.Tensor) or c.device != a.device or c.dtype not in OUT_DTYPES:
            raise UnsupportedError(f"c must be a float CUDA tensor on {a.device}, got {describe(c)}")
        try:
            torch.broadcast_shapes(c.shape, shape)
        except RuntimeError:
            raise UnsupportedError(f"c {tuple(c.shape)} does not broadcast to the output {shape}") from None
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (a, b, bias, c))
    if needs_grad and out is None:
        return _Gemm.apply(a, b, bias, c, float(alpha), float(beta), activation, out_dtype, tuned)
    d = _run(a, b, out_dtype, bias, alpha, beta, c, activation, out, tuned=tuned)
    direct = out is None or (_canonical(out) is out and _major(out) == "row" and _tma_ready(out))
    if key is not None and d.numel() and a.shape[-1] and direct:
        step = 16 // a.element_size()
        ready_a, ready_b = _prepare(a, b, step)
        pad = fn = None
        scaled = float(alpha) != 1.0
        if not (ready_a is a and ready_b is b) and _unaligned_k_only(a, b, step):
            # Contiguous rows of a K that is no multiple of 16 bytes (a and a transposed (N, K)
            # weight): the plan pads both along K, as ``_prepare`` would copy.
            def gemm_for(padded, fused):
                return _kernel_for(*padded, d, None, bias, None, None, activation, tuned,
                                   scaled=scaled, pad_k=fused)
            pad = _pair_padder(a.dtype, a.device, ready_a.shape[-1], a.shape[0], b.shape[1], gemm_for)
        elif ready_a is a and ready_b is b:
            fn = _kernel_for(a, b, d, None, bias, None, None, activation, tuned, scaled=scaled)
        if pad is not None or fn is not None:  # (other copies: no plan)
            n = d.shape[-1]
            alloc = (*d.shape[:-1], -(-n * out_dtype.itemsize // 16) * 16 // out_dtype.itemsize)
            _plans[key] = (fn, alloc, out_dtype, n, pad)
    return d


# Padded copies up to this size stay with their launch plan, one pair per stream, rewritten by
# every call in stream order: such a call then allocates only its output (measured on the
# H200's host: 6.7 us per allocation, the pad and GEMM launches 7 us each).
PAD_KEEP_MAX_BYTES = 32 << 20
# Up to this size the GEMM pads them itself (``GemmConfig.pad_k``): one launch per call instead
# of two. Measured on H100 (L2-cold loop, ratio to cuBLAS, in-GEMM / padding kernel + GEMM):
# 333 x 1000 x 777 (2.1 MB of copies) 1.09x / 1.00x with 11.8 / 17.8 us of host time
# (torch.matmul 14.1), 600 x 1200 x 1001 1.08x / 0.90x, 5 x 4096 x 777 0.77x / 0.63x,
# 2000 x 3000 x 1001 (10 MB) 3.11x / 2.20x, 1000 x 1000 x 4095 (16 MB) 1.41x / 1.06x.
PAD_FUSE_MAX_BYTES = 16 << 20
# ``pad_k``'s grid-barrier flags per kept pair: one int64 per CTA of a grid of at most one CTA
# per SM.
PAD_FLAGS = 1024


def _pair_padder(dtype, device, k_padded: int, rows_a: int, rows_b: int, gemm_for):
    """``run(a, b, d, bias, alpha, beta)``: the product of a (rows_a, K) row-major and b = w.t()
    of a row-major (rows_b, K) w, through copies of both with K zero-padded to ``k_padded``.
    While the copies are small (``PAD_KEEP_MAX_BYTES``) they are kept, one pair per stream.
    Up to ``PAD_FUSE_MAX_BYTES`` the GEMM fills them itself (``gemm_for((a_pad, b_pad), True)``,
    ``GemmConfig.pad_k``); beyond, one launch of ``pad.PadRowsSm90`` fills them before the GEMM
    (``gemm_for((a_pad, b_pad), False)``)."""
    size = (rows_a + rows_b) * k_padded * dtype.itemsize
    keep = size <= PAD_KEEP_MAX_BYTES
    kept: dict = {}

    def buffers(device):
        flat = torch.empty((rows_a + rows_b) * k_padded, dtype=dtype, device=device)
        w_pad = flat[rows_a * k_padded:].view(rows_b, k_padded)  # starts on 16 bytes (k_padded % 8 == 0)
        return flat[:rows_a * k_padded].view(rows_a, k_padded), w_pad, w_pad.t()

    if size <= PAD_FUSE_MAX_BYTES:
        def kept_for(device):
            return (*buffers(device), torch.empty(PAD_FLAGS, dtype=torch.int64, device=device))

        def run_fused(a, b, d, bias, alpha, beta):
            stream = torch._C._cuda_getCurrentRawStream(d.get_device())
            found = kept.get(stream)
            if found is None:
                found = kept[stream] = kept_for(a.device)
            a_pad, _, w_pad_t, flags = found
            fused(a_pad, w_pad_t, d, bias, flags, a, b, alpha, beta)

        first = kept[torch._C._cuda_getCurrentRawStream(device.index)] = kept_for(device)
        fused = gemm_for((first[0], first[2]), True)
        return run_fused

    from .pad import PadRowsSm90  # the kernel module: imported at the first compile

    kernel = get_kernel(PadRowsSm90, None, pad_specs(dtype_name(dtype)))
    gemm = None

    def run(a, b, d, bias, alpha, beta):
        nonlocal gemm, gemm_for
        if keep:
            stream = torch._C._cuda_getCurrentRawStream(d.get_device())
            found = kept.get(stream)
            if found is None:
                found = kept[stream] = buffers(a.device)
        else:
            found = buffers(a.device)
        a_pad, w_pad, w_pad_t = found
        kernel(a, a_pad, b.t(), w_pad)
        if gemm is None:  # compiled once; the caller's closure (its first output) is let go
            gemm, gemm_for = gemm_for((a_pad, w_pad_t), False), None
        gemm(a_pad, w_pad_t, d, None, bias, None, None, alpha, beta)

    return run


def pad_specs(dtype: str) -> tuple:
    """``PadRowsSm90``'s arguments: two (source rows of any stride, padded row-major rows)."""
    src = TensorSpec(dtype, (Sym(), Sym()), (Sym(), 1), 2)
    dst = TensorSpec(dtype, (Sym(), Sym(divisibility=8)), (Sym(divisibility=8), 1), 16)
    return (src, dst, src, dst, StreamSpec())


def _unaligned_k_only(a, b, step) -> bool:
    """2-D a (M, K) and b = w.t() of a (N, K) w, both with contiguous rows, M and N > 1, and K
    not a multiple of ``step`` elements (so only K keeps TMA from reading them)."""
    if a.dim() != 2 or b.dim() != 2:
        return False
    k = a.shape[1]
    return (a.shape[0] > 1 and b.shape[1] > 1 and k > 1 and k % step != 0
            and a.stride() == (k, 1) and b.stride() == (1, k))


_plans: dict = {}  # eager launch plans of plain gemm calls (see ``gemm``)


def gemm_fp8(a, b, scale_a, scale_b, *, out_dtype=torch.bfloat16, bias=None, tuned: bool = False,
             fast_accum: bool = False):
    """``(a @ b) * scale_a * scale_b (+ bias)`` with fp8 (e4m3 / e5m2) operands.

    ``scale_a``: fp32 scalar tensor (per tensor) or (M,) (per row of a); ``scale_b``: scalar or
    (N,) (per column of b). Accumulation keeps fp32 accuracy: the tensor-core accumulator is
    folded into a second fp32 accumulator every 128 values of K (with 128 x 256 tiles one column
    half at a time), as ``torch._scaled_mm`` does. ``fast_accum=True`` never folds (the
    tensor core's own accumulation over all of K, as ``torch._scaled_mm(use_fast_accum=True)``):
    faster, less accurate for long K. ``tuned`` as in ``gemm``.

    Constraints:
      - a K-major (row-major (M, K)) and b K-major (column-major (K, N), i.e. ``w.t()`` of a
        row-major (N, K) weight); other layouts cost a copy
      - no autograd
    """
    _check_operands(a, b, FP8_DTYPES, "gemm_fp8")
    if out_dtype not in OUT_DTYPES:
        raise DTypeError(f"out_dtype={out_dtype}; supported: {OUT_DTYPES}")
    m, n = a.shape[-2], b.shape[-1]
    scales = []
    for name, s, size in (("scale_a", scale_a, m), ("scale_b", scale_b, n)):
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.device != a.device:
            raise DTypeError(f"{name} must be a float32 tensor on {a.device}, got {describe(s)}")
        if s.numel() not in (1, size) or s.dim() > 1:
            raise UnsupportedError(f"{name} must be a scalar or ({size},), got shape {tuple(s.shape)}")
        scales.append(s.reshape(-1))  # one value: a per-tensor scale, folded into alpha
    return _run(a, b, out_dtype, bias, 1.0, 0.0, None, None, None, scales[0], scales[1], tuned=tuned,
                fast_accum=bool(fast_accum))


def compile_configurations(quick: bool = False):
    """(kernel, config, specs) for every configuration ``choose_config`` can return (tile
    shapes, clusters), both operand layouts, every epilogue option and fp8."""
    from .kernel_sm90 import GemmSm90

    def operand(dtype, major, dims=2):
        div = 16 // (1 if dtype.startswith("float8") else 2)
        lead = (Sym(divisibility=div),) * (dims - 2)
        stride = (Sym(divisibility=div), 1) if major == "row" else (1, Sym(divisibility=div))
        return TensorSpec(dtype, (Sym(),) * dims, (*lead, *stride), 16)

    bf16 = lambda major: operand("bfloat16", major)  # noqa: E731
    fp8_row, fp8_col = operand("float8_e4m3fn", "row"), operand("float8_e4m3fn", "col")
    out = operand("bfloat16", "row")
    free = lambda dims: TensorSpec("bfloat16", (Sym(),) * dims, (Sym(),) * dims, 2)  # noqa: E731
    f32 = TensorSpec("float32", (Sym(),), (Sym(),), 4)
    scalars = (ScalarSpec("float32"), ScalarSpec("float32"), ScalarSpec("int64"), StreamSpec())
    sk_work = (TensorSpec("float32", (Sym(),), (1,), 16), TensorSpec("int64", (Sym(),), (1,), 8))

    def specs(cfg, operands):  # (a, b, d, c, bias, scale_a, scale_b) + the stream-K workspace
        return operands + (None, None) + (sk_work if cfg.stream_k else (None, None)) + (None, None) + scalars

    tiles = [(128, 256, 1), (128, 256, 2), (128, 128, 1), (128, 128, 2), (64, 128, 1), (64, 128, 2)]
    found = []
    for tm, tn, cm in tiles:
        for a_major, b_major in (("row", "row"), ("col", "row"), ("row", "col"), ("col", "col")):
            cfg = GemmConfig(tm, tn, cm, max_clusters=132 // cm)
            found.append((GemmSm90, cfg, specs(cfg, (bf16(a_major), bf16(b_major), out, None, None, None, None))))
    for epi in (Epilogue(bias=True, activation="gelu_tanh"), Epilogue(residual=True, activation="relu"),
                Epilogue(bias=True, residual=True, activation="silu"), Epilogue(alpha=True),
                Epilogue(bias=True, residual=True, alpha=True)):
        cfg = GemmConfig(128, 256, max_clusters=132, epilogue=epi)
        found.append((GemmSm90, cfg, specs(cfg, (bf16("row"), bf16("row"), out, free(2) if epi.residual else None,
                                                free(1) if epi.bias else None, None, None))))
    # fp8 exact, each with and without the next tile's first k-tile under the epilogue.
    for tm, tn, cm in ((128, 128, 1), (128, 128, 2), (64, 128, 1), (64, 128, 2), (128, 256, 1), (128, 256, 2),
                       (128, 192, 1), (128, 192, 2)):
        for epilogue_mma in (False, True):
            cfg = GemmConfig(tm, tn, cm, max_clusters=132 // cm, epilogue=Epilogue(row_scale=True, col_scale=True),
                             fp8_promote_every=1, fp8_split_n=tn == 256, epilogue_mma=epilogue_mma)
            found.append((GemmSm90, cfg, specs(cfg, (fp8_row, fp8_col, out, None, None, f32, f32))))
    # fp8 without promotion (fast_accum): the heuristic's tiles and the others tuned=True times.
    for tm, tn, cm in ((128, 256, 1), (128, 256, 2), (128, 128, 1), (128, 128, 2), (64, 128, 1), (64, 128, 2)):
        cfg = GemmConfig(tm, tn, cm, max_clusters=132 // cm, epilogue=Epilogue(row_scale=True, col_scale=True))
        found.append((GemmSm90, cfg, specs(cfg, (fp8_row, fp8_col, out, None, None, f32, f32))))
    # Per-tensor scales (folded into alpha), alone and next to a per-row scale, on 128 x 256 with
    # and without promotion (the epilogue is the same for every tile shape).
    for epi in (Epilogue(scalar_scale_a=True, scalar_scale_b=True), Epilogue(row_scale=True, scalar_scale_b=True)):
        for promote, epilogue_mma in ((1, False), (1, True), (0, False)):
            cfg = GemmConfig(128, 256, max_clusters=132, epilogue=epi, fp8_promote_every=promote,
                             fp8_split_n=promote == 1, epilogue_mma=epilogue_mma)
            found.append((GemmSm90, cfg, specs(cfg, (fp8_row, fp8_col, out, None, None, f32, f32))))
    # Ping-pong configurations that tuned=True may pick (bf16 and fp8).
    for cm in (1, 2):
        cfg = GemmConfig(128, 192, cm, max_clusters=132 // cm, pingpong=True, epi_stages=PINGPONG_EPI_STAGES)
        found.append((GemmSm90, cfg, specs(cfg, (bf16("row"), bf16("row"), out, None, None, None, None))))
        cfg = GemmConfig(128, 96, cm, max_clusters=132 // cm, pingpong=True, fp8_promote_every=1,
                         epilogue=Epilogue(row_scale=True, col_scale=True))
        found.append((GemmSm90, cfg, specs(cfg, (fp8_row, fp8_col, out, None, None, f32, f32))))
    # The heuristic's 256 x 160 tile (config.WIDE_TILE: clusters of two along M), every layout.
    for a_major, b_major in (("row", "row"), ("col", "row"), ("row", "col"), ("col", "col")):
        cfg = GemmConfig(*WIDE_TILE, 2, max_clusters=66, epi_stages=WIDE_EPI_STAGES)
        found.append((GemmSm90, cfg, specs(cfg, (bf16(a_major), bf16(b_major), out, None, None, None, None))))
    # 256-row tiles (two m64 MMAs per warpgroup and k-block), clusters along M and along N.
    for cluster, stream_k in (((2, 1), False), ((1, 2), True)):
        cfg = GemmConfig(256, 192, *cluster, max_clusters=66, stream_k=stream_k)
        found.append((GemmSm90, cfg, specs(cfg, (bf16("row"), bf16("row"), out, None, None, None, None))))
    # Batched (L, M, K) operands, and one cluster per tile (the grid when max_clusters is not capped).
    batched = (operand("bfloat16", "row", 3), operand("bfloat16", "col", 3), operand("bfloat16", "row", 3))
    cfg = GemmConfig(128, 256, 2, max_clusters=66)
    found.append((GemmSm90, cfg, specs(cfg, batched + (None, None, None, None))))
    cfg = GemmConfig(128, 256)
    found.append((GemmSm90, cfg, specs(cfg, (bf16("row"), bf16("row"), out, None, None, None, None))))
    # Stream-K tails: bf16 (cluster 2, batched, an epilogue with operands), fp8 exact (the
    # column split and 128 x 192 with a cluster), fp8 fast accumulation, and one MMA warpgroup.
    for cfg, operands in (
            (GemmConfig(128, 256, 2, max_clusters=66, stream_k=True), batched + (None, None, None, None)),
            (GemmConfig(128, 256, 1, max_clusters=132, stream_k=True,
                        epilogue=Epilogue(bias=True, residual=True, activation="silu")),
             (bf16("row"), bf16("col"), out, free(2), free(1), None, None)),
            (GemmConfig(128, 256, 1, max_clusters=132, stream_k=True, fp8_promote_every=1, fp8_split_n=True,
                        epilogue=Epilogue(row_scale=True, col_scale=True)),
             (fp8_row, fp8_col, out, None, None, f32, f32)),
            (GemmConfig(128, 192, 2, max_clusters=66, stream_k=True, fp8_promote_every=1,
                        epilogue=Epilogue(scalar_scale_a=True, scalar_scale_b=True)),
             (fp8_row, fp8_col, out, None, None, f32, f32)),
            (GemmConfig(128, 256, 1, max_clusters=132, stream_k=True,
                        epilogue=Epilogue(scalar_scale_a=True, scalar_scale_b=True)),
             (fp8_row, fp8_col, out, None, None, f32, f32)),
            (GemmConfig(64, 128, 2, max_clusters=66, stream_k=True),
             (bf16("row"), bf16("row"), out, None, None, None, None)),
            # decode-sized products: one partial wave of 64 x 128 tiles cut along K over the grid
            (GemmConfig(64, 128, 1, max_clusters=132, stream_k=True),
             (bf16("row"), bf16("col"), out, None, None, None, None))) + tuple(
            # skinny products run transposed (64 x 16..64 tiles of D^T = B^T A^T), the weight as
            # nn.Linear stores it (B column-major) or a plain (K, N) matrix, with each stage
            # length ``narrow_tile_k_blocks`` gives; and untransposed (a few output columns)
            (GemmConfig(64, tn, 1, max_clusters=132, swap_ab=swap, k_blocks=kb),
             (bf16("row"), bf16(b_major), out, None, None, None, None))
            for tn in (16, 32, 48, 64) for kb in sorted({narrow_tile_k_blocks(tn, tiles, k, 132)
                                                        for tiles in (1, 132) for k in (64, 4096)})
            for swap in (True, False) for b_major in ("col", "row")) + (
            # 128 x 160 tiles in pairs along M (128 < M <= 256)
            (GemmConfig(128, 160, 2, max_clusters=66), (bf16("row"), bf16("col"), out, None, None, None, None)),
            (GemmConfig(128, 160, 2, max_clusters=66, stream_k=True),
             (bf16("row"), bf16("row"), out, None, None, None, None))):
        found.append((GemmSm90, cfg, specs(cfg, operands)))
    # pad_k: unaligned K (a and a transposed (N, K) weight, bf16 or fp16, with or without a
    # bias), every configuration the heuristic gives such products (``pad_k_configurations``).
    flags = TensorSpec("int64", (Sym(),), (1,), 8)
    for dtype in ("bfloat16", "float16"):
        operand16 = lambda major: operand(dtype, major)  # noqa: E731
        sources = (TensorSpec(dtype, (Sym(), Sym()), (Sym(), 1), 2), TensorSpec(dtype, (Sym(), Sym()), (1, Sym()), 2))
        for cfg in pad_k_configurations():
            if dtype == "float16" and cfg.epilogue.bias:
                continue
            bias = free(1) if cfg.epilogue.bias else None
            found.append((GemmSm90, cfg, (operand16("row"), operand16("col"), operand(dtype, "row"), None, bias,
                                          None, None, None, None, None, flags, *sources) + scalars))
    from .pad import PadRowsSm90
    for dtype in ("bfloat16", "float16"):
        found.append((PadRowsSm90, None, pad_specs(dtype)))
    if quick:  # one of each kind: the two bf16 tiles, fp8 exact and fast, ping-pong, stream-K
        kinds = (lambda c: c.fp8_promote_every == 1, lambda c: c.fp8_promote_every == 0 and c.epilogue.row_scale,
                 lambda c: c.pingpong, lambda c: c.stream_k)
        found = found[:2] + [next(case for case in found if case[1] is not None and kind(case[1]))
                             for kind in kinds]
    return found


def pad_k_config(config: GemmConfig) -> GemmConfig:
    """The heuristic's configuration for padded operands, made to pad them itself
    (``GemmConfig.pad_k``): without a stream-K tail (the grid barrier needs every CTA at once),
    and cooperative instead of ping-pong (ping-pong's 192 accumulators per thread spill next to
    the padding code); the 256 x 160 tile (160 accumulators, two epilogue buffers) becomes
    128 x 256 without a cluster."""
    config = replace(config, pad_k=True, stream_k=False)
    if config.pingpong:
        config = replace(config, pingpong=False, epi_stages=GemmConfig.epi_stages)
    if (config.tile_m, config.tile_n) == WIDE_TILE:
        config = replace(config, tile_m=128, tile_n=256, epi_stages=GemmConfig.epi_stages, cluster_m=1,
                         max_clusters=config.max_clusters * config.cluster_m)
    return config


def pad_k_configurations(sms: int = 132) -> list:
    """The ``pad_k`` configurations the heuristic gives unaligned-K products whose padded copies
    the GEMM fills itself (``PAD_FUSE_MAX_BYTES``), over a sample of their shapes (M, N from 2
    to 28672, K from 7 to 8191; plain and with a bias and an activation)."""
    found = []
    sizes = (2, 3, 9, 16, 17, 31, 33, 48, 49, 64, 65, 100, 127, 129, 160, 192, 200, 256, 257, 333, 500,
             700, 1000, 1500, 2047, 3000, 4096, 5000, 6000, 8192, 10240, 12000, 14336, 16384, 28672)
    for m in sizes:
        for n in sizes:
            for k in (7, 100, 777, 1001, 1999, 3001, 4095, 6999, 8191):
                kp = -(-k // 8) * 8
                if (m + n) * kp * 2 > PAD_FUSE_MAX_BYTES:
                    continue
                a = torch.empty(m, kp, dtype=torch.bfloat16, device="meta")
                b = torch.empty(n, kp, dtype=torch.bfloat16, device="meta").t()
                for epilogue in (Epilogue(), Epilogue(bias=True, activation="gelu_tanh")):
                    bias = torch.empty(n, dtype=torch.bfloat16, device="meta") if epilogue.bias else None
                    cfg = pad_k_config(heuristic_config(a, b, None, bias, None, None, epilogue, False, sms))
                    if cfg not in found:
                        found.append(cfg)
    return found


def self_checks():
    """Rows of the ``python -m cute_kernels`` table for GEMM."""
    from ..reference import gemm_ref
    from ..runtime.selfcheck import SelfCheck

    checks = []
    for m, n, k in ((4096, 4096, 4096), (1000, 1000, 1000)):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        checks.append(SelfCheck("gemm_bf16", f"{m}x{n}x{k}", "bfloat16", lambda a=a, b=b: gemm(a, b),
                                lambda a=a, b=b: a @ b, gemm_ref(a, b), 1e-2))
    return checks
