"""Products with NVFP4 operands on Hopper: ``gemm_w4a16`` (bf16 / fp16 activations, NVFP4
weights), ``gemm_nvfp4`` / ``gemv_nvfp4`` / ``nvfp4_dual_gemm`` (both operands NVFP4), and
``NVFP4Linear``.

Two paths, chosen per call:
  - skinny (at most ``SKINNY_MAX_M`` = 64 rows on one side, K a multiple of 32):
    ``nvfp4_skinny_sm90`` streams the NVFP4 weight once and decodes it in registers for
    warp-level bf16 / fp16 MMAs; for ``gemm_nvfp4`` the few rows may be on either side (the
    product is computed transposed when N is the small one);
  - otherwise the NVFP4 operands are decoded to bf16 / fp16 by ``nvfp4_dequantize_sm90`` (exact:
    an e2m1 value times an e4m3 scale fits both) and multiplied by ``ck.gemm`` (wgmma, TMA).
"""

from __future__ import annotations

import math
import weakref

import torch

from ..gemm.op import stream_k_token
from ..runtime import ScalarSpec, StreamSpec, Sym, TensorSpec, UnsupportedError, get_kernel, kernel_op
from ..runtime.dtypes import dtype_name
from ..runtime.errors import DTypeError, check_tensor, describe
from .formats import BLOCK, SCALE_LAYOUTS
from .nvfp4_skinny_sm90 import SkinnyConfig

SKINNY_MAX_M = 64
PACKED_DTYPES = (torch.uint8, torch.float4_e2m1fn_x2)
SCALE_DTYPES = (torch.float8_e4m3fn, torch.uint8)
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
NVFP4_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DEQUANT_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DEQUANT_OUT_NAMES = ("bfloat16", "float16", "float32")


# ----------------------------------------------------------------------------- configurations


SKINNY_SMEM = 110 * 1024  # two CTAs of 8 warps per SM
# Up to this many rows of x the skinny kernel streams the weight through registers
# (``SkinnyConfig.prefetch`` steps ahead) with x staged once per CTA for at most
# STREAM_X_STEPS steps of 128 values: one token tile of 16-bit x, fewer rows of NVFP4 x (whose
# staging decodes every row).
STREAM_MAX_M = 8
STREAM_MAX_M_NVFP4 = 4
STREAM_PREFETCH = 4
STREAM_X_STEPS = 32


def streams(m: int, x_format: str) -> bool:
    """Whether ``m`` rows of x may stream (``skinny_plan`` still sends 5-8 rows to the ring
    where the streaming grid would not fit)."""
    return m <= (STREAM_MAX_M_NVFP4 if x_format == "nvfp4" else STREAM_MAX_M)


