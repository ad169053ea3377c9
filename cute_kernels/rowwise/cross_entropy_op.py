"""``cross_entropy``: torch-facing ops and autograd."""

from __future__ import annotations

import dataclasses

import torch

from ..runtime import ScalarSpec, StreamSpec, Sym, TensorSpec, UnsupportedError, get_kernel, kernel_op
from ..runtime.errors import check_tensor
from .config import row_config
from .cross_entropy_terms import (add_smoothing_gradient, row_weights, smoothing_sums,
                                  weighted_smoothing_grads, weighted_smoothing_loss, z_loss_part)
from .dispatch import RowKernels, row_specs, vector_width, widest_itemsize

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TARGET_DTYPES = (torch.int64, torch.int32)
REDUCTIONS = ("mean", "sum", "none")

_ROW_STAT = TensorSpec("float32", (Sym("m"),), (1,), 4)
_ROW_SCALE = TensorSpec("float32", (Sym("m"),), (Sym(),), 4)  # may be a broadcast scalar
_SCALE = TensorSpec("float32", (1,), (1,), 4)


def _target_spec(dtype):
    name = str(dtype).removeprefix("torch.")
    return TensorSpec(name, (Sym("m"),), (1,), 8 if dtype == torch.int64 else 4)


def _held(x_t, grad_t, softcap: bool) -> int:
    """The launch shape's row-sized fragments a forward thread keeps in registers: one, but
    for 32-bit rows with a soft cap and the gradient two (at 128 values a thread their capped
    kernel spills 8-28 bytes at 255 registers: 64 values a thread instead)."""
    return 2 if softcap and grad_t is not None and widest_itemsize((x_t, grad_t)) >= 4 else 1


def _forward_ctas_per_sm(rows, x_t, grad_t, smoothing: bool, z_loss: bool, softcap: bool) -> int:
    """Two CTAs per SM (registers capped at 128) for capped 16-bit rows of 256-thread CTAs
    without label smoothing or z-loss: the kernel then holds one row-sized fragment, as the
    plain one does at 127 registers, and one CTA's loads run under the other's exponentials.
    With smoothing or z-loss (4-12 bytes of spills at several vocabularies) and 32-bit rows
    (the loss-only kernels hold 128 values a thread) one CTA per SM."""
    return 2 if (softcap and not smoothing and not z_loss and rows.num_threads == 256
                 and widest_itemsize((x_t, grad_t)) == 2) else 0


def _build_forward(key, vec):
    from .cross_entropy import CrossEntropyConfig, CrossEntropyFwdSm90  # imported at the first compile

    x_t, target_t, grad_t, smoothing, z_loss, scaled, softcap, n = key
    rows = row_config(n, vec, widest_itemsize((x_t, grad_t)), tensors_held=_held(x_t, grad_t, softcap))
    # Direct loads, so the target's dependent scalar loads overlap the row's.
    rows = dataclasses.replace(rows, stage_smem=False)
    config = CrossEntropyConfig(rows, smoothing, z_loss, grad_t is not None, scaled, softcap,
                                ctas_per_sm=_forward_ctas_per_sm(rows, x_t, grad_t, smoothing, z_loss, softcap))
    x = row_specs((x_t,), n, vec)
    grad = None if grad_t is None else row_specs((grad_t,), n, vec)[0]
    specs = (x[0], _target_spec(target_t), _ROW_STAT, _ROW_STAT, grad,
             _SCALE if scaled else None, ScalarSpec("int64"), ScalarSpec("float32"),
             ScalarSpec("float32"), ScalarSpec("float32"), x[-1])
    return CrossEntropyFwdSm90, config, specs


def _build_backward(key, vec):
    from .cross_entropy import CrossEntropyBwdSm90, CrossEntropyConfig

    x_t, target_t, grad_t, smoothing, z_loss, softcap, n = key
    rows = row_config(n, vec, widest_itemsize((x_t, grad_t)), tensors_held=1)
    config = CrossEntropyConfig(rows, smoothing, z_loss, softcap=softcap)
    x, grad = row_specs((x_t, grad_t), n, vec)[:2]
    specs = (x, _target_spec(target_t), _ROW_STAT, _ROW_SCALE, grad, ScalarSpec("int64"),
             ScalarSpec("float32"), ScalarSpec("float32"), ScalarSpec("float32"),
             row_specs((), n, vec)[-1])
    return CrossEntropyBwdSm90, config, specs


