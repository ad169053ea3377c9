"""``cross_entropy`` and ``fused_linear_cross_entropy``: torch-facing ops and autograd."""

from __future__ import annotations

import dataclasses

import torch

from ..runtime import (DTypeError, ScalarSpec, StreamSpec, Sym, TensorSpec, UnsupportedError, get_kernel,
                       kernel_op)
from ..runtime.errors import check_tensor, describe
from .config import row_config
from .cross_entropy import (CrossEntropyBwdSm90, CrossEntropyConfig, CrossEntropyFwdSm90,
                            InverseCountSm90, ScaleRowsSm90)
from .dispatch import RowKernels, row_specs, vector_width, widest_itemsize
from ..gemm.config import Epilogue, GemmConfig
from ..gemm.op import gemm_with_config
from ..runtime.arch import sm_count

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TARGET_DTYPES = (torch.int64, torch.int32)
REDUCTIONS = ("mean", "sum", "none")

_ROW_STAT = TensorSpec("float32", (Sym("m"),), (1,), 4)
_ROW_SCALE = TensorSpec("float32", (Sym("m"),), (Sym(),), 4)  # may be a broadcast scalar
_SCALE = TensorSpec("float32", (1,), (1,), 4)


def _target_spec(dtype):
    name = str(dtype).removeprefix("torch.")
    return TensorSpec(name, (Sym("m"),), (1,), 8 if dtype == torch.int64 else 4)


def _build_forward(key, vec):
    x_t, target_t, grad_t, smoothing, z_loss, scaled, n = key
    rows = row_config(n, vec, widest_itemsize((x_t, grad_t)), tensors_held=1)
    # Direct loads, so the target's dependent scalar loads overlap the row's.
    rows = dataclasses.replace(rows, stage_smem=False)
    config = CrossEntropyConfig(rows, smoothing, z_loss, grad_t is not None, scaled)
    x = row_specs((x_t,), n, vec)
    grad = None if grad_t is None else row_specs((grad_t,), n, vec)[0]
    specs = (x[0], _target_spec(target_t), _ROW_STAT, _ROW_STAT, grad,
             _SCALE if scaled else None, ScalarSpec("int64"), ScalarSpec("float32"),
             ScalarSpec("float32"), x[-1])
    return CrossEntropyFwdSm90, config, specs


def _build_backward(key, vec):
    x_t, target_t, grad_t, smoothing, z_loss, n = key
    rows = row_config(n, vec, widest_itemsize((x_t, grad_t)), tensors_held=1)
    config = CrossEntropyConfig(rows, smoothing, z_loss)
    x, grad = row_specs((x_t, grad_t), n, vec)[:2]
    specs = (x, _target_spec(target_t), _ROW_STAT, _ROW_SCALE, grad, ScalarSpec("int64"),
             ScalarSpec("float32"), ScalarSpec("float32"), row_specs((), n, vec)[-1])
    return CrossEntropyBwdSm90, config, specs


def _build_scale(key, vec):
    x_t, n = key
    rows = dataclasses.replace(row_config(n, vec, widest_itemsize((x_t,)), tensors_held=1), stage_smem=False)
    x = row_specs((x_t,), n, vec)
    return ScaleRowsSm90, rows, (x[0], _SCALE, x[-1])


_forward_kernels = RowKernels(_build_forward)
_backward_kernels = RowKernels(_build_backward)
_scale_kernels = RowKernels(_build_scale)


_count_kernels: dict = {}


@kernel_op("inverse_count", mutates_args=("scale",))
def inverse_count(target: torch.Tensor, scale: torch.Tensor, ignore_index: int) -> None:
    """scale[0] = 1 / (number of entries of the 1-D ``target`` other than ``ignore_index``),
    inf when there are none; on the device, no synchronization."""
    fn = _count_kernels.get(target.dtype)
    if fn is None:
        specs = (_target_spec(target.dtype), _SCALE, ScalarSpec("int64"), StreamSpec())
        fn = _count_kernels[target.dtype] = get_kernel(InverseCountSm90, None, specs)
    fn(target, scale, ignore_index)


@kernel_op("scale_rows", mutates_args=("x",))
def scale_rows(x: torch.Tensor, scale: torch.Tensor) -> None:
    """x[M, N] *= scale (a 1-element fp32 tensor), in place; nothing moves when scale is 1."""
    _scale_kernels((x.dtype, x.shape[1]), (x,), x, scale)