def skinny_plan(m: int, n: int, k: int, batch: int, x_format: str, out_dtype: str,
                sms: int) -> tuple:
    """(configuration, splits) of the skinny kernel for ``m`` rows of x against ``n`` weight
    rows (measured on an H200 and an H100, ``benchmarks/NOTES.md``):
      - 8-token MMA tiles for the rows of x (1, 2, 4 or 8 tiles);
      - up to ``STREAM_MAX_M`` rows of 16-bit x (``STREAM_MAX_M_NVFP4`` of NVFP4 x): streaming
        (CTAs of 4 warps, 64 weight rows; each lane loads its codes 4 steps ahead into
        registers; x staged once per CTA), K cut into at most three CTAs per SM where row
        blocks are fewer than that, else into ranges of at most 16 steps (H100, same run,
        streaming / ring: nvfp4_gemv (7168, 16384, 1) 33.4 / 40.0 us, (4096, 7168, 8) 60.7 /
        69.9, (7168, 2048, 4) 18.2 / 24.4; bf16 x 1 x 8192^2 22.5 / 24.9, 1 x 4096 x 14336
        20.4 / 23.0, 3 x 4096 x 4064 17.4 / 18.5); ranges of 8
        steps or more rounded up to a multiple of 4, with 256-byte L2 fetches (H100, same run,
        GPU time: (7168, 16384, 1) 33.2 -> 30.3 us, (4096, 7168, 8) 61.1 -> 56.7, (7168, 2048,
        4) 18.6 -> 18.0, bf16 x 1 x 8192^2 22.7 -> 20.4; 1 x 14336 x 4096 at one range 19.2
        against two 20.4: the split's partial sums cost more than the CTAs it adds); at 5-8
        rows of bf16 x the ring (below) was 4-29% slower (5 x 8192^2 33.1 / 25.7 us, 8 x 14336
        x 4096 32.0 / 27.2, 8 x 28672 x 8192 92.7 / 85.3) except where the streaming grid of
        ranges of more than 16 steps outgrows one wave of its 3 CTAs per SM (8 x 8192 x 16384
        58.6 / 67.9, 8 x 8192 x 28672 94.3 / 100.6: those take the ring), and at 8 rows of
        NVFP4 x faster (8 x 7168 x 16384 36.9 / 45.7);
      - 5 to 8 rows that do not stream (one token tile): CTAs of 4 warps (64 weight rows, a
        4-stage ring), K cut until there are about six CTAs per SM;
      - more rows: 8 warps (x shared by 128 or 256 weight rows), two 16-row slabs per warp where
        that still leaves 3/4 of the SMs a CTA (then K is not cut), else one slab and K cut into
        as many ranges as keep the CTAs within one per SM: these CTAs are bound by their own
        instructions, so an SM given two of them finishes last (H100, 64 x 8192 x 8192: 71 us
        with 128 CTAs, 92 with 192 or 320; M = 16: 32.6 vs 37); the deepest ring (up to 8
        stages) that fits two CTAs per SM;
      - never fewer than 4 steps of 128 values per range of K."""
    tiles = 1 << max(0, (-(-m // 8) - 1).bit_length())
    steps = -(-k // 128)
    x_words = (4 * 32 + 32) * tiles if x_format == "nvfp4" else 16 * 32 * tiles
    if streams(m, x_format):
        # Streaming: the weight into registers STREAM_PREFETCH steps ahead, no barrier.
        blocks = -(-n // 64) * batch
        if blocks < 3 * sms:
            splits = max(1, min(3 * sms // blocks, steps // 4))
        else:
            splits = -(-steps // 16)
        splits = max(splits, -(-steps // STREAM_X_STEPS))
        per_split = -(-steps // splits)
        long_ranges = per_split >= 8
        if long_ranges:  # whole 256-byte blocks of each row per range
            per_split = -(-per_split // 4) * 4
        splits = -(-steps // per_split)  # no empty range
        x_rows = 1 << max(0, (m - 1).bit_length())
        # 8 rows of x staged take 64 KB (3 CTAs per SM): past one wave of those, long ranges
        # (heavy staging per CTA) run faster on the ring
        if x_rows < 8 or per_split <= 16 or 2 * blocks * splits <= 7 * sms:
            return SkinnyConfig(1, 1, 4, 2, splits > 1, x_format, out_dtype,
                                prefetch=STREAM_PREFETCH, x_steps=STREAM_X_STEPS, x_rows=x_rows,
                                l2_fetch=256 if long_ranges else 0,
                                granule=4 if long_ranges else 1), splits
    if tiles == 1:
        warps, slabs, stages = 4, 1, 4
        blocks = -(-n // 64) * batch
        splits = max(1, min(-(-6 * sms // blocks), steps // 4))
    else:
        warps = 8
        slabs = 2 if tiles <= 4 and -(-n // 256) * batch * 4 >= 3 * sms else 1
        words = (4 * 32 * 2 + 32 * 2) * slabs * warps + x_words
        decoded = SkinnyConfig(tiles, slabs, warps, 2, False, x_format).decoded_x_words
        stages = max(s for s in (2, 4, 8) if s == 2 or 4 * (s * words + decoded) <= SKINNY_SMEM)
        blocks = -(-n // (16 * slabs * warps)) * batch
        splits = 1 if slabs == 2 else max(1, min(sms // blocks, steps // 4))
    return SkinnyConfig(tiles, slabs, warps, stages, splits > 1, x_format, out_dtype), splits


_SCALES = TensorSpec.rowmajor("int16", (Sym(), Sym()), 1, align=2)
_COEFFICIENTS = tuple(ScalarSpec("int32") for _ in range(4))


def _skinny_specs(cfg: SkinnyConfig) -> tuple:
    codes = TensorSpec.rowmajor("uint8", (Sym(), Sym(), Sym()), 16, align=16)
    x = codes if cfg.x_format == "nvfp4" else TensorSpec.rowmajor(cfg.x_format, (Sym(), Sym(), Sym()),
                                                                   8, align=16)
    scales = TensorSpec.rowmajor("int16", (Sym(), Sym()), 1, align=4)  # batches of any pair count
    width = torch.finfo(getattr(torch, cfg.out_dtype)).bits // 8
    out = TensorSpec(cfg.out_dtype, (Sym(), Sym(), Sym()), (Sym(), Sym(), Sym()), width)
    return (codes, scales, x, scales if cfg.x_format == "nvfp4" else None, out,
            TensorSpec(cfg.out_dtype, (Sym(),), (1,), width), TensorSpec("float32", (1,), (1,), 4),
            TensorSpec.rowmajor("float32", (Sym(), Sym(), Sym()), 1, align=4),
            TensorSpec.rowmajor("int32", (Sym(), Sym()), 1, align=4), ScalarSpec("int32"),
            *_COEFFICIENTS, *_COEFFICIENTS, StreamSpec())


def _dequantize_specs(out: str) -> tuple:
    width = torch.finfo(getattr(torch, out)).bits // 8
    return (TensorSpec.rowmajor("int32", (Sym(), Sym(), Sym()), 4, align=16), _SCALES,
            TensorSpec.rowmajor(out, (Sym(), Sym(), Sym()), 16 // width, align=16),
            TensorSpec("float32", (1,), (1,), 4), *_COEFFICIENTS, StreamSpec())


_kernels: dict = {}


def _skinny_kernel(cfg: SkinnyConfig):
    fn = _kernels.get(cfg)
    if fn is None:
        from .nvfp4_skinny_sm90 import SkinnyGemmNvfp4Sm90  # imported at the first compile

        fn = _kernels[cfg] = get_kernel(SkinnyGemmNvfp4Sm90, cfg, _skinny_specs(cfg))
    return fn


def _dequantize_kernel(config: str):
    fn = _kernels.get(config)
    if fn is None:
        from .nvfp4_dequantize_sm90 import DequantizeNvfp4Sm90

        fn = _kernels[config] = get_kernel(DequantizeNvfp4Sm90, config, _dequantize_specs(config))
    return fn


@kernel_op("nvfp4_skinny_gemm", mutates_args=("out",),
           schema="(Tensor w, Tensor w_scales, Tensor x, Tensor? x_scales, Tensor(a!) out, "
           "Tensor? bias, Tensor alpha, str scale_layout) -> ()")
def _skinny_op(w, w_scales, x, x_scales, out, bias, alpha, scale_layout: str) -> None:
    """``_skinny_launch`` as a custom op (torch.compile)."""
    _skinny_launch(w, w_scales, x, x_scales, out, bias, alpha, scale_layout)


@kernel_op("nvfp4_dequantize_words", mutates_args=("out",),
           schema="(Tensor packed, Tensor scales, Tensor(a!) out, Tensor global_scale, "
           "str scale_layout) -> ()")
def _dequantize_op(packed, scales, out, global_scale, scale_layout: str) -> None:
    """``_dequantize_launch`` as a custom op (torch.compile)."""
    _dequantize_launch(packed, scales, out, global_scale, scale_layout)


# ----------------------------------------------------------------------------- argument checks


def _expected_scales(rows: int, k: int, layout: str) -> tuple:
    if layout == "plain":
        return (rows, k // BLOCK)
    return (-(-rows // 128) * 128 * (-(-k // (4 * BLOCK)) * 4),)


def _check_nvfp4(name: str, packed, scales_name: str, scales, layout: str, batched: bool,
                 like=None) -> tuple:
    """(packed, scales) as uint8 with a leading batch dim; clear errors first."""
    check_tensor(name, packed, PACKED_DTYPES, like)
    dims = 3 if batched else 2
    if packed.dim() != dims:
        what = "(L, rows, K / 2)" if batched else "(rows, K / 2)"
        raise UnsupportedError(f"{name} must be {what} packed e2m1 codes, got {describe(packed)}")
    check_tensor(scales_name, scales, SCALE_DTYPES, packed)
    rows, k = packed.shape[-2], packed.shape[-1] * 2
    expected = _expected_scales(rows, k, layout)
    if batched:
        expected = (packed.shape[0],) + expected
    if tuple(scales.shape) != expected:
        raise UnsupportedError(f"{scales_name} must be {expected} e4m3 for scale_layout={layout!r} "
                               f"and {name} {describe(packed)}, got {describe(scales)}")
    packed, scales = packed.view(torch.uint8), scales.view(torch.uint8)
    if not batched:
        packed, scales = packed.unsqueeze(0), scales.unsqueeze(0)
    return packed, scales


def _check_layout(scale_layout: str) -> None:
    if scale_layout not in SCALE_LAYOUTS:
        raise UnsupportedError(f"scale_layout={scale_layout!r}; supported: {SCALE_LAYOUTS}")


def _alpha(value, device) -> torch.Tensor:
    """A one-element fp32 tensor on ``device`` (kept per value, so a float costs one copy)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise UnsupportedError(f"a global scale must be one floating-point value, got {describe(value)}")
        return value.to(device=device, dtype=torch.float32).reshape(1)
    if not isinstance(value, (int, float)):
        raise TypeError(f"a global scale must be a float or a one-element tensor, got {value!r}")
    key = ("alpha", float(value), device)
    t = _kernels.get(key)
    if t is None:
        t = _kernels[key] = torch.full((1,), float(value), dtype=torch.float32, device=device)
    return t


def _rows16(t: torch.Tensor) -> torch.Tensor:
    """(L, rows, n) of an 8- or 16-bit dtype with its rows on 16 bytes (a copy where they are
    not); packed codes as uint8."""
    if t.dtype == torch.float4_e2m1fn_x2:
        t = t.view(torch.uint8)
    width = t.element_size()
    if t.is_contiguous():
        t = t.reshape(-1).view(t.shape)  # canonical strides, size-1 dims included
    if (t.stride(-1) != 1 or (t.stride(1) * width) % 16 or (t.stride(0) * width) % 16
            or t.data_ptr() % 16):
        t = t.contiguous()
        if t.data_ptr() % 16:
            t = t.clone()
    return t


def _words(t: torch.Tensor) -> torch.Tensor:
    """``_rows16(t)`` as int32 words (the dequantize kernel's view)."""
    return _rows16(t).view(torch.int32)


def _scale_words(scales: torch.Tensor, layout: str, k: int) -> tuple:
    """uint8 scales with a leading batch dim -> (int16 pairs (L, span), the four coefficients
    of ``nvfp4_skinny_sm90.scale_index``); rows and batches on 2 bytes, the start on 4 (the
    kernels read the 4-byte words that hold the pairs, ``scale_word``)."""
    if scales.stride(-1) != 1 or any(s % 2 for s in scales.stride()[:-1]) or scales.data_ptr() % 4:
        scales = scales.contiguous()
        if scales.stride(-1) != 1 or any(s % 2 for s in scales.stride()[:-1]) or scales.data_ptr() % 4:
            padded = torch.zeros((*scales.shape[:-1], -(-scales.shape[-1] // 2) * 2),
                                 dtype=scales.dtype, device=scales.device)
            padded[..., :scales.shape[-1]] = scales
            scales = padded
    pairs = scales.view(torch.int16)
    if layout == "blocked":
        return pairs, _coefficients("blocked", k)
    rows, stride = pairs.shape[1], pairs.stride(1)
    span = (rows - 1) * stride + pairs.shape[2] if rows else 0
    flat = pairs.as_strided((pairs.shape[0], span), (pairs.stride(0), 1))
    return flat, _coefficients("plain", k, stride)


def _workspace(batch: int, m: int, n: int, blocks: int, device) -> tuple:
    """The split-K workspace (fp32 (L, M, N)) and counters (int32 (L, blocks)) of the current
    stream: zero, and left zero by every launch (one buffer per stream, grown on demand)."""
    key = ("work", device, torch.cuda.current_stream(device).stream_id)
    work, counts = _kernels.get(key, (None, None))
    if work is None or work.numel() < batch * m * n or counts.numel() < batch * blocks:
        work = torch.zeros(max(batch * m * n, 1 << 16), dtype=torch.float32, device=device)
        counts = torch.zeros(max(batch * blocks, 1024), dtype=torch.int32, device=device)
        _kernels[key] = work, counts
    return work[:batch * m * n].view(batch, m, n), counts[:batch * blocks].view(batch, blocks)


def _zeros(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A zero bias of ``n`` entries (one buffer per dtype and device, grown on demand)."""
    key = ("zeros", dtype, device)
    t = _kernels.get(key)
    if t is None or t.numel() < n:
        t = _kernels[key] = torch.zeros(max(n, 1024), dtype=dtype, device=device)
    return t[:n]


def _fits_skinny(k: int) -> bool:
    return k % 32 == 0


# ----------------------------------------------------------------------------- the paths


def _skinny_launch(w, w_scales, x, x_scales, out, bias, alpha, scale_layout):
    """out (L, M, N) (any strides) = alpha * x @ w^T (+ bias): w (L, N, K / 2) NVFP4 uint8 and
    its uint8 scales; x (L, M, K) bf16 / fp16, or NVFP4 uint8 (L, M, K / 2) with its scales.
    Run time only: the views the kernel reads (int32 words on 16 bytes, int16 scale pairs on 4
    bytes) and the split-K workspace of the current stream are made here."""
    batch, m = out.shape[0], out.shape[1]
    n, k = w.shape[1], w.shape[2] * 2
    x_format = "nvfp4" if x_scales is not None else dtype_name(x.dtype)
    sms = torch.cuda.get_device_properties(out.device).multi_processor_count
    cfg, splits = skinny_plan(m, n, k, batch, x_format, dtype_name(out.dtype), sms)
    w_pairs, w_coefficients = _scale_words(w_scales, scale_layout, k)
    x_pairs, x_coefficients = (None, (0, 0, 0, 0)) if x_scales is None else _scale_words(
        x_scales, scale_layout, k)
    bias = _zeros(n, out.dtype, out.device) if bias is None else bias.to(out.dtype)
    work, counts = _workspace(batch, m, n, -(-n // (16 * cfg.warps * cfg.slabs)), out.device)
    _skinny_kernel(cfg)(_rows16(w), w_pairs, _rows16(x), x_pairs, out, bias, alpha, work, counts,
                        splits, *w_coefficients, *x_coefficients)


def _run_skinny(w, w_scales, x, x_scales, out, bias, alpha, scale_layout):
    """``_skinny_launch`` straight (eager) or through its custom op (torch.compile)."""
    if torch.compiler.is_compiling():
        _skinny_op(w, w_scales, x, x_scales, out, bias, alpha, scale_layout)
    else:
        _skinny_launch(w, w_scales, x, x_scales, out, bias, alpha, scale_layout)


# ----------------------------------------------------------------------------- launch plans
#
# A decode-sized product runs in ~10-30 us of GPU time, less than the checked path's host time
# (the argument checks and a dozen tensor views). Once a signature (shapes, strides, dtypes,
# options, device, stream) has been checked, repeated eager calls take a plan: the kernel,
# its configuration and workspace, and the few views the kernel reads.

_plans: dict = {}
_PLAN_LIMIT = 256


def _stream(device) -> int:
    return torch._C._cuda_getCurrentRawStream(device.index)


def _meta(t):
    return None if t is None else (t.shape, t.stride(), t.dtype)


def _rows_ok(t) -> bool:
    """Whether the kernel can read ``t`` (a packed or 16-bit operand) in place: unit last
    stride, other strides on 16 bytes."""
    return t.stride(-1) == 1 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1])


def _coefficients(layout: str, k: int, row_pairs: int | None = None) -> tuple:
    """``scale_index``'s coefficients for scales of K values per row: blocked, or plain with
    ``row_pairs`` scale pairs from one row to the next (default K / 32: contiguous)."""
    if layout == "blocked":
        return (256 * -(-k // (4 * BLOCK)), 8, 2, 256)
    pairs = k // 32 if row_pairs is None else row_pairs
    return (128 * pairs, pairs, 32 * pairs, 2)


def _skinny_plan_fn(w, w_scales, x, x_scales, batch, m, n, out_dtype, alpha, scale_layout):
    """(kernel, splits, workspace, counts, zero bias, alpha tensor or None, coefficients) for a
    launch plan, or None where the operands cannot be read in place."""
    if not (_rows_ok(w) and _rows_ok(x) and w_scales.is_contiguous()
            and (x_scales is None or x_scales.is_contiguous())):
        return None
    k = w.shape[-1] * 2
    x_format = "nvfp4" if x_scales is not None else dtype_name(x.dtype)
    cfg, splits = skinny_plan(m, n, k, batch, x_format, dtype_name(out_dtype), _sms(w.device))
    work, counts = _workspace(batch, m, n, -(-n // (16 * cfg.warps * cfg.slabs)), w.device)
    coefficients = _coefficients(scale_layout, k) + (
        (0, 0, 0, 0) if x_scales is None else _coefficients(scale_layout, k))
    constant = _alpha(alpha, w.device) if isinstance(alpha, (int, float)) else None
    return (_skinny_kernel(cfg), splits, work, counts, _zeros(n, out_dtype, w.device), constant,
            coefficients)


def _w4a16_plan(parts, lead, m, n, k):
    fn, splits, work, counts, zeros, constant, coefficients = parts

    def run(x, w, s, g, bias):
        out = torch.empty((1, m, n), dtype=x.dtype, device=x.device)
        w_codes, s_pairs = _weight_views(w, s)
        fn(w_codes, s_pairs, x.view(1, m, k), None, out,
           zeros if bias is None else bias.to(x.dtype),
           constant if constant is not None else _alpha(g, x.device), work, counts, splits,
           *coefficients)
        return out.view(*lead, n)
    return run


# The kernel's views of recently used weights (packed codes as uint8 with a batch dim, scales as
# int16 pairs), by the identities of the two tensors. A view made with ``view``
# would keep the weight's tensor alive; these are made on its storage instead, so a weakref
# callback can drop the entry when the weight is freed (and its id can be reused).
_views: dict = {}
_VIEW_LIMIT = 64


def _weight_views(w: torch.Tensor, s: torch.Tensor) -> tuple:
    key = (id(w), id(s))
    entry = _views.get(key)
    if (entry is not None and entry[0]() is w and entry[1]() is s
            and entry[2] == (w.data_ptr(), s.data_ptr())):
        return entry[3]
    rows = w.stride(0)
    views = (_storage_view(w, torch.uint8, (1, w.shape[0], w.shape[1]), (w.shape[0] * rows, rows, 1)),
             _storage_view(s, torch.int16, (1, s.numel() // 2), (s.numel() // 2, 1)))
    if len(_views) >= _VIEW_LIMIT:
        _views.pop(next(iter(_views)))

    def forget(_, key=key):
        _views.pop(key, None)

    _views[key] = (weakref.ref(w, forget), weakref.ref(s, forget), (w.data_ptr(), s.data_ptr()),
                   views)
    return views


def _storage_view(t: torch.Tensor, dtype: torch.dtype, shape: tuple, stride: tuple) -> torch.Tensor:
    """``t``'s bytes as a ``dtype`` tensor of ``shape`` and ``stride``, sharing its storage
    without referring to ``t`` (its offset on the dtype's width: the plans' 16-byte check)."""
    offset = t.storage_offset() * t.element_size() // torch.empty((), dtype=dtype).element_size()
    return torch.empty(0, dtype=dtype, device=t.device).set_(t.untyped_storage(), offset, shape, stride)


def _nvfp4_plan(parts, batched, transpose, shape, out_dtype, k):
    fn, splits, work, counts, zeros, constant, coefficients = parts

    def run(a, b, sfa, sfb, alpha, out):
        if out is None:
            out = torch.empty(shape, dtype=out_dtype, device=a.device)
        out3 = out if batched else out.unsqueeze(0)
        x, w, sx, sw = (a, b, sfa, sfb) if not transpose else (b, a, sfb, sfa)
        batch = out3.shape[0]
        fn(_codes_3d(w), sw.view(torch.int16).view(batch, -1), _codes_3d(x),
           sx.view(torch.int16).view(batch, -1),
           out3.transpose(1, 2) if transpose else out3, zeros,
           constant if constant is not None else _alpha(alpha, a.device), work, counts, splits,
           *coefficients)
        return out
    return run


def _codes_3d(t):
    """Packed codes (rows, K / 2) or (L, rows, K / 2) as uint8 with a batch dim (views only where
    needed)."""
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    return t if t.dim() == 3 else t.unsqueeze(0)


def _aligned(*tensors) -> bool:
    return all(t is None or t.data_ptr() % 16 == 0 for t in tensors)


def _sms(device) -> int:
    key = ("sms", device)
    count = _kernels.get(key)
    if count is None:
        count = _kernels[key] = torch.cuda.get_device_properties(device).multi_processor_count
    return count


def _dequantize_launch(packed, scales, out, global_scale, scale_layout):
    """out (L, rows, K) = the values of (L, rows, K / 2) NVFP4 data (run time only)."""
    pairs, coefficients = _scale_words(scales, scale_layout, packed.shape[2] * 2)
    _dequantize_kernel(dtype_name(out.dtype))(_words(packed), pairs, out, global_scale, *coefficients)


def _decode(packed, scales, scale_layout, dtype, global_scale=None) -> torch.Tensor:
    """(L, rows, K / 2) NVFP4 -> (L, rows, K) values in ``dtype`` (exact for bf16 / fp16 with
    no global scale)."""
    batch, rows, k = packed.shape[0], packed.shape[1], packed.shape[2] * 2
    out = torch.empty((batch, rows, k), dtype=dtype, device=packed.device)
    g = _alpha(1.0 if global_scale is None else global_scale, packed.device)
    if out.numel() == 0:
        return out
    if k % 32:  # the kernel reads 32 codes at a time: the torch rule for other widths
        from .formats import from_blocked, nvfp4_dequantize_ref

        for i in range(batch):
            s = scales[i].view(torch.float8_e4m3fn)
            if scale_layout == "blocked":
                s = from_blocked(s, rows, k // BLOCK)
            out[i] = nvfp4_dequantize_ref(packed[i], s, g.reshape(())).to(dtype)
        return out
    if torch.compiler.is_compiling():
        _dequantize_op(packed, scales, out, g, scale_layout)
    else:
        _dequantize_launch(packed, scales, out, g, scale_layout)
    return out


def gemm_w4a16(x, w_fp4, w_scales, w_global_scale=1.0, bias=None, *, scale_layout: str = "plain"):
    """``x @ dequantize(w)^T * w_global_scale (+ bias)``: bf16 / fp16 activations times NVFP4
    weights, in x's dtype.

    Args:
        x: bf16 / fp16 CUDA tensor (..., K).
        w_fp4: packed e2m1 codes (N, K / 2), uint8 or float4_e2m1fn_x2 (``nvfp4_quantize``).
        w_scales: e4m3 block scales, (N, K / 16) for ``scale_layout="plain"`` or the flat 128 x 4
            blocked layout.
        w_global_scale: float or one-element tensor (read on the GPU: no synchronization).
        bias: optional (N,) added in fp32 before the rounding to x's dtype.

    With a prepared weight (``w_fp4`` an :class:`NVFP4Weight` from ``nvfp4_prepare_weight``,
    ``w_scales`` None) every M runs the tensor-core kernel ``nvfp4_w4a16_sm90``: the GEMM's
    TMA + wgmma pipeline with the weight decoded in the MMA warpgroups' registers (bf16 x only,
    eager only). Otherwise up to 64 rows of x (decode and small prefill) run the skinny kernel
    (``nvfp4_skinny_sm90``): the weight read once -- straight into registers up to 8 rows of x,
    through a cp.async ring beyond -- and decoded in registers, warp-level tensor-core MMAs,
    CTAs of 4 or 8 warps over 64-256 weight rows sharing x, K cut over CTAs where the weight
    has few rows (``skinny_plan``). More rows decode the weight to x's dtype (one kernel,
    exact) and run ``ck.gemm`` on it. Repeated eager calls with the same signature take a
    cached launch plan (checked once).

    Constraints:
      - K a multiple of 16 (the NVFP4 block); the skinny path needs K a multiple of 32 (other
        widths take the decoded path)
      - the skinny path cuts long K over CTAs when the weight has few rows: their fp32 partial
        sums are added atomically, so the last bits may vary from run to run
      - no autograd (weight-only quantization for inference)
      - a prepared weight (``NVFP4Weight``): bf16 x, w_scales None, eager calls only (under
        torch.compile pass the packed codes and scales)
    """
    if isinstance(w_fp4, NVFP4Weight):
        return _gemm_w4a16_prepared(x, w_fp4, w_scales, w_global_scale, bias)
    key = None
    if not torch.compiler.is_compiling() and isinstance(x, torch.Tensor) and isinstance(
            w_fp4, torch.Tensor) and isinstance(w_scales, torch.Tensor) and x.is_cuda:
        key = ("w4a16", _meta(x), x.device, _meta(w_fp4), _meta(w_scales), _meta(bias), scale_layout,
               w_global_scale if isinstance(w_global_scale, (int, float)) else "tensor", _stream(x.device))
        plan = _plans.get(key)
        if (plan is not None and _aligned(x, w_fp4) and w_scales.data_ptr() % 4 == 0
                and not (x.requires_grad and torch.is_grad_enabled())):
            return plan(x, w_fp4, w_scales, w_global_scale, bias)
    check_tensor("x", x, ACTIVATION_DTYPES)
    _check_layout(scale_layout)
    k = x.shape[-1] if x.dim() else 0
    if x.dim() < 1 or k % BLOCK:
        raise UnsupportedError(f"x must be (..., K) with K a multiple of {BLOCK}, got {describe(x)}")
    w, ws = _check_nvfp4("w_fp4", w_fp4, "w_scales", w_scales, scale_layout, False, x)
    if w.shape[2] * 2 != k:
        raise UnsupportedError(f"w_fp4 {describe(w_fp4)} holds {w.shape[2] * 2} values per row; "
                               f"x has K = {k}")
    n = w.shape[1]
    if bias is not None:
        check_tensor("bias", bias, (torch.float32, torch.float16, torch.bfloat16), x)
        if bias.shape != (n,):
            raise UnsupportedError(f"bias must be ({n},), got {describe(bias)}")
    if torch.is_grad_enabled() and x.requires_grad:
        raise UnsupportedError("gemm_w4a16 has no backward (weight-only NVFP4 is for inference); "
                               "call it under torch.no_grad() or on a detached x")
    lead = x.shape[:-1]
    m = math.prod(lead)
    rows = x.reshape(m, k)
    alpha = _alpha(w_global_scale, x.device)
    if m == 0 or n == 0 or k == 0:
        out = torch.zeros((m, n), dtype=x.dtype, device=x.device)
        if bias is not None:
            out += bias.to(x.dtype)
        return out.reshape(*lead, n)
    if m <= SKINNY_MAX_M and _fits_skinny(k):
        out = torch.empty((1, m, n), dtype=x.dtype, device=x.device)
        _run_skinny(w, ws, rows.unsqueeze(0), None, out, bias, alpha, scale_layout)
        if key is not None and x.is_contiguous() and len(_plans) < _PLAN_LIMIT:
            parts = _skinny_plan_fn(w_fp4, w_scales, rows, None, 1, m, n, x.dtype, w_global_scale,
                                    scale_layout)
            if parts is not None:
                _plans[key] = _w4a16_plan(parts, lead, m, n, k)
        return out.reshape(*lead, n)
    from ..gemm.op import gemm

    if isinstance(w_global_scale, (int, float)):  # exact weights, the scale in the epilogue
        weight = _decode(w, ws, scale_layout, x.dtype)[0]
        out = gemm(rows, weight.t(), bias=bias, alpha=float(w_global_scale))
    else:  # a scale on the GPU: folded into the decoded weights (one rounding each)
        weight = _decode(w, ws, scale_layout, x.dtype, alpha)[0]
        out = gemm(rows, weight.t(), bias=bias)
    return out.reshape(*lead, n)


class NVFP4Weight:
    """An NVFP4 weight prepared once for ``gemm_w4a16``'s tensor-core kernel
    (``nvfp4_prepare_weight``): the same codes regrouped into 64-row x 64-value chunks in the
    order the kernel's threads read them and the e4m3 block scales as bf16 (exact), N padded to
    64 rows and K to 128 values with zeros (``nvfp4_w4a16_sm90``): 11% more bytes than the
    packed codes and e4m3 scales, plus the padding."""

    def __init__(self, data: torch.Tensor, n: int, k: int):
        self.data, self.n, self.k = data, n, k

    @property
    def shape(self) -> tuple:
        return (self.n, self.k)

    @property
    def device(self):
        return self.data.device

    def __repr__(self) -> str:
        return f"NVFP4Weight(n={self.n}, k={self.k}, device={self.data.device})"


def nvfp4_prepare_weight(w_fp4, w_scales, *, scale_layout: str = "plain") -> NVFP4Weight:
    """Regroup an NVFP4 weight (packed codes (N, K / 2), e4m3 scales in either layout) for
    ``gemm_w4a16``'s tensor-core kernel; exact (the values do not change).

    Constraints:
      - CUDA; K a multiple of 16; N a multiple of 8 (the kernel's output rows are 16-byte aligned)
    """
    _check_layout(scale_layout)
    w, ws = _check_nvfp4("w_fp4", w_fp4, "w_scales", w_scales, scale_layout, False)
    n, k = w.shape[1], w.shape[2] * 2
    if n % 8:
        raise UnsupportedError(f"nvfp4_prepare_weight needs N (rows of w_fp4) a multiple of 8, "
                               f"got {describe(w_fp4)}")
    scales = ws[0]
    if scale_layout == "blocked":
        from .formats import from_blocked

        scales = from_blocked(scales, n, k // BLOCK)
    from .nvfp4_w4a16_sm90 import prepare_weight

    return NVFP4Weight(prepare_weight(w[0], scales.reshape(n, k // BLOCK)), n, k)


def w4a16_config(m: int, n: int, sms: int, bias: bool, k: int = 0):
    """The tensor-core W4A16 kernel's configuration for ``m`` rows of x and ``n`` weight rows
    (direct launches in CUDA graphs on an H200, ``benchmarks/NOTES.md``): 16 .. 256 tokens per
    tile, 64 weight rows per tile up to 128 tokens (128 beyond). A 64-row tile's decode is bound
    by its warpgroup's instruction stream, so SMs get more warpgroups where they can: two CTAs
    per SM where the tiles outnumber the SMs (1 x 14336 x 4096: 1624 -> 2054 GB/s), else MMA
    warpgroups splitting each tile's K: two (16 x 8192^2: 2118 -> 2255 GB/s), three up to 32
    tokens (H100, CUDA graphs: 16 x 8192^2 +1-2%, 16 x 4096 x 14336 +8%, 16 x 4096^2 +5%; at
    64 tokens three lose 4%, four warpgroups at 112 registers lose everywhere). 128-row tiles
    take k-tiles of one chunk (five stages instead of two at 128 x 256) in clusters of two (H100,
    CUDA graphs, medians of 6 rounds: 4096 x 8192^2 675 -> 740 TFLOP/s, 4096 x 28672 x 4096
    651 -> 695, 512 x 8192^2 674 -> 750), their token tile (256, 192 or 128) the one whose waves
    of tiles cost least, a tile's time taken as its tokens + 32 (H100, CUDA graphs, 256 / 192 /
    128: 256 x 8192^2 403 / 477 / 647 TFLOP/s, 384 x 8192^2 579 / 738 / 454, 1024 x 4096^2
    764 / 468 / 582, 256 x 28672 x 4096 629 / 415 / 521: the rule's pick each time). Split
    tiles of 32 or 64 tokens that fill at most half the SMs, over a long K (``k`` >= 12288), run
    stream-K over all SMs (CUDA graphs, split / stream-K: 32 x 4096 x 14336 1263-1274 /
    1405-1423 GB/s, 64 x 4096 x 14336 1002-1025 / 1221-1226); at 16 tokens, a shorter K or more
    tiles it does not pay (16 x 4096 x 14336 1392 / 1271, 48 x 4096 x 8192 954 / 933, 16 x
    4096^2 1053 / 722, 16 x 8192^2 1998 / 1457)."""
    from ..gemm.config import Epilogue, GemmConfig

    tile_m = 64 if m <= 128 else 128
    if tile_m == 64:
        tile_n = next(t for t in (16, 32, 64, 128) if m <= t)
    else:
        weight_tiles = -(-n // tile_m)
        tile_n = min((256, 192, 128), key=lambda t: -(-weight_tiles * -(-m // t) // sms) * (t + 32))
    tiles = -(-n // tile_m) * -(-m // tile_n)
    narrow = tile_m == 64 and tile_n <= 64
    wide = tile_m == 128  # one chunk per k-tile (more stages), x shared by pairs of CTAs
    split = narrow and tiles <= sms
    stream_k = split and tile_n >= 32 and 2 * tiles <= sms and k >= 12288
    return GemmConfig(tile_m, tile_n, k_blocks=4 if wide else 8, cluster_m=2 if wide else 1,
                      ctas_per_sm=2 if narrow and tiles > sms else 1,
                      warpgroups=(3 if tile_n <= 32 else 2) if split else 0,
                      stream_k=stream_k, max_clusters=sms if stream_k else 1 << 30,
                      epilogue=Epilogue(bias=bias, scalar_scale_a=True, alpha=True))


def _w4a16_workspace(cfg, device) -> tuple:
    """Stream-K (``cfg.stream_k``): the fp32 partial sums, one slot per CTA (its MMA threads'
    accumulators), and one flag per CTA, zeroed once: a launch clears every flag it sets, so a
    launch plan keeps them (launches of one plan are ordered on its stream). Else (None, None)."""
    if not cfg.stream_k:
        return None, None
    ctas = cfg.max_clusters * cfg.cluster_m * cfg.cluster_n
    warpgroups = cfg.warpgroups or cfg.tile_m // 64
    work = torch.empty(ctas * warpgroups * 64 * cfg.tile_n, dtype=torch.float32, device=device)
    return work, torch.zeros(ctas, dtype=torch.int64, device=device)


def _w4a16_kernel(cfg):
    fn = _kernels.get(("w4a16", cfg))
    if fn is None:
        from .nvfp4_w4a16_sm90 import W4A16GemmSm90, kernel_specs

        fn = _kernels[("w4a16", cfg)] = get_kernel(W4A16GemmSm90, cfg, kernel_specs(cfg, cfg.epilogue.bias))
    return fn


def _gemm_w4a16_prepared(x, w: NVFP4Weight, w_scales, w_global_scale, bias):
    """``gemm_w4a16`` with a prepared weight (checks, then the tensor-core kernel; a checked
    signature keeps a launch plan)."""
    key = None
    if isinstance(x, torch.Tensor) and x.is_cuda and w_scales is None and not torch.compiler.is_compiling():
        key = ("w4a16_prepared", _meta(x), x.device, id(w), w.data.data_ptr(), _meta(bias),
               w_global_scale if isinstance(w_global_scale, (int, float)) else "tensor",
               _stream(x.device))
        plan = _plans.get(key)
        if plan is not None and x.data_ptr() % 16 == 0 and not (x.requires_grad and torch.is_grad_enabled()):
            return plan(x, w, w_global_scale, bias)
    out, plan = _w4a16_prepared_checked(x, w, w_scales, w_global_scale, bias)
    if key is not None and plan is not None and len(_plans) < _PLAN_LIMIT:
        _plans[key] = plan
    return out


def _w4a16_prepared_checked(x, w: NVFP4Weight, w_scales, w_global_scale, bias):
    """(out, a launch plan for this signature or None)."""
    from .nvfp4_w4a16_sm90 import DECODE_EXPONENT

    if w_scales is not None:
        raise UnsupportedError("a prepared weight (NVFP4Weight) carries its scales: pass w_scales=None")
    check_tensor("x", x, (torch.bfloat16,), w.data)
    if x.dim() < 1 or x.shape[-1] != w.k:
        raise UnsupportedError(f"x must be (..., {w.k}) for {w!r}, got {describe(x)}")
    if bias is not None:
        check_tensor("bias", bias, (torch.float32, torch.float16, torch.bfloat16), x)
        if bias.shape != (w.n,):
            raise UnsupportedError(f"bias must be ({w.n},), got {describe(bias)}")
    if torch.is_grad_enabled() and x.requires_grad:
        raise UnsupportedError("gemm_w4a16 has no backward (weight-only NVFP4 is for inference); "
                               "call it under torch.no_grad() or on a detached x")
    if torch.compiler.is_compiling():
        raise UnsupportedError("gemm_w4a16 with a prepared weight runs eagerly only; under "
                               "torch.compile pass the packed codes and scales")
    lead, n, k = x.shape[:-1], w.n, w.k
    m = math.prod(lead)
    rows = x.reshape(m, k)
    if rows.stride(-1) != 1 or rows.stride(0) % 8 or rows.data_ptr() % 16:
        rows = rows.contiguous()
        if rows.data_ptr() % 16:
            rows = rows.clone()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*lead, n), None
    cfg = w4a16_config(m, n, _sms(x.device), bias is not None, k)
    fn = _w4a16_kernel(cfg)
    work, flags = _w4a16_workspace(cfg, x.device)
    decode = float(2 ** DECODE_EXPONENT)
    fn(w.data, rows, out, None, None if bias is None else bias.float(),
       _alpha(w_global_scale, x.device), None, None, None, work, flags, None, None, decode, 0.0,
       stream_k_token() if cfg.stream_k else 0)
    if rows is not x and rows.data_ptr() != x.data_ptr():
        return out.reshape(*lead, n), None  # x was copied: no plan
    constant = _alpha(w_global_scale, x.device) if isinstance(w_global_scale, (int, float)) else None

    def run(x, w, g, bias):
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        fn(w.data, x if x.dim() == 2 else x.view(m, k), out, None, None if bias is None else bias.float(),
           constant if constant is not None else _alpha(g, x.device), None, None, None, work,
           flags, None, None, decode, 0.0, stream_k_token() if cfg.stream_k else 0)
        return out if len(lead) == 1 else out.view(*lead, n)
    return out.reshape(*lead, n), run


def gemm_nvfp4(a, b, sfa, sfb, *, alpha=1.0, scale_layout: str = "plain",
               out_dtype: torch.dtype = torch.float16, out=None):
    """``alpha * dequantize(a) @ dequantize(b)^T`` with both operands NVFP4 (W4A4), batched.

    Args:
        a: packed e2m1 codes (M, K / 2) or (L, M, K / 2), uint8 or float4_e2m1fn_x2.
        b: packed e2m1 codes (N, K / 2) or (L, N, K / 2).
        sfa, sfb: e4m3 block scales of a and b: plain (rows, K / 16) (with L first when
            batched) or the flat blocked layout ((entries,) or (L, entries)).
        alpha: float or one-element tensor (the product of the global scales).
        out_dtype: fp16 (the public NVFP4 problems' output), bf16 or fp32. out: optional (M, N) /
            (L, M, N) output of any strides.

    Constraints:
      - fp32 accumulation of the exact decoded values; at most 64 rows on one side (and K a
        multiple of 32) run the skinny kernel, transposed when N is the small side; larger
        products decode both operands to bf16 and run ``ck.gemm``
      - no autograd
    """
    key = None
    if not torch.compiler.is_compiling() and all(isinstance(t, torch.Tensor) for t in (a, b, sfa, sfb)) \
            and a.is_cuda:
        key = ("nvfp4", _meta(a), a.device, _meta(b), _meta(sfa), _meta(sfb), _meta(out), out_dtype,
               scale_layout, alpha if isinstance(alpha, (int, float)) else "tensor", _stream(a.device))
        plan = _plans.get(key)
        if plan is not None and _aligned(a, b) and sfa.data_ptr() % 4 == 0 and sfb.data_ptr() % 4 == 0:
            return plan(a, b, sfa, sfb, alpha, out)
    _check_layout(scale_layout)
    if out_dtype not in NVFP4_OUT_DTYPES:
        raise DTypeError(f"out_dtype={out_dtype}; supported: {NVFP4_OUT_DTYPES}")
    batched = isinstance(a, torch.Tensor) and a.dim() == 3
    pa, sa = _check_nvfp4("a", a, "sfa", sfa, scale_layout, batched)
    pb, sb = _check_nvfp4("b", b, "sfb", sfb, scale_layout, batched, a)
    if pa.shape[0] != pb.shape[0] or pa.shape[2] != pb.shape[2]:
        raise UnsupportedError(f"a {describe(a)} and b {describe(b)} must share L and K")
    batch, m, n, k = pa.shape[0], pa.shape[1], pb.shape[1], pa.shape[2] * 2
    shape = (batch, m, n) if batched else (m, n)
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=pa.device)
    else:
        check_tensor("out", out, (out_dtype,), pa)
        if tuple(out.shape) != shape:
            raise UnsupportedError(f"out must be {shape}, got {describe(out)}")
    out3 = out if batched else out.unsqueeze(0)
    scale = _alpha(alpha, pa.device)
    if out.numel() == 0:
        return out
    if k == 0:
        out.zero_()
        return out
    if min(m, n) <= SKINNY_MAX_M and _fits_skinny(k):
        transpose = m > n  # b's few rows against a's
        if not transpose:  # the few rows of a against b's rows
            _run_skinny(pb, sb, pa, sa, out3, None, scale, scale_layout)
        else:
            _run_skinny(pa, sa, pb, sb, out3.transpose(1, 2), None, scale, scale_layout)
        if key is not None and len(_plans) < _PLAN_LIMIT:
            x, w, sx, sw = (b, a, sfb, sfa) if transpose else (a, b, sfa, sfb)
            rows_x, rows_w = (n, m) if transpose else (m, n)
            parts = _skinny_plan_fn(w, sw, x, sx, batch, rows_x, rows_w, out_dtype, alpha, scale_layout)
            if parts is not None:
                _plans[key] = _nvfp4_plan(parts, batched, transpose, shape, out_dtype, k)
        return out
    from ..gemm.op import gemm

    da = _decode(pa, sa, scale_layout, torch.bfloat16)
    db = _decode(pb, sb, scale_layout, torch.bfloat16)
    if isinstance(alpha, (int, float)):
        gemm(da, db.transpose(1, 2), alpha=float(alpha), out_dtype=out_dtype, out=out3)
    else:
        out3.copy_(gemm(da, db.transpose(1, 2), out_dtype=torch.float32).mul_(scale))
    return out


def gemv_nvfp4(a, x, sfa, sfx, *, alpha=1.0, scale_layout: str = "plain",
               out_dtype: torch.dtype = torch.float16, out=None):
    """``alpha * dequantize(a) @ dequantize(x)``: an NVFP4 matrix times an NVFP4 vector.

    Args:
        a: packed codes (M, K / 2) or (L, M, K / 2); sfa its scales (as ``gemm_nvfp4``).
        x: packed codes (K / 2,) or (L, K / 2); sfx its scales: plain (K / 16,) / (L, K / 16),
            or blocked (a 128-row tile per vector: 128 * K / 16 entries (padded to 4 columns),
            row 0 the vector's) as (entries,) / (L, entries).
        out: optional (M,) / (L, M) output of any stride.

    Constraints:
      - ``gemm_nvfp4`` with one row in b: the skinny kernel streams a once (K a multiple of 32)
    """
    batched = isinstance(a, torch.Tensor) and a.dim() == 3
    if not isinstance(x, torch.Tensor) or x.dim() != (2 if batched else 1):
        raise UnsupportedError(f"x must be (K / 2,) packed codes, with L first when a is batched, "
                               f"got {describe(x)}")
    b = x.unsqueeze(-2)
    sfb = sfx.unsqueeze(-2) if scale_layout == "plain" and isinstance(sfx, torch.Tensor) else sfx
    if scale_layout == "blocked" and isinstance(sfx, torch.Tensor):
        k = x.shape[-1] * 2
        if sfx.shape[-1] != _expected_scales(1, k, "blocked")[0]:
            raise UnsupportedError(f"sfx must hold {_expected_scales(1, k, 'blocked')[0]} blocked "
                                   f"entries per vector, got {describe(sfx)}")
    if out is not None:
        out = out.unsqueeze(-1)
    result = gemm_nvfp4(a, b, sfa, sfb, alpha=alpha, scale_layout=scale_layout,
                        out_dtype=out_dtype, out=out)
    return result.squeeze(-1)


def nvfp4_dual_gemm(a, b1, b2, sfa, sfb1, sfb2, *, scale_layout: str = "plain",
                    out_dtype: torch.dtype = torch.float16):
    """``silu(a @ b1^T) * (a @ b2^T)`` with NVFP4 a, b1, b2 (the gated MLP's first layer).

    Constraints:
      - as ``gemm_nvfp4``; the products are fp32, the gate and the multiply in fp32, one
        rounding to ``out_dtype``
    """
    if out_dtype not in NVFP4_OUT_DTYPES:
        raise DTypeError(f"out_dtype={out_dtype}; supported: {NVFP4_OUT_DTYPES}")
    first = gemm_nvfp4(a, b1, sfa, sfb1, scale_layout=scale_layout, out_dtype=torch.float32)
    second = gemm_nvfp4(a, b2, sfa, sfb2, scale_layout=scale_layout, out_dtype=torch.float32)
    return torch.nn.functional.silu(first).mul_(second).to(out_dtype)


class NVFP4Linear(torch.nn.Module):
    """``nn.Linear`` at inference with NVFP4 weights (weight-only: activations stay bf16 /
    fp16), on ``gemm_w4a16``. ``prepare()`` (or ``from_float(..., prepare=True)``) also keeps
    the weight prepared for the tensor-core kernel (``nvfp4_prepare_weight``), which eager bf16
    calls then take: 1.06-3.4x the packed path at 1-64 tokens (H100, CUDA graphs,
    ``benchmarks/NOTES.md``), for ~1.1x the packed weight's memory again. The prepared copy follows the buffers: it is made
    again when they change (``load_state_dict``, ``.to``) and is not part of the state dict.

    Constraints:
      - CUDA; in_features a multiple of 16; inference only (no gradients)
      - the prepared path: out_features a multiple of 8, bf16 activations, eager calls
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None):
        super().__init__()
        if in_features % BLOCK:
            raise UnsupportedError(f"in_features={in_features} must be a multiple of {BLOCK}")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_fp4", torch.zeros(out_features, in_features // 2,
                                                       dtype=torch.uint8, device=device))
        self.register_buffer("weight_scales", torch.zeros(out_features, in_features // BLOCK,
                                                          dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_global_scale", torch.ones((), device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)
        self.prepared = False
        self._prepared = None  # (NVFP4Weight, the buffers' identity when it was made)

    def prepare(self) -> "NVFP4Linear":
        """Keep the weight prepared for the tensor-core kernel too (class docstring)."""
        if self.out_features % 8:
            raise UnsupportedError(f"prepare() needs out_features a multiple of 8, got {self.out_features}")
        self.prepared = True
        return self

    def _prepared_weight(self):
        w, s = self.weight_fp4, self.weight_scales
        identity = (w.data_ptr(), s.data_ptr(), w._version, s._version, w.device)
        if self._prepared is None or self._prepared[1] != identity:
            self._prepared = (nvfp4_prepare_weight(w, s), identity)
        return self._prepared[0]

    @classmethod
    def from_float(cls, linear: torch.nn.Linear, prepare: bool = False) -> "NVFP4Linear":
        """Quantize ``linear``'s weight to NVFP4 (``nvfp4_quantize``, default global scale);
        with ``prepare`` also keep it prepared (``prepare()``)."""
        from .nvfp4 import nvfp4_quantize

        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"from_float takes an nn.Linear, got {type(linear).__name__}")
        weight = linear.weight.detach()
        check_tensor("linear.weight", weight, (torch.float32, torch.float16, torch.bfloat16))
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, weight.device)
        packed, scales, global_scale = nvfp4_quantize(weight)
        module.weight_fp4.copy_(packed)
        module.weight_scales.copy_(scales)
        module.weight_global_scale.copy_(global_scale)
        if linear.bias is not None:
            module.bias = linear.bias.detach().float().clone()
        return module.prepare() if prepare else module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dtype not in ACTIVATION_DTYPES:
            raise DTypeError(f"NVFP4Linear takes bf16 / fp16 activations, got {describe(x)}")
        if x.shape[-1] != self.in_features:
            raise UnsupportedError(f"x has {x.shape[-1]} features in its last dim, this layer "
                                   f"takes {self.in_features}")
        if (self.prepared and x.dtype == torch.bfloat16 and x.is_cuda
                and not torch.compiler.is_compiling()):
            return gemm_w4a16(x, self._prepared_weight(), None, self.weight_global_scale,
                              bias=self.bias)
        return gemm_w4a16(x, self.weight_fp4, self.weight_scales, self.weight_global_scale,
                          bias=self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, prepared={self.prepared}")


def compile_configurations(quick: bool = False):
    """(kernel, config, specs) of the NVFP4 product kernels the heuristics return."""
    from .nvfp4_dequantize_sm90 import DequantizeNvfp4Sm90
    from .nvfp4_skinny_sm90 import SkinnyGemmNvfp4Sm90

    found, seen = [], set()
    outs = {"bfloat16": ("bfloat16",), "float16": ("float16",),
            "nvfp4": ("float16", "bfloat16", "float32")}
    # streaming (1 to 8 rows of 16-bit x, 1 to 4 of NVFP4 x: x_rows 1, 2, 4, 8), the ring with
    # one token tile (8 rows of NVFP4 x), more; NVFP4 x's other output dtypes (the same kernels
    # but for the epilogue's conversion) at one row only
    for m in (1, 2, 3, 8, 16, 32, 64):
        for x_format, out_dtypes in outs.items():
            for out in out_dtypes if m == 1 else out_dtypes[:1]:
                shapes = ((1024, 8192), (16384, 8192), (65536, 8192))  # split, not, two slabs
                if streams(m, x_format):  # streaming: one range of K, long and short
                    shapes += ((32768, 2048), (32768, 512))
                for n, k in shapes:
                    cfg = skinny_plan(m, n, k, 1, x_format, out, 132)[0]
                    if cfg not in seen:
                        seen.add(cfg)
                        found.append((SkinnyGemmNvfp4Sm90, cfg, _skinny_specs(cfg)))
    for out in DEQUANT_OUT_NAMES:
        found.append((DequantizeNvfp4Sm90, out, _dequantize_specs(out)))
    found += w4a16_configurations()
    return found[:2] if quick else found


def w4a16_configurations():
    """(kernel, config, specs) of every tensor-core W4A16 configuration ``w4a16_config`` returns
    (token tiles 16 .. 256, one or two CTAs per SM, split K with and without stream-K, with and
    without a bias)."""
    from .nvfp4_w4a16_sm90 import W4A16GemmSm90, kernel_specs

    found, seen = [], set()
    for m in (1, 32, 64, 128, 256, 384, 4096):  # 128-row tiles: token tiles 128, 192, 256
        for n in (1024, 8192, 28672):  # few tiles (split K), many (two CTAs per SM)
            for bias in (False, True):
                cfg = w4a16_config(m, n, 132, bias, 14336)
                if cfg not in seen:
                    seen.add(cfg)
                    found.append((W4A16GemmSm90, cfg, kernel_specs(cfg, bias)))
    return found
