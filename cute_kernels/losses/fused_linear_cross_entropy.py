"""``fused_linear_cross_entropy``: the loss of ``hidden @ weight.T (+ bias)`` without the full
logits, built from the GEMM family (the logits and the weight gradient) and the row family's
cross-entropy kernels (the loss, the lse and the logits' gradient in place)."""

from __future__ import annotations

import dataclasses

import torch

from ..gemm.config import Epilogue, GemmConfig
from ..gemm.op import gemm_with_config
from ..rowwise.cross_entropy_op import (FLOAT_DTYPES, as_rows, check_arguments, check_row_length,
                                        check_softcap, cross_entropy_bwd, cross_entropy_fwd,
                                        mean_scale, scale_rows)
from ..rowwise.cross_entropy_terms import (add_smoothing_gradient, row_weights, smoothing_sums,
                                           torch_cross_entropy, weighted_smoothing_grads,
                                           weighted_smoothing_loss, z_loss_part)
from ..runtime import DTypeError, UnsupportedError, kernel_op
from ..runtime.arch import sm_count
from ..runtime.errors import check_tensor, describe


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


# Tokens per chunk when the weight gradient accumulates chunk by chunk: each chunk's update
# reads and writes the whole (V, H) weight gradient, so chunks smaller than this cost more in
# those read-modify-writes than the slice pass's extra GEMM.
ACCUMULATE_ROWS = 1024


def accumulates_by_chunks(tokens: int, vocab: int, itemsize: int, free_bytes: int) -> bool:
    """Whether a chunk of ``ACCUMULATE_ROWS`` tokens' logits takes at most a quarter of the
    free device memory: then the weight gradient accumulates chunk by chunk (three GEMMs per
    chunk); otherwise it comes from the slice pass (four, but no memory beyond the gradients)."""
    return min(tokens, ACCUMULATE_ROWS) * vocab * itemsize <= free_bytes // 4


def _free_bytes(device: torch.device) -> int:
    """Free device memory; while a CUDA graph is being captured (no driver query then), what
    this process's allocator has not reserved."""
    if torch.cuda.is_current_stream_capturing():
        return torch.cuda.get_device_properties(device).total_memory - torch.cuda.memory_reserved(device)
    return torch.cuda.mem_get_info(device)[0]


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