@kernel_op(
    "cross_entropy_fwd",
    mutates_args=("loss", "lse", "grad"),
    schema="(Tensor logits, Tensor target, Tensor(a!) loss, Tensor(b!) lse, Tensor(c!)? grad, "
    "Tensor? grad_scale, int ignore_index, float label_smoothing, float lse_square_scale) -> ()",
)
def cross_entropy_fwd(logits, target, loss, lse, grad, grad_scale, ignore_index: int,
                      label_smoothing: float, lse_square_scale: float) -> None:
    """Per-row loss and lse of (M, V) logits; with ``grad``, also dloss/dlogits (``grad`` may be
    ``logits`` itself). With ``grad_scale``, the loss and gradient rows are times grad_scale[0].
    M >= 1."""
    key = (logits.dtype, target.dtype, None if grad is None else grad.dtype, label_smoothing > 0,
           lse_square_scale > 0, grad_scale is not None, logits.shape[1])
    tensors = (logits,) if grad is None or grad is logits else (logits, grad)
    _forward_kernels(key, tensors, logits, target, loss, lse, grad, grad_scale, ignore_index,
                     label_smoothing, lse_square_scale)


@kernel_op(
    "cross_entropy_bwd",
    mutates_args=("grad",),
    schema="(Tensor logits, Tensor target, Tensor lse, Tensor dloss, Tensor(a!) grad, "
    "int ignore_index, float label_smoothing, float lse_square_scale) -> ()",
)
def cross_entropy_bwd(logits, target, lse, dloss, grad, ignore_index: int, label_smoothing: float,
                      lse_square_scale: float) -> None:
    """grad[M, V] = dloss[row] * dloss_row/dlogits, from the logits and the stored lse."""
    key = (logits.dtype, target.dtype, grad.dtype, label_smoothing > 0, lse_square_scale > 0,
           logits.shape[1])
    _backward_kernels(key, (logits, grad), logits, target, lse, dloss, grad, ignore_index,
                      label_smoothing, lse_square_scale)


# ----------------------------------------------------------------------------- validation