def _build_scale(key, vec):
    from .cross_entropy import ScaleRowsSm90

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
        from .cross_entropy import InverseCountSm90

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
    "Tensor? grad_scale, int ignore_index, float label_smoothing, float lse_square_scale, "
    "float softcap) -> ()",
)
def cross_entropy_fwd(logits, target, loss, lse, grad, grad_scale, ignore_index: int,
                      label_smoothing: float, lse_square_scale: float, softcap: float) -> None:
    """Per-row loss and lse of (M, V) logits (capped to softcap * tanh(x / softcap) unless
    softcap is 0); with ``grad``, also dloss/dlogits (``grad`` may be ``logits`` itself).
    With ``grad_scale``, the loss and gradient rows are times grad_scale[0]. M >= 1."""
    key = (logits.dtype, target.dtype, None if grad is None else grad.dtype, label_smoothing > 0,
           lse_square_scale > 0, grad_scale is not None, softcap > 0, logits.shape[1])
    tensors = (logits,) if grad is None or grad is logits else (logits, grad)
    _forward_kernels(key, tensors, logits, target, loss, lse, grad, grad_scale, ignore_index,
                     label_smoothing, lse_square_scale, softcap or 1.0)


@kernel_op(
    "cross_entropy_bwd",
    mutates_args=("grad",),
    schema="(Tensor logits, Tensor target, Tensor lse, Tensor dloss, Tensor(a!) grad, "
    "int ignore_index, float label_smoothing, float lse_square_scale, float softcap) -> ()",
)
def cross_entropy_bwd(logits, target, lse, dloss, grad, ignore_index: int, label_smoothing: float,
                      lse_square_scale: float, softcap: float) -> None:
    """grad[M, V] = dloss[row] * dloss_row/dlogits, from the logits and the stored lse (with
    the forward's soft cap: 0 for none)."""
    key = (logits.dtype, target.dtype, grad.dtype, label_smoothing > 0, lse_square_scale > 0,
           softcap > 0, logits.shape[1])
    _backward_kernels(key, (logits, grad), logits, target, lse, dloss, grad, ignore_index,
                      label_smoothing, lse_square_scale, softcap or 1.0)


# ----------------------------------------------------------------------------- validation


def check_arguments(logits, target, ignore_index, label_smoothing, reduction, lse_square_scale, what="logits"):
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


def check_softcap(softcap) -> float:
    """The soft cap as a float (0.0 for None); refuses anything but None or a positive number."""
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not softcap > 0):
        raise UnsupportedError(f"softcap must be None or a positive number, got {softcap!r}")
    return float(softcap or 0.0)


def check_row_length(vocab: int, dtype: torch.dtype, softcap: float) -> None:
    """Refuses, before anything runs, rows longer than the kernels take (524288 classes;
    262144 for 32-bit logits with a soft cap)."""
    held = _held(dtype, dtype, softcap > 0)
    try:
        row_config(vocab, 1, 4, tensors_held=held)
    except UnsupportedError as exc:
        why = f" with {dtype} logits and a soft cap" if held > 1 else ""
        raise UnsupportedError(f"{vocab} classes{why}: {exc}") from None


def as_rows(t: torch.Tensor) -> torch.Tensor:
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1])


def mean_scale(t2: torch.Tensor, ignore_index: int) -> torch.Tensor:
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
    def forward(ctx, logits, target, ignore_index, smoothing, reduction, z, cap, inplace):
        x2, t2 = as_rows(logits), target.reshape(-1)
        m = x2.shape[0]
        loss_rows = torch.empty(m, dtype=torch.float32, device=logits.device)
        lse = torch.empty(m, dtype=torch.float32, device=logits.device)
        fused = reduction != "none" and any(ctx.needs_input_grad)
        grad = (x2 if inplace else torch.empty_like(x2)) if fused else None
        scale = mean_scale(t2, ignore_index) if reduction == "mean" else None
        if m:
            cross_entropy_fwd(x2, t2, loss_rows, lse, grad, scale, ignore_index, smoothing, z, cap)
        ctx.args = (ignore_index, smoothing, reduction, z, cap, fused, logits.shape)
        if fused:
            ctx.save_for_backward(grad)
        else:
            ctx.save_for_backward(x2, t2, lse)
        ctx.mark_non_differentiable(lse)
        if reduction == "none":
            return loss_rows.view(target.shape), lse
        if m == 0 and scale is not None:
            # 0 * inf = NaN: the mean of nothing, as torch
            return (loss_rows.sum() * scale).reshape(()), lse
        return loss_rows.sum(), lse

    @staticmethod
    def backward(ctx, dloss, _):
        ignore_index, smoothing, reduction, z, cap, fused, shape = ctx.args
        if fused:
            (grad,) = ctx.saved_tensors
            if grad.shape[0]:
                scale_rows(grad, dloss.float().reshape(1))
            return grad.view(shape), None, None, None, None, None, None, None
        x2, t2, lse = ctx.saved_tensors
        m = x2.shape[0]
        drows = dloss.float().reshape(m)
        grad = torch.empty_like(x2)
        if m:
            cross_entropy_bwd(x2, t2, lse, drows, grad, ignore_index, smoothing, z, cap)
        return grad.view(shape), None, None, None, None, None, None, None