def _weight_grad_by_slices(h2, weight, bias, target, lse, scale, ignore_index, z, cap, grad_w, budget,
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
        cross_entropy_bwd(logits, shifted, lse, dloss, logits, outside, 0.0, z, cap)
        gemm_with_config(logits.t(), h2, grad_w[v0:v1], None,
                         dataclasses.replace(logits_config, epilogue=Epilogue()))
        v0 = v1


@kernel_op(
    "fused_linear_cross_entropy_fwd",
    mutates_args=("loss", "lse", "grad_h", "grad_w", "grad_b", "smooth_sums"),
    schema="(Tensor h2, Tensor weight, Tensor t2, Tensor? bias, Tensor(a!) loss, Tensor(e!)? lse, "
    "Tensor(b!)? grad_h, Tensor(c!)? grad_w, Tensor(d!)? grad_b, int ignore_index, float smoothing, "
    "float z, float softcap, str reduction, int? chunk, Tensor(f!)? smooth_sums, "
    "Tensor? class_weight) -> ()",
)
def fused_linear_cross_entropy_fwd(h2, weight, t2, bias, loss, lse, grad_h, grad_w, grad_b,
                                   ignore_index: int, smoothing: float, z: float, softcap: float,
                                   reduction: str, chunk: int | None, smooth_sums,
                                   class_weight) -> None:
    """The loss of (tokens, H) rows ``h2`` against (tokens,) ``t2`` into the fp32 ``loss``
    (0-d; (tokens,) per-row losses with reduction "none"), each row's lse into ``lse`` when
    given, and for an incoming gradient of 1 the gradients into those of ``grad_h`` (h2's
    shape), ``grad_w`` (the weight's) and ``grad_b`` ((V,) fp32) that are given; ``z`` is the
    z-loss scale (``lse_square_scale``), ``softcap`` the logits' cap (0: none). The chunks and
    the slice pass are planned here, where the sizes (and the free memory) are numbers also
    under torch.compile. With ``smooth_sums`` (reduction "none", no gradients), each row's
    ``sum_j class_weight[j] * logit_j`` (capped) goes there: the weighted smoothing's term."""
    tokens, vocab = h2.shape[0], weight.shape[0]
    device = h2.device
    need_h, need_w, need_b = grad_h is not None, grad_w is not None, grad_b is not None
    grads = need_h or need_w or need_b
    per_row = reduction == "none"
    loss_rows = loss if per_row else torch.empty(tokens, dtype=torch.float32, device=device)
    if lse is None:
        lse = torch.empty(tokens, dtype=torch.float32, device=device)
    scale = (mean_scale(t2, ignore_index) if reduction == "mean"
             else torch.ones(1, dtype=torch.float32, device=device))
    free = _free_bytes(device)
    itemsize = h2.element_size()
    accumulate = accumulates_by_chunks(tokens, vocab, itemsize, free)
    # Where a chunk of logits does not fit, the weight gradient comes from a second pass over
    # vocabulary slices (see ``fused_linear_cross_entropy``) when the inputs allow it.
    by_slices = (need_w and not accumulate and smoothing == 0.0 and tokens > 0
                 and h2.dtype != torch.float32 and _gemm_ready(h2) and _gemm_ready(weight))
    if need_w and tokens == 0:
        grad_w.zero_()
    if need_b:
        grad_b.zero_()
    budget_rows = chunk_rows(tokens, h2.shape[1], vocab, itemsize, free)
    align = 16 // itemsize
    row_stride = -(-vocab // align) * align if by_slices else vocab
    # With the slice pass the weight gradient is written only after the chunks: until then
    # its storage holds the chunks' logits, so chunks can be as large as it is.
    scratch_rows = grad_w.numel() // row_stride if by_slices else 0
    if chunk is None:
        chunk = scratch_rows if by_slices else _accumulating_chunk(budget_rows, accumulate)
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
        buffer = torch.empty((rows, row_stride), dtype=h2.dtype, device=device)
    w_t = weight.t()
    for start in range(0, tokens, chunk):
        end = min(start + chunk, tokens)
        h, logits = h2[start:end], buffer[: end - start, :vocab]
        if by_slices:
            gemm_with_config(h, w_t, logits, bias, logits_config)
        else:
            _logits(h, w_t, bias, logits)
        if smooth_sums is not None:
            smooth_sums[start:end] = smoothing_sums(logits, class_weight, softcap)
        cross_entropy_fwd(logits, t2[start:end], loss_rows[start:end], lse[start:end],
                          logits if grads else None, scale, ignore_index, smoothing, z, softcap)
        _chunk_gradients(logits, h, weight, start, grad_h, None if by_slices else grad_w, grad_b)
    if by_slices:
        del buffer, logits, h  # the chunk buffer's memory goes back before the slice pass
        _weight_grad_by_slices(h2, weight, bias, t2, lse, scale, ignore_index, z, softcap, grad_w,
                               budget_rows * vocab, logits_config)
    if not per_row:
        total = loss_rows.sum()  # rows already divided by the counted rows for "mean"
        loss.copy_((total * scale).reshape(()) if tokens == 0 else total)  # an empty mean is NaN


@kernel_op(
    "fused_linear_cross_entropy_bwd",
    mutates_args=("grad_h", "grad_w", "grad_b"),
    schema="(Tensor h2, Tensor weight, Tensor t2, Tensor? bias, Tensor lse, Tensor dloss, "
    "Tensor(b!)? grad_h, Tensor(c!)? grad_w, Tensor(d!)? grad_b, int ignore_index, float smoothing, "
    "float z, float softcap, int? chunk, Tensor? class_weight, Tensor? row_coef, "
    "Tensor? target_fix) -> ()",
)
def fused_linear_cross_entropy_bwd(h2, weight, t2, bias, lse, dloss, grad_h, grad_w, grad_b,
                                   ignore_index: int, smoothing: float, z: float, softcap: float,
                                   chunk: int | None, class_weight, row_coef,
                                   target_fix) -> None:
    """The gradients of per-row losses (reduction "none") for (tokens,) fp32 incoming
    gradients ``dloss``, from the forward's lse: each chunk's logits are computed again,
    turned into their gradient in place and fed to the gradients that are given (as the
    forward's chunk-by-chunk accumulation does). With ``class_weight``, the weighted
    smoothing's terms are added to each chunk's logits gradient (``add_smoothing_gradient``
    with ``row_coef`` and ``target_fix``; with a soft cap into a buffer of its own, since
    they need the logits)."""
    tokens, vocab = h2.shape[0], weight.shape[0]
    if grad_w is not None and tokens == 0:
        grad_w.zero_()
    if grad_b is not None:
        grad_b.zero_()
    if tokens == 0:
        return
    itemsize, free = h2.element_size(), _free_bytes(h2.device)
    if chunk is None:
        chunk = _accumulating_chunk(chunk_rows(tokens, h2.shape[1], vocab, itemsize, free),
                                    accumulates_by_chunks(tokens, vocab, itemsize, free))
    buffer = torch.empty((min(chunk, tokens), vocab), dtype=h2.dtype, device=h2.device)
    separate = class_weight is not None and softcap
    grad_buffer = torch.empty_like(buffer) if separate else buffer
    w_t = weight.t()
    for start in range(0, tokens, chunk):
        end = min(start + chunk, tokens)
        h, logits, grad = h2[start:end], buffer[: end - start], grad_buffer[: end - start]
        t = t2[start:end]
        _logits(h, w_t, bias, logits)
        cross_entropy_bwd(logits, t, lse[start:end], dloss[start:end], grad,
                          ignore_index, smoothing, z, softcap)
        if class_weight is not None:
            add_smoothing_gradient(grad, logits, t, (t != ignore_index).float(),
                                   target_fix[start:end], row_coef[start:end], class_weight,
                                   softcap)
        _chunk_gradients(grad, h, weight, start, grad_h, grad_w, grad_b)


def _accumulating_chunk(budget_rows: int, accumulate: bool) -> int:
    """Tokens per chunk when the weight gradient accumulates chunk by chunk."""
    return max(budget_rows, ACCUMULATE_ROWS) if accumulate else budget_rows


def _logits(h, w_t, bias, logits) -> None:
    """logits = h @ w_t (+ bias), with cuBLAS."""
    if bias is None:
        torch.mm(h, w_t, out=logits)
    else:
        torch.addmm(bias, h, w_t, out=logits)


def _chunk_gradients(grad_logits, h, weight, start, grad_h, grad_w, grad_b) -> None:
    """A chunk's share of the gradients that are given, from its logits' gradient: its rows
    of ``grad_h``; added to ``grad_w`` (written by the first chunk: no zero fill) and to the
    fp32 ``grad_b``."""
    if grad_h is not None:
        torch.mm(grad_logits, weight, out=grad_h[start: start + grad_logits.shape[0]])
    if grad_w is not None:
        if start == 0:
            torch.mm(grad_logits.t(), h, out=grad_w)
        else:
            grad_w.addmm_(grad_logits.t(), h)
    if grad_b is not None:
        grad_b += grad_logits.sum(0, dtype=torch.float32)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    # Takes (tokens, H) rows and (tokens,) targets (the caller reshapes): the gradients are
    # computed in the forward and scaled by the incoming gradient in the backward.
    @staticmethod
    def forward(ctx, h2, weight, t2, bias, ignore_index, smoothing, z, softcap, reduction, chunk):
        device = h2.device
        loss = torch.empty((), dtype=torch.float32, device=device)
        lse = torch.empty(h2.shape[0], dtype=torch.float32, device=device)
        grad_h = torch.empty_like(h2) if ctx.needs_input_grad[0] else None
        grad_w = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        grad_b = (torch.empty(weight.shape[0], dtype=torch.float32, device=device)
                  if bias is not None and ctx.needs_input_grad[3] else None)
        fused_linear_cross_entropy_fwd(h2, weight, t2, bias, loss, lse, grad_h, grad_w, grad_b,
                                       ignore_index, smoothing, z, softcap, reduction, chunk,
                                       None, None)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    def backward(ctx, dloss, _):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        scale = dloss.float().reshape(1)  # device-side: no traffic at all when it is 1
        if grad_h is not None and grad_h.numel():
            scale_rows(grad_h, scale)
        if grad_w is not None and grad_w.numel():
            scale_rows(grad_w, scale)
        if grad_b is not None:
            grad_b = (grad_b * dloss).to(ctx.bias_dtype)
        return grad_h, grad_w, None, grad_b, None, None, None, None, None, None


def _gradient_buffers(ctx, h2, weight, bias):
    """The backward's hidden, weight and (fp32) bias gradients, for the inputs that need one."""
    need_h, need_w, _, need_b = ctx.needs_input_grad[:4]
    grad_h = torch.empty_like(h2) if need_h else None
    grad_w = torch.empty_like(weight) if need_w else None
    grad_b = (torch.empty(weight.shape[0], dtype=torch.float32, device=h2.device)
              if bias is not None and need_b else None)
    return grad_h, grad_w, grad_b


class _FusedLinearCrossEntropyPerRow(torch.autograd.Function):
    # reduction "none": (tokens,) losses; the backward computes the gradients for its
    # per-row incoming gradient from the stored lse (the logits once more).
    @staticmethod
    def forward(ctx, h2, weight, t2, bias, ignore_index, smoothing, z, softcap, chunk):
        loss = torch.empty(h2.shape[0], dtype=torch.float32, device=h2.device)
        lse = torch.empty(h2.shape[0], dtype=torch.float32, device=h2.device)
        fused_linear_cross_entropy_fwd(h2, weight, t2, bias, loss, lse, None, None, None,
                                       ignore_index, smoothing, z, softcap, "none", chunk,
                                       None, None)
        ctx.save_for_backward(h2, weight, t2, bias, lse)
        ctx.ignore_index, ctx.smoothing, ctx.z, ctx.chunk = ignore_index, smoothing, z, chunk
        ctx.softcap = softcap
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    def backward(ctx, dloss, _):
        h2, weight, t2, bias, lse = ctx.saved_tensors
        grad_h, grad_w, grad_b = _gradient_buffers(ctx, h2, weight, bias)
        fused_linear_cross_entropy_bwd(h2, weight, t2, bias, lse, dloss.float().contiguous(),
                                       grad_h, grad_w, grad_b, ctx.ignore_index, ctx.smoothing,
                                       ctx.z, ctx.softcap, ctx.chunk, None, None, None)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, None, grad_b, None, None, None, None, None


class _FusedLinearCrossEntropyWeightedSmoothing(torch.autograd.Function):
    # Class weights with label smoothing (torch's weighted smoothing): (tokens,) weighted
    # per-row losses from the kernels' unsmoothed rows, their lse and each row's
    # sum_j w_j logit_j (``smooth_sums``, taken from each chunk's logits); the backward
    # computes the logits again and adds the smoothing's terms to each chunk's gradient.
    @staticmethod
    def forward(ctx, h2, weight, t2, bias, class_weight, ignore_index, smoothing, z, softcap, chunk):
        tokens, device = h2.shape[0], h2.device
        rows, lse, sums = (torch.empty(tokens, dtype=torch.float32, device=device) for _ in range(3))
        w = class_weight.detach().float()
        fused_linear_cross_entropy_fwd(h2, weight, t2, bias, rows, lse, None, None, None,
                                       ignore_index, 0.0, z, softcap, "none", chunk, sums, w)
        counted = (t2 != ignore_index).float()
        row_weight = row_weights(t2, w, ignore_index)
        ctx.save_for_backward(h2, weight, t2, bias, lse, row_weight, counted, w)
        ctx.args = (ignore_index, smoothing, z, softcap, chunk)
        ctx.mark_non_differentiable(lse)
        return weighted_smoothing_loss(rows, lse, sums, row_weight, counted, w, z, smoothing), lse

    @staticmethod
    def backward(ctx, dloss, _):
        h2, weight, t2, bias, lse, row_weight, counted, w = ctx.saved_tensors
        ignore_index, smoothing, z, softcap, chunk = ctx.args
        grad_h, grad_w, grad_b = _gradient_buffers(ctx, h2, weight, bias)
        rows, target_fix, row_coef = weighted_smoothing_grads(dloss.float(), lse, row_weight,
                                                              counted, w, z, smoothing)
        fused_linear_cross_entropy_bwd(h2, weight, t2, bias, lse, rows, grad_h, grad_w, grad_b,
                                       ignore_index, 0.0, 0.0, softcap, chunk, w, row_coef,
                                       target_fix)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, None, grad_b, None, None, None, None, None, None


def _reduce_weighted(weighted, t2, ce_weight, ignore_index: int, reduction: str) -> torch.Tensor:
    """Per-token losses already weighted, reduced as torch's weighted cross-entropy: "mean"
    divides by the counted tokens' summed weights."""
    if reduction == "none":
        return weighted
    if reduction == "sum":
        return weighted.sum()
    return weighted.sum() / row_weights(t2, ce_weight, ignore_index).sum()


def _weighted(rows, t2, ce_weight, ignore_index: int, reduction: str) -> torch.Tensor:
    """Per-token losses times their class weight (0 for ignored tokens), reduced."""
    return _reduce_weighted(rows * row_weights(t2, ce_weight, ignore_index), t2, ce_weight,
                            ignore_index, reduction)


def fused_linear_cross_entropy(hidden, weight, target, bias=None, ignore_index: int = -100,
                               label_smoothing: float = 0.0, reduction: str = "mean",
                               chunk_size: int | None = None, lse_square_scale: float = 0.0,
                               ce_weight: torch.Tensor | None = None, softcap: float | None = None,
                               return_z_loss: bool = False):
    """``cross_entropy(hidden @ weight.T + bias, target)`` without materializing the logits.

    Tokens are processed in chunks: the chunk's logits come from one GEMM, the cross-entropy
    kernel turns them into their gradient in place, and that gradient feeds the hidden (and
    bias) gradients right away, so at most one chunk of logits exists at a time. Where a chunk
    of ``ACCUMULATE_ROWS`` (1024) tokens' logits takes at most a quarter of the free device
    memory, the weight gradient accumulates chunk by chunk as well (fp32 sums, rounded to the
    weight's dtype once per chunk): three GEMMs per chunk. Otherwise it comes from a second
    pass over vocabulary slices: each slice's logits are recomputed, turned into their gradient
    from the stored lse, and multiplied by the hidden states straight into that slice of the
    weight gradient. One GEMM more, but the weight gradient's own storage, not yet written,
    holds the chunks' logits and then the slices' (above the slice being written), so the
    memory beyond the two gradients is a small buffer for the last slices. With reduction
    "mean" or "sum" the gradients are computed during the forward and scaled by the incoming
    gradient in the backward; with "none" the backward computes them for its per-token
    incoming gradient (the logits' GEMM once more, the weight gradient chunk by chunk).

    Args:
        hidden: (..., H) CUDA tensor, float32 / float16 / bfloat16.
        weight: (V, H), hidden's dtype.  bias: optional (V,).
        target: (...) int64 / int32 class indices.
        reduction: "mean", "sum" or "none" ((...) fp32 losses per token, 0 for ignored
            ones; the gradients then come from the backward, which computes each chunk's
            logits once more for its per-token incoming gradient).
        lse_square_scale: z-loss, adds ``lse_square_scale * lse^2`` per counted row (as
            :func:`cross_entropy`; Liger's argument of that name).
        ce_weight: optional (V,) per-class weights, as ``F.cross_entropy``'s ``weight``: each
            token's loss (its z-loss term included) times ``ce_weight[target]``, "mean" divided
            by the counted tokens' summed weights (NaN when 0). The gradients then come from
            the backward, as with reduction "none". With label smoothing, torch's weighted
            smoothing (each chunk's logits read once more in the forward for the rows'
            weighted sums, the gradient's smoothing terms added per chunk: a second chunk
            buffer with a soft cap); no gradient.
        softcap: optional cap of the logits, ``softcap * tanh(logits / softcap)`` before the
            loss (Gemma 2's final logit soft-capping), inside the cross-entropy kernels (as
            :func:`cross_entropy`'s ``softcap``).
        return_z_loss: also return the z-loss part of the loss, ``(loss, z_loss)`` (as
            :func:`cross_entropy`'s; without gradient, for logging).
        chunk_size: tokens per chunk (default: at least ``ACCUMULATE_ROWS`` when accumulating,
            as many as the weight gradient's storage holds with the slice pass, else
            :func:`chunk_rows`; a larger one gets its own buffer).

    Constraints:
      - with too little free memory for a chunk of 1024 tokens' logits, the slice pass runs for
        16-bit inputs without label smoothing whose hidden / weight rows are 16-byte aligned;
        other inputs then accumulate in chunks of :func:`chunk_rows` tokens
      - reduction "none" and ``ce_weight`` run one GEMM more per chunk (in the backward);
        ``ce_weight`` with label smoothing also reads each chunk's logits once more in the
        forward and its gradient twice more in the backward (with a cap, in a second buffer)
      - V up to 524288 (262144 for fp32 with a soft cap); label smoothing as in :func:`cross_entropy`
    """
    check_arguments(hidden, target, ignore_index, label_smoothing, reduction, lse_square_scale,
                    what="hidden")
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
    if ce_weight is not None:
        check_tensor("ce_weight", ce_weight, FLOAT_DTYPES, hidden)
        if tuple(ce_weight.shape) != (weight.shape[0],):
            raise UnsupportedError(f"ce_weight must have shape ({weight.shape[0]},) (one value per "
                                   f"class), got {tuple(ce_weight.shape)}")
    cap = check_softcap(softcap)
    check_row_length(weight.shape[0], hidden.dtype, cap)
    t2 = target.reshape(-1)
    if ce_weight is not None and float(label_smoothing) > 0:
        rows, lse = _FusedLinearCrossEntropyWeightedSmoothing.apply(
            as_rows(hidden), weight, t2, bias, ce_weight, ignore_index, float(label_smoothing),
            float(lse_square_scale), cap, chunk_size)
        loss = _reduce_weighted(rows, t2, ce_weight, ignore_index, reduction).reshape(
            target.shape if reduction == "none" else ())
    elif reduction == "none" or ce_weight is not None:
        rows, lse = _FusedLinearCrossEntropyPerRow.apply(
            as_rows(hidden), weight, t2, bias, ignore_index, float(label_smoothing),
            float(lse_square_scale), cap, chunk_size)
        if ce_weight is None:
            loss = rows.reshape(target.shape)
        else:
            loss = _weighted(rows, t2, ce_weight, ignore_index, reduction).reshape(
                target.shape if reduction == "none" else ())
    else:
        loss, lse = _FusedLinearCrossEntropy.apply(as_rows(hidden), weight, t2, bias,
                                                   ignore_index, float(label_smoothing),
                                                   float(lse_square_scale), cap, reduction,
                                                   chunk_size)
    if not return_z_loss:
        return loss
    return loss, z_loss_part(lse, target, ignore_index, reduction, float(lse_square_scale),
                             None if ce_weight is None else ce_weight.detach())


class FusedLinearCrossEntropyLoss(torch.nn.Module):
    """Loss of ``hidden @ weight.T (+ bias)`` against ``target`` without materializing the
    logits (:func:`fused_linear_cross_entropy`). ``forward(hidden, weight, target, bias=None)``.

    Like every module of the library it follows its input's device: off CUDA it computes
    ``F.cross_entropy(F.linear(hidden, weight, bias), target)`` (with the soft cap and the
    z-loss) with torch."""

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0,
                 reduction: str = "mean", chunk_size: int | None = None,
                 lse_square_scale: float = 0.0, ce_weight: torch.Tensor | None = None,
                 softcap: float | None = None, return_z_loss: bool = False):
        super().__init__()
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing
        self.reduction, self.chunk_size = reduction, chunk_size
        self.lse_square_scale, self.softcap = lse_square_scale, softcap
        self.return_z_loss = return_z_loss
        self.register_buffer("ce_weight", ce_weight)

    def forward(self, hidden, weight, target, bias=None):
        if not hidden.is_cuda:
            logits = torch.nn.functional.linear(hidden, weight, bias)
            return torch_cross_entropy(logits, target,
                                       self.ignore_index, self.label_smoothing, self.reduction,
                                       self.lse_square_scale, self.ce_weight, self.softcap,
                                       self.return_z_loss)
        return fused_linear_cross_entropy(hidden, weight, target, bias, self.ignore_index,
                                          self.label_smoothing, self.reduction, self.chunk_size,
                                          self.lse_square_scale, self.ce_weight, self.softcap,
                                          self.return_z_loss)