def _check(logits, target, ignore_index, label_smoothing, reduction, lse_square_scale, what="logits"):
    check_tensor(what, logits, FLOAT_DTYPES)
    check_tensor("target", target, TARGET_DTYPES, logits)
    if reduction not in REDUCTIONS:
        raise UnsupportedError(f"reduction={reduction!r}; supported: {REDUCTIONS}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise UnsupportedError(f"label_smoothing={label_smoothing} must be in [0, 1]")
    if not float(lse_square_scale) >= 0.0:
        raise UnsupportedError(f"lse_square_scale={lse_square_scale} must be >= 0")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise UnsupportedError(f"ignore_index must be an int, got {ignore_index!r}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1])


def _mean_scale(t2: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """(1,) fp32: 1 / the number of counted targets (inf when none), computed on the device."""
    scale = torch.empty(1, dtype=torch.float32, device=t2.device)
    inverse_count(t2, scale, ignore_index)
    return scale


class _CrossEntropy(torch.autograd.Function):
    """With reduction "mean" or "sum" and a gradient needed, the forward writes the gradient
    (for an incoming gradient of 1) while it reads the logits, and the backward only scales it:
    the logits are read once in all. With reduction "none" the backward recomputes the gradient
    from the logits and the stored lse. For "mean" the kernel stores each row's loss already
    divided by the number of counted rows, so the loss is the sum of the rows."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, smoothing, reduction, z, inplace):
        x2, t2 = _rows(logits), target.reshape(-1)
        m = x2.shape[0]
        loss_rows = torch.empty(m, dtype=torch.float32, device=logits.device)
        lse = torch.empty(m, dtype=torch.float32, device=logits.device)
        fused = reduction != "none" and any(ctx.needs_input_grad)
        grad = (x2 if inplace else torch.empty_like(x2)) if fused else None
        scale = _mean_scale(t2, ignore_index) if reduction == "mean" else None
        if m:
            cross_entropy_fwd(x2, t2, loss_rows, lse, grad, scale, ignore_index, smoothing, z)
        ctx.args = (ignore_index, smoothing, reduction, z, fused, logits.shape)
        if fused:
            ctx.save_for_backward(grad)
        else:
            ctx.save_for_backward(x2, t2, lse)
        if reduction == "none":
            return loss_rows.view(target.shape)
        if m == 0 and scale is not None:
            return (loss_rows.sum() * scale).reshape(())  # 0 * inf = NaN: the mean of nothing, as torch
        return loss_rows.sum()

    @staticmethod
    def backward(ctx, dloss):
        ignore_index, smoothing, reduction, z, fused, shape = ctx.args
        if fused:
            (grad,) = ctx.saved_tensors
            if grad.shape[0]:
                scale_rows(grad, dloss.float().reshape(1))
            return grad.view(shape), None, None, None, None, None, None
        x2, t2, lse = ctx.saved_tensors
        m = x2.shape[0]
        drows = dloss.float().reshape(m)
        grad = torch.empty_like(x2)
        if m:
            cross_entropy_bwd(x2, t2, lse, drows, grad, ignore_index, smoothing, z)
        return grad.view(shape), None, None, None, None, None, None


def cross_entropy(logits, target, ignore_index: int = -100, label_smoothing: float = 0.0,
                  reduction: str = "mean", lse_square_scale: float = 0.0,
                  inplace_backward: bool = False):
    """Cross-entropy of ``logits`` (..., V) against class indices ``target`` (...).

    The class dim is the last one (``F.cross_entropy`` takes it at dim 1). The loss is fp32.

    Args:
        logits: CUDA tensor, float32 / float16 / bfloat16.
        target: int64 or int32, logits' shape without the last dim.
        ignore_index: rows with this target count 0 and are left out of the mean.
        label_smoothing: eps in [0, 1]: the target distribution is (1 - eps) one-hot + eps / V.
        reduction: "mean" (over counted rows; NaN if none, as torch), "sum" or "none".
        lse_square_scale: z-loss, adds ``scale * lse^2`` per counted row.
        inplace_backward: write the gradient over ``logits`` (whose values are lost) instead
            of a new buffer, saving one logits-sized allocation. Not with reduction="none";
            eager mode only (under torch.compile the regular path runs).

    With a gradient needed and reduction "mean" or "sum", the gradient is computed in the
    forward (the logits are read once) and kept until the backward, which scales it by the
    incoming gradient (no memory traffic when that is 1).

    Constraints:
      - V up to 524288
      - a target outside [0, V) that is not ``ignore_index`` gives a NaN loss for its row (no
        device assert, never an out-of-bounds read)
    """
    _check(logits, target, ignore_index, label_smoothing, reduction, lse_square_scale)
    if logits.dim() == 0 or tuple(target.shape) != tuple(logits.shape[:-1]):
        raise UnsupportedError(
            f"target must have logits' shape without the class dim: logits {tuple(logits.shape)}, "
            f"target {tuple(target.shape)}"
        )
    if inplace_backward and reduction == "none":
        raise UnsupportedError("inplace_backward needs reduction='mean' or 'sum'")
    if logits.shape[-1] == 0:
        raise UnsupportedError("logits must have at least one class")
    row_config(logits.shape[-1], 1, 4, tensors_held=1)  # refuse rows too long before running
    needs_grad = logits.requires_grad and torch.is_grad_enabled()
    inplace = bool(inplace_backward and needs_grad and not torch.compiler.is_compiling())
    return _CrossEntropy.apply(logits, target, ignore_index, float(label_smoothing), reduction,
                               float(lse_square_scale), inplace)


# ----------------------------------------------------------------------------- fused linear CE


def chunk_rows(tokens: int, hidden: int, vocab: int, itemsize: int, free_bytes: int) -> int:
    """Tokens per chunk of the fused linear cross-entropy.

    A chunk's logits (rows x vocab) take no more memory than the hidden states themselves, and
    at most a quarter of the free device memory; the row count is a power of two (at least 64,
    or all tokens when fewer). Larger chunks run the weight-gradient update fewer times (each
    update reads and writes the whole weight gradient), smaller ones hold less memory.
    """
    budget = min(tokens * hidden * itemsize, free_bytes // 4)
    rows = max(1, budget // max(1, vocab * itemsize))
    chunk = 1 << (rows.bit_length() - 1)
    return max(1, min(tokens, max(64, chunk)))


def _gemm_ready(t: torch.Tensor) -> bool:
    """Row-major with 16-byte-aligned data and rows: the GEMM's TMA reads it as it is."""
    size = t.element_size()
    return t.stride(-1) == 1 and (t.stride(0) * size) % 16 == 0 and t.data_ptr() % 16 == 0 \
        and (t.shape[1] * size) % 16 == 0


# Vocabulary columns per slice of the weight-gradient pass while the slices' logits fit in the
# weight gradient's unwritten rows; narrower slices than the minimum go to a separate buffer.
SLICE_COLUMNS = (1024, 16384)


def _slab_in_place(flat: torch.Tensor, v0: int, tokens: int, hidden: int, vocab: int, align: int):
    """The widest slice [v0, v0 + width) whose (tokens, width) logits fit in the weight
    gradient's rows above it (``flat`` is its storage; those rows are written later), and
    that slab, or (0, None) when it would be narrower than ``SLICE_COLUMNS[0]``."""
    width = min(SLICE_COLUMNS[1], (vocab - v0) * hidden // (tokens + hidden)) // align * align
    while width >= SLICE_COLUMNS[0]:
        stride = -(-width // align) * align
        start = (vocab * hidden - tokens * stride) // align * align
        if start >= (v0 + width) * hidden:
            return width, flat[start: start + tokens * stride].view(tokens, stride)[:, :width]
        width -= align
    return 0, None


def _weight_grad_by_slices(h2, weight, bias, target, lse, scale, ignore_index, grad_w, budget,
                           logits_config):
    """grad_w[v0:v1] = G[:, v0:v1]^T @ h for vocabulary slices: each slice's logits are
    recomputed (one GEMM), turned into their gradient in place from the stored lse (the
    backward kernel, targets shifted into the slice), and multiplied by the hidden states
    straight into the weight gradient: no read-modify-write of grad_w at all.

    The slices' logits live in grad_w's own rows above the slice, which are written only
    later (slices shrink as those rows run out); the last narrow slices use a separate buffer
    of at most ``budget`` logits."""
    tokens, hidden = h2.shape
    vocab = weight.shape[0]
    align = 16 // h2.element_size()
    flat = grad_w.view(-1)
    outside = -(1 << 62)  # marks ignored rows; no shifted target can equal it
    counted = target != ignore_index
    dloss = scale.expand(tokens)
    tail = None
    v0 = 0
    while v0 < vocab:
        width, logits = _slab_in_place(flat, v0, tokens, hidden, vocab, align)
        if logits is None:
            if tail is None:
                columns = max(align, min(SLICE_COLUMNS[0], budget // max(tokens, 1)) // align * align)
                tail = torch.empty((tokens, columns), dtype=h2.dtype, device=h2.device)
            width = min(tail.shape[1], vocab - v0)
            logits = tail[:, :width]
        v1 = v0 + width
        gemm_with_config(h2, weight[v0:v1].t(), logits, None if bias is None else bias[v0:v1],
                         logits_config)
        shifted = torch.where(counted, target.to(torch.int64) - v0, outside)
        cross_entropy_bwd(logits, shifted, lse, dloss, logits, outside, 0.0, 0.0)
        gemm_with_config(logits.t(), h2, grad_w[v0:v1], None,
                         dataclasses.replace(logits_config, epilogue=Epilogue()))
        v0 = v1


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, bias, ignore_index, smoothing, reduction, chunk):
        h2, t2 = _rows(hidden), target.reshape(-1)
        tokens, vocab = h2.shape[0], weight.shape[0]
        device = hidden.device
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[3]
        grads = need_h or need_w or need_b
        loss_rows = torch.empty(tokens, dtype=torch.float32, device=device)
        lse = torch.empty(tokens, dtype=torch.float32, device=device)
        scale = (_mean_scale(t2, ignore_index) if reduction == "mean"
                 else torch.ones(1, dtype=torch.float32, device=device))
        # Without label smoothing the weight gradient comes from a second pass over vocabulary
        # slices (see ``fused_linear_cross_entropy``); otherwise it accumulates chunk by chunk.
        by_slices = (need_w and smoothing == 0.0 and tokens > 0 and hidden.dtype != torch.float32
                     and _gemm_ready(h2) and _gemm_ready(weight))
        grad_h = torch.empty_like(h2) if need_h else None
        grad_w = (torch.empty_like(weight) if by_slices else torch.zeros_like(weight)) if need_w else None
        grad_b = torch.zeros(vocab, dtype=torch.float32, device=device) if need_b else None
        budget_rows = chunk_rows(tokens, h2.shape[1], vocab, h2.element_size(),
                                 torch.cuda.mem_get_info(device)[0])
        align = 16 // h2.element_size()
        row_stride = -(-vocab // align) * align if by_slices else vocab
        # With the slice pass the weight gradient is written only after the chunks: until then
        # its storage holds the chunks' logits, so chunks can be as large as it is.
        scratch_rows = grad_w.numel() // row_stride if by_slices else 0
        if chunk is None:
            chunk = scratch_rows if scratch_rows else budget_rows
        # With the slice pass, both passes compute logits with the project's GEMM in one fixed
        # configuration (same MMA instruction, same order of the K sum), so the recomputed
        # logits are bitwise the ones the lse came from: logits rounded differently would make
        # exp(x - lse) sum to other than 1. Its TMA store needs 16-byte rows: the buffer is padded.
        logits_config = GemmConfig(128, 256, 1, 1, 8, sm_count(device.index or 0),
                                   epilogue=Epilogue(bias=bias is not None))
        rows = min(chunk, tokens)
        if 0 < rows <= scratch_rows:
            buffer = grad_w.view(-1)[: rows * row_stride].view(rows, row_stride)
        else:
            buffer = torch.empty((rows, row_stride), dtype=hidden.dtype, device=device)
        w_t = weight.t()
        for start in range(0, tokens, chunk):
            end = min(start + chunk, tokens)
            h, logits = h2[start:end], buffer[: end - start, :vocab]
            if by_slices:
                gemm_with_config(h, w_t, logits, bias, logits_config)
            elif bias is None:
                torch.mm(h, w_t, out=logits)
            else:
                torch.addmm(bias, h, w_t, out=logits)
            cross_entropy_fwd(logits, t2[start:end], loss_rows[start:end], lse[start:end],
                              logits if grads else None, scale, ignore_index, smoothing, 0.0)
            if need_h:
                torch.mm(logits, weight, out=grad_h[start:end])
            if need_w and not by_slices:
                grad_w.addmm_(logits.t(), h)
            if need_b:
                grad_b += logits.sum(0, dtype=torch.float32)
        if by_slices:
            del buffer, logits, h  # the chunk buffer's memory goes back before the slice pass
            _weight_grad_by_slices(h2, weight, bias, t2, lse, scale, ignore_index, grad_w,
                                   budget_rows * vocab, logits_config)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.shapes = (hidden.shape, None if bias is None else bias.dtype)
        total = loss_rows.sum()  # rows already divided by the counted rows for "mean"
        return (total * scale).reshape(()) if tokens == 0 else total  # an empty mean is NaN

    @staticmethod
    def backward(ctx, dloss):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        hidden_shape, bias_dtype = ctx.shapes
        scale = dloss.float().reshape(1)  # device-side: no traffic at all when it is 1
        if grad_h is not None:
            if grad_h.numel():
                scale_rows(grad_h, scale)
            grad_h = grad_h.view(hidden_shape)
        if grad_w is not None and grad_w.numel():
            scale_rows(grad_w, scale)
        if grad_b is not None:
            grad_b = (grad_b * dloss).to(bias_dtype)
        return grad_h, grad_w, None, grad_b, None, None, None, None


def fused_linear_cross_entropy(hidden, weight, target, bias=None, ignore_index: int = -100,
                               label_smoothing: float = 0.0, reduction: str = "mean",
                               chunk_size: int | None = None):
    """``cross_entropy(hidden @ weight.T + bias, target)`` without materializing the logits.

    Tokens are processed in chunks: the chunk's logits come from one GEMM, the cross-entropy
    kernel turns them into their gradient in place, and that gradient feeds the hidden (and
    bias) gradients right away, so at most one chunk of logits exists at a time. The weight
    gradient then comes from a second pass over vocabulary slices of the same size: each
    slice's logits are recomputed, turned into their gradient from the stored lse, and
    multiplied by the hidden states straight into that slice of the weight gradient. One GEMM
    more than accumulating the weight gradient chunk by chunk, but no read-modify-write of the
    (V, H) weight gradient per chunk, which is memory-bound and cost more. The weight gradient's
    own storage, not yet written, holds the chunks' logits and then the slices' (above the
    slice being written), so the extra memory is the two gradients and a small buffer for the
    last slices. With label smoothing the weight gradient accumulates chunk by chunk in chunks
    of :func:`chunk_rows` tokens. Gradients are computed during the forward and scaled by the
    incoming gradient in the backward.

    Args:
        hidden: (..., H) CUDA tensor, float32 / float16 / bfloat16.
        weight: (V, H), hidden's dtype.  bias: optional (V,).
        target: (...) int64 / int32 class indices.
        reduction: "mean" or "sum".
        chunk_size: tokens per chunk (default: as many as the weight gradient's storage holds
            with the slice pass, else :func:`chunk_rows`; a larger one gets its own buffer).

    Constraints:
      - the weight gradient accumulates chunk by chunk in the weight's dtype (instead of the
        second pass) with label smoothing, float32 inputs, or hidden / weight rows that are not
        16-byte aligned
      - V up to 524288; label smoothing as in :func:`cross_entropy`
    """
    _check(hidden, target, ignore_index, label_smoothing, reduction, 0.0, what="hidden")
    if reduction == "none":
        raise UnsupportedError("fused_linear_cross_entropy supports reduction='mean' or 'sum'")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise UnsupportedError(
            f"weight must be (V, H) with H = hidden.shape[-1] = {hidden.shape[-1]}, got "
            f"{describe(weight)}"
        )
    if weight.device != hidden.device or weight.dtype != hidden.dtype:
        raise DTypeError(f"weight must be on {hidden.device} with dtype {hidden.dtype}: {describe(weight)}")
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.device != hidden.device):
        raise UnsupportedError(f"bias must be ({weight.shape[0]},) on {hidden.device}: {describe(bias)}")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise UnsupportedError(
            f"target {tuple(target.shape)} must have hidden's shape without the last dim "
            f"{tuple(hidden.shape[:-1])}"
        )
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise UnsupportedError(f"chunk_size must be a positive int, got {chunk_size!r}")
    row_config(weight.shape[0], 1, 4, tensors_held=1)
    return _FusedLinearCrossEntropy.apply(hidden, weight, target, bias, ignore_index,
                                          float(label_smoothing), reduction, chunk_size)


# ----------------------------------------------------------------------------- configurations

SAMPLE_VOCABS = (1, 7, 1000, 4096, 32000, 32768, 128256, 131072, 262144)


def compile_configurations(quick: bool = False):
    """(kernel class, config, specs) for the cross-entropy kernels: forward with and without
    the gradient, backward; with and without label smoothing and z-loss; bf16 / fp16 / fp32."""
    found = {}
    vocabs = (7, 32768, 128256) if quick else SAMPLE_VOCABS
    dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16, torch.float32)
    for x_t in dtypes:
        for n in vocabs:
            vec = vector_width(n, widest_itemsize((x_t,)), 0)
            found[("scale", x_t, n)] = _build_scale((x_t, n), vec)
            for smoothing, z in ((False, False), (True, True)):
                for grad_t, scaled in ((None, False), (None, True), (x_t, False), (x_t, True)):
                    key = (x_t, torch.int64, grad_t, smoothing, z, scaled, n)
                    found[("fwd",) + key] = _build_forward(key, vec)
                key = (x_t, torch.int64, x_t, smoothing, z, n)
                found[("bwd",) + key] = _build_backward(key, vec)
    for t in (torch.int64, torch.int32):
        found[("count", t)] = (InverseCountSm90, None, (_target_spec(t), _SCALE, ScalarSpec("int64"), StreamSpec()))
    return list(found.values())


def self_checks():
    """Rows of the ``python -m cute_kernels`` table for cross-entropy."""
    from ..runtime.selfcheck import SelfCheck

    checks = []
    for m, v in ((4096, 32768), (512, 128256)):
        x = torch.randn(m, v, device="cuda", dtype=torch.bfloat16)
        t = torch.randint(0, v, (m,), device="cuda")
        ref = torch.nn.functional.cross_entropy(x.double(), t, reduction="none")
        checks.append(SelfCheck(
            "cross_entropy", f"{m}x{v}", "bfloat16",
            lambda x=x, t=t: cross_entropy(x, t, reduction="none"),
            lambda x=x, t=t: torch.nn.functional.cross_entropy(x, t, reduction="none"), ref, 1e-3))
    return checks