class _WeightedCrossEntropy(torch.autograd.Function):
    """Per-class weights: the kernels' per-row losses (without smoothing) times
    ``weight[target]`` (0 for ignored rows), reduced in torch (M values); the backward runs
    the gradient kernel with each row's weight (and the mean's divisor) folded into its
    per-row incoming gradient.

    Label smoothing with weights is torch's: row i adds ``eps / V * sum_j w_j (lse_i - x_ij)``
    (``smoothing_sums`` reads the logits once more for ``sum_j w_j x_ij``), and its gradient
    ``eps / V * (W p_ij - w_j)`` (W = sum_j w_j) goes in as the row's scale (the p part), a
    rank-one term and a fix at the target column (``add_smoothing_gradient``: two more
    passes over the gradient)."""

    @staticmethod
    def forward(ctx, logits, target, weight, ignore_index, reduction, z, cap, smoothing):
        x2, t2 = as_rows(logits), target.reshape(-1)
        m = x2.shape[0]
        loss_rows = torch.empty(m, dtype=torch.float32, device=logits.device)
        lse = torch.empty(m, dtype=torch.float32, device=logits.device)
        if m:
            cross_entropy_fwd(x2, t2, loss_rows, lse, None, None, ignore_index, 0.0, z, cap)
        counted = (t2 != ignore_index).float()
        row_weight = row_weights(t2, weight, ignore_index)
        weighted = loss_rows * row_weight
        if smoothing:
            w = weight.detach().float()
            weighted = weighted_smoothing_loss(loss_rows, lse, smoothing_sums(x2, w, cap),
                                               row_weight, counted, w, z, smoothing)
        total = row_weight.sum()
        ctx.save_for_backward(x2, t2, lse, row_weight, total, counted, weight)
        ctx.args = (ignore_index, reduction, z, cap, smoothing, logits.shape)
        ctx.mark_non_differentiable(lse)
        if reduction == "none":
            return weighted.view(target.shape), lse
        return (weighted.sum() / total if reduction == "mean" else weighted.sum()), lse

    @staticmethod
    def backward(ctx, dloss, _):
        x2, t2, lse, row_weight, total, counted, weight = ctx.saved_tensors
        ignore_index, reduction, z, cap, smoothing, shape = ctx.args
        m = x2.shape[0]
        drows = dloss.float().reshape(-1).expand(m)
        if reduction == "mean":
            drows = drows / total
        grad = torch.empty_like(x2)
        if not smoothing:
            if m:
                cross_entropy_bwd(x2, t2, lse, (drows * row_weight).contiguous(), grad,
                                  ignore_index, 0.0, z, cap)
            return grad.view(shape), None, None, None, None, None, None, None
        w = weight.detach().float()
        rows, target_fix, row_coef = weighted_smoothing_grads(drows, lse, row_weight, counted, w,
                                                              z, smoothing)
        if m:
            cross_entropy_bwd(x2, t2, lse, rows, grad, ignore_index, 0.0, 0.0, cap)
            add_smoothing_gradient(grad, x2, t2, counted, target_fix, row_coef, w, cap)
        return grad.view(shape), None, None, None, None, None, None, None


def cross_entropy(logits, target, ignore_index: int = -100, label_smoothing: float = 0.0,
                  reduction: str = "mean", lse_square_scale: float = 0.0,
                  inplace_backward: bool = False, weight=None, softcap: float | None = None,
                  return_z_loss: bool = False):
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
        weight: optional (V,) per-class weights, as ``F.cross_entropy``'s: each row's loss is
            times ``weight[target]`` and "mean" divides by the sum of the counted rows'
            weights (NaN when it is 0, as torch). The z-loss term of a row is weighted with
            it. With label smoothing, torch's weighted smoothing (each class's term times its
            weight; another pass over the logits in the forward, two over the gradient in the
            backward). Not with ``inplace_backward``; ``weight`` gets no gradient.
        softcap: > 0 caps the logits to ``softcap * tanh(logits / softcap)`` (Gemma 2's
            final-logit soft cap) inside the kernels: the loss is that of the capped logits,
            the gradient is through the cap. None: no cap.
        return_z_loss: also return the z-loss part of the loss (``lse_square_scale * lse^2``
            per counted row, reduced as the loss; without gradient, for logging):
            ``(loss, z_loss)`` (Liger's option of that name).

    With a gradient needed and reduction "mean" or "sum", the gradient is computed in the
    forward (the logits are read once) and kept until the backward, which scales it by the
    incoming gradient (no memory traffic when that is 1).

    Constraints:
      - V up to 524288
      - a target outside [0, V) that is not ``ignore_index`` gives a NaN loss for its row (no
        device assert, never an out-of-bounds read)
      - with ``weight`` the backward reads the logits again (the gradient is not written in
        the forward)
      - with ``softcap``, a logit of -inf stays -inf in the row's sum of exponentials (torch's
        capped value is -softcap, adding exp(-softcap) to the sum)
    """
    check_arguments(logits, target, ignore_index, label_smoothing, reduction, lse_square_scale)
    cap = check_softcap(softcap)
    if logits.dim() == 0 or tuple(target.shape) != tuple(logits.shape[:-1]):
        raise UnsupportedError(
            f"target must have logits' shape without the class dim: logits {tuple(logits.shape)}, "
            f"target {tuple(target.shape)}"
        )
    if inplace_backward and reduction == "none":
        raise UnsupportedError("inplace_backward needs reduction='mean' or 'sum'")
    if logits.shape[-1] == 0:
        raise UnsupportedError("logits must have at least one class")
    check_row_length(logits.shape[-1], logits.dtype, cap)
    if weight is not None:
        check_tensor("weight", weight, FLOAT_DTYPES, logits)
        if tuple(weight.shape) != (logits.shape[-1],):
            raise UnsupportedError(f"weight must have shape ({logits.shape[-1]},) (one value per "
                                   f"class), got {tuple(weight.shape)}")
        if inplace_backward:
            raise UnsupportedError("weight with inplace_backward=True is not supported")
        loss, lse = _WeightedCrossEntropy.apply(logits, target, weight, ignore_index, reduction,
                                                float(lse_square_scale), cap,
                                                float(label_smoothing))
    else:
        needs_grad = logits.requires_grad and torch.is_grad_enabled()
        inplace = bool(inplace_backward and needs_grad and not torch.compiler.is_compiling())
        loss, lse = _CrossEntropy.apply(logits, target, ignore_index, float(label_smoothing),
                                        reduction, float(lse_square_scale), cap, inplace)
    if not return_z_loss:
        return loss
    return loss, z_loss_part(lse, target, ignore_index, reduction, float(lse_square_scale), weight)


# ----------------------------------------------------------------------------- configurations

SAMPLE_VOCABS = (1, 7, 1000, 4096, 32000, 32768, 128256, 131072, 262144)


def compile_configurations(quick: bool = False):
    """(kernel class, config, specs) for the cross-entropy kernels: forward with and without
    the gradient, backward; with none or all of label smoothing, z-loss and the soft cap;
    bf16 / fp16 / fp32."""
    found = {}
    vocabs = (7, 32768, 128256) if quick else SAMPLE_VOCABS
    dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16, torch.float32)
    for x_t in dtypes:
        for n in vocabs:
            vec = vector_width(n, widest_itemsize((x_t,)), 0)
            found[("scale", x_t, n)] = _build_scale((x_t, n), vec)
            for smoothing, z, cap in ((False, False, False), (True, True, True)):
                for grad_t, scaled in ((None, False), (None, True), (x_t, False), (x_t, True)):
                    key = (x_t, torch.int64, grad_t, smoothing, z, scaled, cap, n)
                    found[("fwd",) + key] = _build_forward(key, vec)
                key = (x_t, torch.int64, x_t, smoothing, z, cap, n)
                found[("bwd",) + key] = _build_backward(key, vec)
    from .cross_entropy import InverseCountSm90

    for t in (torch.int64, torch.int32):
        found[("count", t)] = (InverseCountSm90, None, (_target_spec(t), _SCALE, ScalarSpec("int64"), StreamSpec()))
    return list(found.values())


def self_checks():
    """Rows of the ``python -m cute_kernels`` table for cross-entropy."""
    from ..reference import cross_entropy_ref
    from ..runtime.selfcheck import SelfCheck

    checks = []
    for m, v in ((4096, 32768), (512, 128256)):
        x = torch.randn(m, v, device="cuda", dtype=torch.bfloat16)
        t = torch.randint(0, v, (m,), device="cuda")
        ref = cross_entropy_ref(x, t, reduction="none")
        checks.append(SelfCheck(
            "cross_entropy", f"{m}x{v}", "bfloat16",
            lambda x=x, t=t: cross_entropy(x, t, reduction="none"),
            lambda x=x, t=t: torch.nn.functional.cross_entropy(x, t, reduction="none"), ref, 1e-3))
    return checks
