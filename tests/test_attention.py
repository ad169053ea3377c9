"""flash_attn / flash_attn_varlen against float64 references (cute_kernels.reference.attention).

Rule (FlashAttention's): our max error against float64 is at most twice the error of the same
attention computed by torch in the input precision, plus 1e-3.
"""

import math

import pytest
import torch

import cute_kernels as ck
from cute_kernels.attention.config import HEAD_DIMS
from cute_kernels.attention.op import flash_attn_fwd
from cute_kernels.reference.attention import attention_mask, attention_ref, attention_varlen_ref

gpu = pytest.mark.gpu


def lowp_ref(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0):
    """The same attention in torch at q's precision (scores and P rounded to it)."""
    dim = q.shape[-1]
    scale = 1.0 / math.sqrt(dim) if softmax_scale is None else softmax_scale
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k).float() * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    allowed = attention_mask(q.shape[1], k.shape[1], causal, window_size, q.device)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(q.dtype)
    return torch.einsum("bhij,bjhd->bihd", probs, v)


def assert_attention_close(out, ref, lowp):
    assert out.dtype == lowp.dtype and out.shape == ref.shape
    ours = (out.double() - ref).abs().max().item() if out.numel() else 0.0
    torch_err = (lowp.double() - ref).abs().max().item() if out.numel() else 0.0
    assert ours <= 2 * torch_err + 1e-3, f"error {ours:.3e} vs torch's {torch_err:.3e} in {out.dtype}"


def assert_lse_close(lse, ref):
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(lse), finite), "rows without keys must have LSE -inf"
    assert (lse[~finite] == float("-inf")).all()
    if finite.any():
        assert (lse[finite].double() - ref[finite]).abs().max().item() < 1e-3


def qkv(batch, sq, sk, hq, hkv, dim, dtype=torch.bfloat16, scale=1.0, shift=0.0):
    q = torch.randn(batch, sq, hq, dim, device="cuda", dtype=dtype) * scale + shift
    k = torch.randn(batch, sk, hkv, dim, device="cuda", dtype=dtype) * scale + shift
    v = torch.randn(batch, sk, hkv, dim, device="cuda", dtype=dtype)
    return q, k, v


def varlen_qkv(lens_q, lens_k, hq, hkv, dim):
    """cu_seqlens_q, cu_seqlens_k (int32) and packed q, k, v for sequences of these lengths."""
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).int()
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).int()
    q = torch.randn(sum(lens_q), hq, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lens_k), hkv, dim, device="cuda", dtype=torch.bfloat16)
    return cu_q, cu_k, q, k, torch.randn_like(k)


def check(q, k, v, **kw):
    out, lse = ck.flash_attn(q, k, v, return_lse=True, **kw)
    ref, ref_lse = attention_ref(q, k, v, **kw)
    assert_attention_close(out, ref, lowp_ref(q, k, v, **kw))
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert_lse_close(lse, ref_lse)


LENGTHS = [(1, 1), (17, 17), (128, 128), (1000, 1000), (113, 203), (203, 113)]


@pytest.mark.parametrize("columns", [80, 112, 128, 176])
def test_mask_element_counts_match_the_accumulator_columns(columns):
    # The forward's masks count a thread's accumulator columns below a limit in closed form
    # (thread 0 holds columns 0, 1, 8, 9, ...): checked against counting, limits past both ends.
    from cute_kernels.attention.mask import _elements_before

    held = [8 * (c // 2) + c % 2 for c in range(columns // 4)]
    for limit in range(-40, columns + 40):
        assert _elements_before(limit, columns) == sum(c < limit for c in held), limit


def test_windows_wider_than_every_key_reach_the_kernel_as_unbounded():
    # The kernels compute window edges in 32 bits: a side past every key is passed as Sq + Sk.
    from cute_kernels.attention.op import _window

    assert _window(False, (2**31 - 1, 2**40), 300) == (True, 300, 300)
    assert _window(True, (-1, -1), 300) == (True, 300, 0)
    assert _window(False, (5, -1), 300) == (True, 5, 300)
    assert _window(False, (-1, -1), 300) == (False, 300, 300)


def test_backward_splits_a_group_only_where_the_kernel_adds_its_gradients():
    from cute_kernels.attention.config import (BWD_RUN_HEADS, BWD_SPLIT_ABOVE,
                                               attention_bwd_config, bwd_kv_splits)

    masked = attention_bwd_config(128, local=True, softcap=False, varlen=True)
    assert bwd_kv_splits(masked, BWD_SPLIT_ABOVE, True) == 1
    assert bwd_kv_splits(masked, 8, False) == 1  # a narrow sliding window: even walks
    for group in range(BWD_SPLIT_ABOVE + 1, 65):
        splits = bwd_kv_splits(masked, group, True)
        per_run = -(-group // splits)
        assert splits > 1 and per_run <= BWD_RUN_HEADS
        assert (splits - 1) * per_run < group  # every run holds a query head
    deterministic = attention_bwd_config(96, local=True, softcap=True, varlen=False,
                                         deterministic=True)
    assert bwd_kv_splits(deterministic, 8, True) == 4  # its runs add in order
    unmasked = attention_bwd_config(128, local=False, softcap=False, varlen=False)
    hdim64 = attention_bwd_config(64, local=True, softcap=False, varlen=False)
    wide = attention_bwd_config(256, local=True, softcap=False, varlen=False)
    assert [bwd_kv_splits(c, 8, True) for c in (unmasked, hdim64, wide)] == [1] * 3


@gpu
def test_masked_key_tails_and_diagonals_at_every_offset():
    # Key tails and diagonals crossing every position of a 128-key block (both 32-bit halves of
    # a thread's mask), causal and with a window, Sq < Sk and Sq > Sk.
    torch.manual_seed(0)
    for sq, sk in ((130, 161), (161, 130), (257, 190), (64, 319)):
        q = torch.randn(1, sq, 2, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, sk, 2, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, sk, 2, 128, device="cuda", dtype=torch.bfloat16)
        for kw in ({"causal": False}, {"causal": True}, {"window_size": (37, 5)}):
            check(q, k, v, **kw)


@gpu
@pytest.mark.parametrize("dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", LENGTHS)
def test_matches_float64(dim, causal, sq, sk):
    check(*qkv(2, sq, sk, 4, 2, dim), causal=causal)


@gpu
def test_repeated_eager_calls_take_a_launch_plan_and_stay_correct():
    # Later calls with the same shapes, strides and options skip the checks and the custom
    # op's dispatch; new data, both return forms, masks and softcap must still match float64,
    # a misaligned pointer (same strides) takes the general path, and gradients still flow.
    from cute_kernels.attention import op

    op._plans.clear()
    options = ({}, {"causal": True}, {"window_size": (32, 16)}, {"softcap": 5.0})
    for kw in options:
        for _ in range(3):
            q, k, v = qkv(2, 200, 300, 4, 2, 128)
            check(q, k, v, **kw)
            out = ck.flash_attn(q, k, v, **kw)
            assert_attention_close(out, attention_ref(q, k, v, **kw)[0], lowp_ref(q, k, v, **kw))
    assert sum(plan is not None for plan in op._plans.values()) == 2 * len(options)
    base = torch.randn(2 * 200 * 4 * 128 + 8, device="cuda", dtype=torch.bfloat16)
    misaligned = base[1:1 + 2 * 200 * 4 * 128].view(2, 200, 4, 128)
    assert misaligned.stride() == q.stride() and misaligned.data_ptr() % 16
    check(misaligned, k, v)
    leaf = q.detach().requires_grad_()
    ck.flash_attn(leaf, k, v).float().sum().backward()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()


@gpu
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_long_sequences(dim, causal):
    check(*qkv(1, 4096, 4096, 2, 1, dim), causal=causal)


def test_wide_key_tiles_only_where_rows_see_many_keys():
    from cute_kernels.attention.config import WIDE_TILE_MIN_KEYS, attention_fwd_config

    def tile(**kw):
        cfg = attention_fwd_config(128, softcap=False, max_seqlen_k=16384, **kw)
        return cfg.tile_n, cfg.stages

    assert tile(local=False, varlen=False) == (176, 2)
    assert tile(local=True, varlen=False, window_keys=16384) == (176, 2)  # causal
    assert tile(local=True, varlen=False, window_keys=WIDE_TILE_MIN_KEYS) == (176, 2)
    assert tile(local=True, varlen=False, window_keys=WIDE_TILE_MIN_KEYS - 1) == (128, 3)
    assert tile(local=True, varlen=True, window_keys=16384) == (128, 3)


@gpu
@pytest.mark.parametrize("sq,sk,kw", [(8200, 8200, {"causal": True}), (8250, 8400, {"causal": True}),
                                      (8400, 8250, {"window_size": (1000, 0)}),
                                      (8200, 8200, {"window_size": (2500, 2500), "softcap": 30.0})])
def test_masked_rows_past_the_paired_range(sq, sk, kw):
    # head dim 128 with a mask beyond 8192 keys: one CTA per query tile, 176-key blocks where
    # rows see many keys (the diagonal and the window's edges cross two of them), 128 else
    check(*qkv(1, sq, sk, 2, 1, 128), **kw)


@gpu
@pytest.mark.parametrize("dim", [64, 96, 128])
@pytest.mark.parametrize("sq,sk,kw", [(640, 640, {"causal": True}), (1000, 1000, {"causal": True}),
                                      (500, 700, {"causal": True}), (700, 500, {"window_size": (90, 30)})])
def test_persistent_masked_tiles_in_pairs(dim, sq, sk, kw):
    # persistent CTAs with a mask take a pair's j-th longest and j-th shortest query tiles in
    # turn (fwd_sm90.tile_coords), over several rounds of the SMs, odd tile counts included
    check(*qkv(4, sq, sk, 32, 8, dim), **kw)


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_fp16(causal):
    check(*qkv(2, 300, 257, 4, 4, 128, dtype=torch.float16), causal=causal)


@gpu
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (8, 1)])
def test_mha_gqa_mqa(hq, hkv):
    check(*qkv(2, 333, 333, hq, hkv, 64), causal=True)


@gpu
@pytest.mark.parametrize("window", [(32, 0), (64, 64), (-1, 16), (100, -1), (0, 0), (300, 300)])
@pytest.mark.parametrize("sq,sk", [(300, 300), (257, 400), (400, 257)])
def test_local_windows(window, sq, sk):
    check(*qkv(2, sq, sk, 2, 2, 128), window_size=window)


@gpu
@pytest.mark.parametrize("dim", [64, 256])
def test_causal_with_left_window(dim):
    check(*qkv(1, 700, 700, 2, 1, dim), causal=True, window_size=(130, -1))


@gpu
@pytest.mark.parametrize("dim", [128, 256])
@pytest.mark.parametrize("softcap", [5.0, 30.0])
def test_softcap(dim, softcap):
    check(*qkv(2, 300, 300, 2, 2, dim, scale=3.0), causal=True, softcap=softcap)


@gpu
def test_scale_and_inputs_far_from_zero_mean():
    check(*qkv(2, 500, 500, 2, 2, 128, scale=2.0, shift=4.0), softmax_scale=0.3)


@gpu
def test_rows_that_see_no_key():
    # Sq > Sk with a causal mask: the first Sq - Sk rows see nothing (out 0, LSE -inf).
    q, k, v = qkv(1, 300, 50, 2, 2, 64)
    out, lse = ck.flash_attn(q, k, v, causal=True, return_lse=True)
    assert (out[:, :250] == 0).all() and (lse[..., :250] == float("-inf")).all()
    check(q, k, v, causal=True)
    empty_k = torch.empty(1, 0, 2, 64, device="cuda", dtype=torch.bfloat16)
    out, lse = ck.flash_attn(q, empty_k, empty_k, return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()


@gpu
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window_size": (40, 8)}, {"softcap": 10.0}])
def test_varlen(dim, kw):
    lens_q, lens_k = [5, 0, 300, 128, 1, 77], [7, 3, 300, 0, 200, 77]
    cu_q, cu_k, q, k, v = varlen_qkv(lens_q, lens_k, 4, 2, dim)
    out, lse = ck.flash_attn_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True, **kw)
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, **kw)
    lowp = torch.zeros_like(q)
    for b in range(len(lens_q)):
        q0, q1, k0, k1 = cu_q[b].item(), cu_q[b + 1].item(), cu_k[b].item(), cu_k[b + 1].item()
        if q1 > q0:
            lowp[q0:q1] = lowp_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **kw)[0]
    assert_attention_close(out, ref, lowp)
    assert lse.shape == (4, q.shape[0])
    assert_lse_close(lse, ref_lse)


@gpu
@pytest.mark.parametrize("varlen", [False, True])
def test_outputs_poisoned_with_nan_are_fully_written(varlen):
    q, k, v = qkv(2, 200, 150, 4, 2, 128)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((2, 4, 200), float("nan"), device="cuda")
    cu = None
    if varlen:
        q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
        out, lse = out.flatten(0, 1), torch.full((4, 400), float("nan"), device="cuda")
        cu = torch.tensor([0, 200, 400], device="cuda", dtype=torch.int32)
    cu_k = None if cu is None else torch.tensor([0, 150, 300], device="cuda", dtype=torch.int32)
    flash_attn_fwd(q, k, v, out, lse, cu, cu_k, 200, 150, 0.1, True, 350, 0, 0.0)
    assert not out.isnan().any() and not lse.isnan().any()


@gpu
def test_nan_in_a_key_reaches_only_the_rows_that_see_it():
    q, k, v = qkv(1, 256, 256, 2, 2, 128)
    k[0, 200, 0, 5] = float("nan")
    out = ck.flash_attn(q, k, v, causal=True)
    rows_nan = out[0, :, 0].isnan().any(-1)
    assert rows_nan[200:].all() and not rows_nan[:200].any()
    assert not out[0, :, 1].isnan().any()


@gpu
def test_strided_and_packed_inputs():
    # q, k, v as slices of one packed (B, S, 3, H, D) tensor, and a transposed-head layout.
    qkv_packed = torch.randn(2, 190, 3, 4, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv_packed.unbind(2)
    check(q, k, v, causal=True)
    q2 = torch.randn(2, 4, 190, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    check(q2, k, v)


@gpu
def test_torch_compile_with_dynamic_sequence_lengths():
    fn = torch.compile(lambda q, k, v: ck.flash_attn(q, k, v, causal=True), fullgraph=True, dynamic=True)
    for seqlen in (100, 257, 1000):
        q, k, v = qkv(2, seqlen, seqlen, 4, 2, 64)
        ref, _ = attention_ref(q, k, v, causal=True)
        assert_attention_close(fn(q, k, v), ref, lowp_ref(q, k, v, causal=True))


# Head dims the kernels do not run as they are: zero-padded to the next kernel head dim, a value
# head dim of its own (DeepSeek's 192 / 128 among them) too.
PADDED_DIMS = [(8, 8), (32, 32), (80, 80), (112, 112), (160, 160), (200, 200), (192, 128),
               (128, 64), (64, 96)]


def qkv_dims(batch, sq, sk, hq, hkv, dim, dim_v):
    q = torch.randn(batch, sq, hq, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, sk, hkv, dim, device="cuda", dtype=torch.bfloat16)
    return q, k, torch.randn(batch, sk, hkv, dim_v, device="cuda", dtype=torch.bfloat16)


@gpu
@pytest.mark.parametrize("dim,dim_v", PADDED_DIMS)
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window_size": (40, 8), "softcap": 5.0}])
def test_other_head_dims_run_zero_padded(dim, dim_v, kw):
    q, k, v = qkv_dims(2, 150, 203, 4, 2, dim, dim_v)
    check(q, k, v, **kw)
    out = ck.flash_attn(q, k, v, **kw)
    assert out.shape == (2, 150, 4, dim_v) and out.is_contiguous()
    check_backward(q, k, v, **kw)


@gpu
@pytest.mark.parametrize("dim,dim_v", [(80, 80), (192, 128)])
def test_other_head_dims_varlen_packed_and_compiled(dim, dim_v):
    lens_q, lens_k = [5, 0, 300, 77], [7, 3, 200, 77]
    cu_q, cu_k, q, k, _ = varlen_qkv(lens_q, lens_k, 4, 2, dim)
    v = torch.randn(k.shape[0], 2, dim_v, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(q.shape[0], 4, dim_v, device="cuda", dtype=torch.bfloat16)
    ours = grads(lambda *t: ck.flash_attn_varlen(*t, cu_q, cu_k, 300, 200, causal=True), q, k, v, dout)
    ref = grads(lambda *t: attention_varlen_ref(*t, cu_q, cu_k, causal=True)[0], q.double(),
                k.double(), v.double(), dout.double())
    for name, a, r in zip(("dq", "dk", "dv"), ours, ref):
        assert not a.isnan().any(), name
        assert (a.double() - r).abs().max().item() <= 2e-2 * r.abs().max().item() + 1e-3, name
    out = ck.flash_attn_varlen(q, k, v, cu_q, cu_k, 300, 200, causal=True)
    assert out.shape == (q.shape[0], 4, dim_v)
    if dim == dim_v:  # the packed forms: one head dim
        packed = torch.randn(2, 190, 3, 4, dim, device="cuda", dtype=torch.bfloat16)
        leaf = packed.clone().requires_grad_()
        out = ck.flash_attn_qkvpacked(leaf, causal=True)
        ref, _ = attention_ref(*packed.unbind(2), causal=True)
        assert_attention_close(out, ref, lowp_ref(*packed.unbind(2), causal=True))
        dout = torch.randn_like(out)
        dpacked, = torch.autograd.grad(out, leaf, dout)
        ref_leaf = packed.double().requires_grad_()
        ref_out, _ = attention_ref(*ref_leaf.unbind(2), causal=True)
        ref_grad, = torch.autograd.grad(ref_out, ref_leaf, dout.double())
        assert dpacked.shape == packed.shape and not dpacked.isnan().any()
        assert (dpacked.double() - ref_grad).abs().max().item() <= 2e-2 * ref_grad.abs().max().item() + 1e-3
    fn = torch.compile(lambda q, k, v: ck.flash_attn(q, k, v, causal=True), fullgraph=True)
    q, k, v = qkv_dims(2, 130, 130, 4, 2, dim, dim_v)
    ref, _ = attention_ref(q, k, v, causal=True)
    assert_attention_close(fn(q, k, v), ref, lowp_ref(q, k, v, causal=True))


def grads(fn, q, k, v, dout):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    return torch.autograd.grad(out, leaves, dout)


def check_backward(q, k, v, **kw):
    dout = torch.randn(*q.shape[:-1], v.shape[-1], device="cuda", dtype=q.dtype)
    ours = grads(lambda *t: ck.flash_attn(*t, **kw), q, k, v, dout)
    ref = grads(lambda *t: attention_ref(*t, **kw)[0], q.double(), k.double(), v.double(), dout.double())
    lowp = grads(lambda *t: lowp_ref(*t, **kw), q, k, v, dout)
    for name, a, r, lp in zip(("dq", "dk", "dv"), ours, ref, lowp):
        assert a.shape == r.shape and a.dtype == q.dtype, name
        err = (a.double() - r).abs().max().item()
        torch_err = (lp.double() - r).abs().max().item()
        assert err <= 2 * torch_err + 1e-3, f"{name}: error {err:.3e} vs torch's {torch_err:.3e}"


BWD_DIMS = [64, 96, 128, 192, 256]


@gpu
@pytest.mark.parametrize("dim", BWD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 17), (128, 128), (300, 300), (113, 203), (203, 113)])
def test_backward_matches_float64(dim, causal, sq, sk):
    check_backward(*qkv(2, sq, sk, 4, 2, dim), causal=causal)


@gpu
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_backward_gqa_group_sums(hq, hkv, dim):
    check_backward(*qkv(2, 257, 257, hq, hkv, dim), causal=True)


@gpu
@pytest.mark.parametrize("window", [(32, 0), (64, 64), (-1, 16), (100, -1)])
@pytest.mark.parametrize("sq,sk", [(300, 300), (257, 400), (400, 257)])
@pytest.mark.parametrize("dim", [64, 128, 192])
def test_backward_local_windows(window, sq, sk, dim):
    check_backward(*qkv(1, sq, sk, 2, 2, dim), window_size=window)


@gpu
@pytest.mark.parametrize("dim", BWD_DIMS)
@pytest.mark.parametrize("kw", [{"causal": True}, {}, {"window_size": (40, 8)}])
def test_backward_softcap(dim, kw):
    check_backward(*qkv(2, 300, 257, 2, 2, dim, scale=3.0), softcap=10.0, **kw)


@gpu
@pytest.mark.parametrize("dim", [64, 128])
def test_backward_scores_far_from_zero_mean(dim):
    # large scores and LSEs (the head-dim-64 kernel starts S^T's accumulator at -LSE / scale)
    check_backward(*qkv(2, 500, 400, 2, 2, dim, scale=2.0, shift=4.0), softmax_scale=0.3, causal=True)


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_backward_long_and_fp16(causal):
    check_backward(*qkv(1, 2048, 2048, 2, 1, 128), causal=causal)
    check_backward(*qkv(1, 3000, 2500, 2, 1, 64), causal=causal)
    check_backward(*qkv(1, 1500, 1500, 2, 1, 256), causal=causal)
    check_backward(*qkv(2, 300, 257, 2, 2, 64, dtype=torch.float16), causal=causal)
    check_backward(*qkv(2, 300, 257, 2, 2, 192, dtype=torch.float16), causal=causal)


@gpu
@pytest.mark.parametrize("dim", [64, 96, 128])
@pytest.mark.parametrize("sq,sk,kw", [(300, 300, {}), (200, 333, {}), (333, 200, {"softcap": 10.0}),
                                      (129, 257, {"dtype": torch.float16})])
def test_backward_persistent_ctas_take_many_key_blocks(dim, sq, sk, kw):
    # without a mask one CTA per SM takes key blocks in turn (bwd_sm90's persistent grid):
    # 12 sequences x 16 kv heads x 2-3 key blocks are several rounds of the SMs
    kw = dict(kw)
    dtype = kw.pop("dtype", torch.bfloat16)
    check_backward(*qkv(12, sq, sk, 32, 16, dim, dtype=dtype), **kw)


@gpu
@pytest.mark.parametrize("b,sq,sk,hq,hkv,dim,kw", [
    (5, 3000, 3000, 2, 1, 128, {"causal": True}),  # 24 key blocks: groups of 4 pairs, then 1
    (3, 2500, 2500, 1, 1, 256, {"window_size": (-1, 16)}),  # a group wider than the pairs
    (3, 2000, 2600, 4, 2, 64, {"causal": True}),  # 6 pairs: 4, then 2; Sk > Sq
])
def test_backward_masked_pair_groups_cover_every_key_block(b, sq, sk, hq, hkv, dim, kw):
    # masked grids take the CTAs key block by key block over groups of pairs (bwd_sm90.tile_coords)
    check_backward(*qkv(b, sq, sk, hq, hkv, dim), **kw)


def _split(dim, group, **kw):
    """Whether the backward splits this group over several CTAs (``config.bwd_kv_splits``)."""
    from cute_kernels.attention.config import attention_bwd_config, bwd_kv_splits

    config = attention_bwd_config(dim, local=True, softcap=bool(kw.get("softcap")), varlen=False)
    return bwd_kv_splits(config, group, True) > 1


@gpu
@pytest.mark.parametrize("dim", [96, 128])
@pytest.mark.parametrize("b,sq,sk,hq,hkv,kw", [
    (2, 333, 290, 14, 2, {"causal": True}),  # 7 heads per kv head: runs of 2, 2, 2 and 1
    (2, 290, 333, 8, 1, {"window_size": (-1, 20)}),
    (1, 700, 700, 10, 2, {"causal": True, "softcap": 10.0}),
    (3, 200, 260, 6, 1, {"causal": True, "dtype": torch.float16}),
    (2, 1, 1, 8, 1, {"causal": True}),
    (2, 1, 300, 8, 1, {"causal": True}),  # one query row, which sees every key block
    (2, 300, 1, 8, 1, {"causal": True}),  # one key: rows before it see nothing
])
def test_backward_split_groups_add_dk_and_dv(dim, b, sq, sk, hq, hkv, kw):
    # large groups of query heads per kv head under a causal-like mask: several CTAs per key
    # block, each over a run of the group, add dK and dV into fp32 accumulators
    kw = dict(kw)
    dtype = kw.pop("dtype", torch.bfloat16)
    assert _split(dim, hq // hkv, **kw)
    check_backward(*qkv(b, sq, sk, hq, hkv, dim, dtype=dtype), **kw)


@gpu
@pytest.mark.parametrize("dim", [96, 128])
@pytest.mark.parametrize("kw", [{"causal": True}, {"window_size": (-1, 30)}])
def test_backward_varlen_split_groups_write_every_gradient(dim, kw):
    # split groups with packed sequences: empty sequences, partial and unreached key blocks
    assert _split(dim, 8)
    check_varlen_backward_fills_poisoned_buffers([300, 0, 130, 77, 5, 200],
                                                 [100, 3, 0, 200, 5, 260], 8, 1, dim, **kw)


@gpu
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window_size": (40, 8)}])
@pytest.mark.parametrize("dim", [64, 128, 192, 256])
def test_backward_varlen(kw, dim):
    lens_q, lens_k = [5, 0, 300, 128, 1, 77], [7, 3, 300, 0, 200, 77]
    cu_q, cu_k, q, k, v = varlen_qkv(lens_q, lens_k, 4, 2, dim)
    dout = torch.randn_like(q)
    ours = grads(lambda *t: ck.flash_attn_varlen(*t, cu_q, cu_k, max(lens_q), max(lens_k), **kw),
                 q, k, v, dout)
    ref = grads(lambda *t: attention_varlen_ref(*t, cu_q, cu_k, **kw)[0], q.double(), k.double(),
                v.double(), dout.double())
    for name, a, r in zip(("dq", "dk", "dv"), ours, ref):
        assert not a.isnan().any(), name
        scale = r.abs().max().item()
        assert (a.double() - r).abs().max().item() <= 2e-2 * scale + 1e-3, name


@gpu
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window_size": (100, 30)}])
@pytest.mark.parametrize("sq,sk", [(1000, 1000), (300, 1100), (1100, 300)])
@pytest.mark.parametrize("dim", [64, 128, 192, 256])
def test_backward_deterministic_is_bit_identical_and_correct(kw, sq, sk, dim):
    q, k, v = qkv(2, sq, sk, 4, 2, dim)
    dout = torch.randn_like(q)
    runs = [grads(lambda *t: ck.flash_attn(*t, deterministic=True, **kw), q, k, v, dout) for _ in range(3)]
    for later in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], later):
            assert torch.equal(a, b), name
    ref = grads(lambda *t: attention_ref(*t, **kw)[0], q.double(), k.double(), v.double(), dout.double())
    lowp = grads(lambda *t: lowp_ref(*t, **kw), q, k, v, dout)
    for name, a, r, lp in zip(("dq", "dk", "dv"), runs[0], ref, lowp):
        err, torch_err = (a.double() - r).abs().max().item(), (lp.double() - r).abs().max().item()
        assert err <= 2 * torch_err + 1e-3, f"{name}: error {err:.3e} vs torch's {torch_err:.3e}"


@gpu
@pytest.mark.parametrize("dim", [96, 128])
@pytest.mark.parametrize("varlen", [False, True])
def test_backward_deterministic_split_groups_are_bit_identical_and_correct(dim, varlen):
    # a split group's runs add dK and dV in run order (a semaphore per key block)
    assert _split(dim, 7)
    kw = {"causal": True, "deterministic": True}
    if varlen:
        lens_q, lens_k = [300, 0, 130, 517, 5], [100, 3, 0, 600, 5]
        cu_q, cu_k, q, k, v = varlen_qkv(lens_q, lens_k, 14, 2, dim)

        def attend(*t):
            return ck.flash_attn_varlen(*t, cu_q, cu_k, max(lens_q), max(lens_k), **kw)

        def reference(*t):
            return attention_varlen_ref(*t, cu_q, cu_k, causal=True)[0]
    else:
        q, k, v = qkv(2, 600, 700, 14, 2, dim)

        def attend(*t):
            return ck.flash_attn(*t, **kw)

        def reference(*t):
            return attention_ref(*t, causal=True)[0]
    dout = torch.randn_like(q)
    runs = [grads(attend, q, k, v, dout) for _ in range(3)]
    for later in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], later):
            assert torch.equal(a, b), name
    ref = grads(reference, q.double(), k.double(), v.double(), dout.double())
    lowp = None if varlen else grads(lambda *t: lowp_ref(*t, causal=True), q, k, v, dout)
    for i, (name, a, r) in enumerate(zip(("dq", "dk", "dv"), runs[0], ref)):
        err = (a.double() - r).abs().max().item()
        if varlen:
            assert err <= 2e-2 * r.abs().max().item() + 1e-3, name
        else:
            torch_err = (lowp[i].double() - r).abs().max().item()
            assert err <= 2 * torch_err + 1e-3, f"{name}: error {err:.3e} vs torch's {torch_err:.3e}"


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_backward_varlen_deterministic_is_bit_identical(causal):
    lens_q, lens_k = [5, 0, 700, 128, 1, 300], [7, 3, 700, 0, 200, 900]
    cu_q, cu_k, q, k, v = varlen_qkv(lens_q, lens_k, 4, 1, 64)
    dout = torch.randn_like(q)

    def attend(*t):
        return ck.flash_attn_varlen(*t, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                    deterministic=True)

    first, second = grads(attend, q, k, v, dout), grads(attend, q, k, v, dout)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    ref = grads(lambda *t: attention_varlen_ref(*t, cu_q, cu_k, causal=causal)[0], q.double(),
                k.double(), v.double(), dout.double())
    for name, a, r in zip(("dq", "dk", "dv"), first, ref):
        assert (a.double() - r).abs().max().item() <= 2e-2 * r.abs().max().item() + 1e-3, name


@gpu
@pytest.mark.parametrize("dim", [64, 96, 128])
@pytest.mark.parametrize("kw", [{"causal": True}, {"window_size": (20, 0)}, {"window_size": (0, 10)},
                                {"deterministic": True, "causal": True}])
def test_backward_varlen_gradient_buffers_poisoned_with_nan_are_fully_written(dim, kw):
    # rows no key block reaches (no keys in the sequence, a window left of every key, Sq > Sk
    # under a causal mask) and key blocks no query reaches still get their gradients written
    check_varlen_backward_fills_poisoned_buffers([300, 0, 130, 77, 5, 200],
                                                 [100, 3, 0, 200, 5, 60], 4, 2, dim, **kw)


def check_varlen_backward_fills_poisoned_buffers(lens_q, lens_k, hq, hkv, dim,
                                                 deterministic=False, **kw):
    """The backward op into gradient buffers poisoned with NaN: every value written, and right."""
    from cute_kernels.attention.op import _window, flash_attn_bwd

    cu_q, cu_k, q, k, v = varlen_qkv(lens_q, lens_k, hq, hkv, dim)
    dout = torch.randn_like(q)
    out, lse = ck.flash_attn_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True,
                                    **kw)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    local, left, right = _window(kw.get("causal", False), kw.get("window_size", (-1, -1)),
                                 max(lens_q) + max(lens_k))
    flash_attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max(lens_q), max(lens_k),
                   dim ** -0.5, local, left, right, 0.0, deterministic)
    ref = grads(lambda *t: attention_varlen_ref(*t, cu_q, cu_k, **kw)[0], q.double(), k.double(),
                v.double(), dout.double())
    for name, a, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        assert not a.isnan().any(), name
        assert (a.double() - r).abs().max().item() <= 2e-2 * r.abs().max().item() + 1e-3, name


@gpu
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_backward_gradient_buffers_poisoned_with_nan_are_fully_written(dim, causal):
    from cute_kernels.attention.op import flash_attn_bwd

    # without a mask: 8 x 16 x 2 key blocks, more than one round of persistent CTAs
    q, k, v = qkv(8, 200, 150, 32, 16, dim)
    out, lse = ck.flash_attn(q, k, v, causal=causal, return_lse=True)
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    flash_attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, None, None, 200, 150, 0.1, causal,
                   350 if causal else 0, 0, 0.0, False)
    assert not (dq.isnan().any() or dk.isnan().any() or dv.isnan().any())




@gpu
def test_errors_before_launch():
    q, k, v = qkv(2, 64, 64, 4, 2, 128)
    with pytest.raises(ck.UnsupportedError, match="head dim"):
        ck.flash_attn(q, k[..., :64], v[..., :64])
    with pytest.raises(ck.UnsupportedError, match="batch"):
        ck.flash_attn(q, k[:1], v[:1])
    with pytest.raises(ck.UnsupportedError, match="multiple"):
        ck.flash_attn(q, *qkv(2, 64, 64, 3, 3, 128)[1:])
    for dim in (100, 264, 4):
        with pytest.raises(ck.UnsupportedError, match=f"head dim {dim} \\(q.shape"):
            ck.flash_attn(*qkv(1, 8, 8, 2, 2, dim))
    with pytest.raises(ck.UnsupportedError, match=r"head dim 60 \(v.shape"):
        ck.flash_attn(q, k, v[..., :60])
    with pytest.raises(ck.UnsupportedError, match="same shape but for the head dim"):
        ck.flash_attn(q, k, v[:, :32])
    with pytest.raises(ck.DTypeError):
        ck.flash_attn(q.float(), k.float(), v.float())
    with pytest.raises(ck.DTypeError):
        ck.flash_attn(q, k.half(), v.half())
    with pytest.raises(ck.UnsupportedError, match="contiguous"):
        ck.flash_attn(q, k, torch.randn(2, 64, 128, 2, device="cuda", dtype=torch.bfloat16).transpose(-1, -2))
    with pytest.raises(ck.UnsupportedError, match="dropout"):
        ck.flash_attn(q, k, v, dropout_p=0.1)
    with pytest.raises(ck.UnsupportedError, match="window_size"):
        ck.flash_attn(q, k, v, window_size=(-2, 3))
    flat = q.flatten(0, 1)
    cu = torch.tensor([0, 64, 128], device="cuda", dtype=torch.int32)
    with pytest.raises(ck.DTypeError, match="cu_seqlens_q"):
        ck.flash_attn_varlen(flat, flat[:, :2], flat[:, :2], cu.long(), cu, 64, 64)
    with pytest.raises(ck.UnsupportedError, match="cu_seqlens_k"):
        ck.flash_attn_varlen(flat, flat[:, :2], flat[:, :2], cu, cu[:2], 64, 64)


def test_cpu_tensors_are_refused():
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ck.DeviceError):
        ck.flash_attn(q, q, q)


# flash_attn.flash_attn_interface's parameters, in order (FlashAttention 2.6 - 2.8)
FA_FUNC = ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
           "alibi_slopes", "deterministic", "return_attn_probs"]
FA_VARLEN_FUNC = FA_FUNC[:3] + ["cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"] \
    + FA_FUNC[3:] + ["block_table"]


@pytest.mark.parametrize("ours, theirs", [(ck.flash_attn, FA_FUNC),
                                          (ck.flash_attn_varlen, FA_VARLEN_FUNC)])
def test_arguments_follow_flash_attn_func_in_order(ours, theirs):
    import inspect

    params = inspect.signature(ours).parameters.values()
    positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == theirs
    assert [p.name for p in params if p.kind == p.KEYWORD_ONLY] == ["return_lse"]


def test_unsupported_return_and_cache_options_are_refused_first():
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ck.UnsupportedError, match="return_attn_probs"):
        ck.flash_attn(q, q, q, return_lse=True, return_attn_probs=True)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ck.UnsupportedError, match="block_table"):
        ck.flash_attn_varlen(q[0], q[0], q[0], cu, cu, 8, 8, block_table=torch.zeros(1, 1))


def test_packed_inputs_of_the_wrong_shape_are_refused():
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ck.UnsupportedError, match=r"qkv must be \(batch, seqlen, 3"):
        ck.flash_attn_qkvpacked(q)
    with pytest.raises(ck.UnsupportedError, match=r"kv must be \(total_tokens_k, 2"):
        ck.flash_attn_varlen_kvpacked(q[0], torch.randn(8, 3, 2, 64), None, None, 8, 8)


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_packed_inputs_match_the_unpacked_op(causal):
    torch.manual_seed(0)
    b, s, h, d = 2, 130, 4, 128
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    kw = dict(causal=causal, window_size=(64, 64), softcap=5.0)

    def grads(fn, *leaves):
        leaves = [t.detach().requires_grad_() for t in leaves]
        out = fn(*leaves)
        return out, torch.autograd.grad(out, leaves, dout)

    q, k, v = (t.contiguous() for t in qkv.unbind(2))
    out, (dq, dk, dv) = grads(lambda q, k, v: ck.flash_attn(q, k, v, deterministic=True, **kw), q, k, v)
    got, (dqkv,) = grads(lambda t: ck.flash_attn_qkvpacked(t, deterministic=True, **kw), qkv)
    assert torch.equal(got, out) and torch.equal(dqkv, torch.stack((dq, dk, dv), 2))
    kv = qkv[:, :, 1:].contiguous()
    got, (dq2, dkv) = grads(lambda q, kv: ck.flash_attn_kvpacked(q, kv, deterministic=True, **kw), q, kv)
    assert torch.equal(got, out) and torch.equal(dq2, dq) and torch.equal(dkv, torch.stack((dk, dv), 2))
    cu = torch.tensor([0, 50, 2 * s], device="cuda", dtype=torch.int32)
    flat = qkv.flatten(0, 1)
    q1, k1, v1 = (t.contiguous() for t in flat.unbind(1))
    ref, lse = ck.flash_attn_varlen(q1, k1, v1, cu, cu, 2 * s - 50, 2 * s - 50, return_lse=True, **kw)
    got, got_lse = ck.flash_attn_varlen_qkvpacked(flat, cu, 2 * s - 50, return_lse=True, **kw)
    assert torch.equal(got, ref) and torch.equal(got_lse, lse)
    got = ck.flash_attn_varlen_kvpacked(q1, flat[:, 1:], cu, cu, 2 * s - 50, 2 * s - 50, **kw)
    assert torch.equal(got, ref)
    leaf = flat.detach().requires_grad_()
    got = ck.flash_attn_varlen_qkvpacked(leaf, cu, 2 * s - 50, deterministic=True, **kw)
    (dflat,) = torch.autograd.grad(got, leaf, dout.flatten(0, 1))
    leaves = [t.detach().requires_grad_() for t in (q1, k1, v1)]
    ref = ck.flash_attn_varlen(*leaves, cu, cu, 2 * s - 50, 2 * s - 50, deterministic=True, **kw)
    assert torch.equal(dflat, torch.stack(torch.autograd.grad(ref, leaves, dout.flatten(0, 1)), 1))


@gpu
def test_packed_inputs_under_torch_compile():
    qkv = torch.randn(2, 96, 3, 4, 64, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(2, 96, 4, 64, device="cuda", dtype=torch.bfloat16)

    def step(attend):  # the forward compiled as one graph (or eager), then its backward
        leaf = qkv.detach().requires_grad_()
        out = attend(leaf)
        return out, torch.autograd.grad(out, leaf, dout)[0]

    attend = lambda t: ck.flash_attn_qkvpacked(t, causal=True, deterministic=True)  # noqa: E731
    eager, compiled = step(attend), step(torch.compile(attend, fullgraph=True))
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_positional_arguments_and_return_attn_probs(causal):
    q, k, v = qkv(2, 77, 100, 4, 2, 64)
    scale = 0.3
    out, lse = ck.flash_attn(q, k, v, softmax_scale=scale, causal=causal, window_size=(40, 7),
                             return_lse=True)
    for _ in range(2):  # the second call takes the launch plan the first one made
        got = ck.flash_attn(q, k, v, 0.0, scale, causal, (40, 7), 0.0, None, False, True)
        assert len(got) == 3 and got[2] is None
        assert torch.equal(got[0], out) and torch.equal(got[1], lse)
    leaf = q.detach().requires_grad_()
    got = ck.flash_attn(leaf, k, v, 0.0, scale, causal, (40, 7), 0.0, None, True, True)
    assert torch.equal(got[0].detach(), out) and torch.equal(got[1], lse)
    got[0].float().sum().backward()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()
    flat_q, flat_k, flat_v = (t.reshape(-1, *t.shape[2:]) for t in qkv(1, 64, 64, 4, 2, 64))
    cu = torch.tensor([0, 20, 64], device="cuda", dtype=torch.int32)
    out, lse = ck.flash_attn_varlen(flat_q, flat_k, flat_v, cu, cu, 44, 44, causal=causal,
                                    return_lse=True)
    got = ck.flash_attn_varlen(flat_q, flat_k, flat_v, cu, cu, 44, 44, 0.0, None, causal,
                               (-1, -1), 0.0, None, False, True)
    assert len(got) == 3 and got[2] is None
    assert torch.equal(got[0], out) and torch.equal(got[1], lse)


@gpu
def test_self_check_rows():
    from cute_kernels.attention.op import self_checks

    for check in self_checks():
        assert check.error(check.ours()) <= check.tolerance
        assert check.torch().shape == check.reference.shape


def _transformer_block_loss(x, norm_w, w_qkv, w_out, w_vocab, target, heads, heads_kv, attend):
    """RMSNorm -> QKV GEMM -> attention -> output GEMM (+ residual) -> vocab GEMM -> mean
    cross-entropy; ``attend(q, k, v)`` is the attention."""
    batch, seqlen, width = x.shape
    dim = width // heads
    h = ck.rms_norm(x, norm_w).view(-1, width)
    qkv = ck.gemm(h, w_qkv).view(batch, seqlen, heads + 2 * heads_kv, dim)
    q, k, v = qkv.split([heads, heads_kv, heads_kv], dim=2)
    o = attend(q, k, v).reshape(-1, width)
    y = ck.gemm(o, w_out) + x.view(-1, width)
    return ck.cross_entropy(ck.gemm(y, w_vocab), target.view(-1))


@gpu
def test_training_step_of_a_transformer_block_under_torch_compile():
    torch.manual_seed(0)
    batch, seqlen, heads, heads_kv, dim, vocab = 2, 256, 4, 2, 64, 512
    width = heads * dim
    dev, bf16 = "cuda", torch.bfloat16
    params = [torch.randn(width, device=dev, dtype=bf16),
              torch.randn(width, (heads + 2 * heads_kv) * dim, device=dev, dtype=bf16) / width ** 0.5,
              torch.randn(width, width, device=dev, dtype=bf16) / width ** 0.5,
              torch.randn(width, vocab, device=dev, dtype=bf16) / width ** 0.5]
    x = torch.randn(batch, seqlen, width, device=dev, dtype=bf16)
    target = torch.randint(0, vocab, (batch, seqlen), device=dev)

    def block(x, *weights):
        return _transformer_block_loss(x, *weights, target, heads, heads_kv,
                                       lambda q, k, v: ck.flash_attn(q, k, v, causal=True))

    def step(loss_fn):  # forward (compiled as one graph, or eager) and backward
        leaves = [w.detach().requires_grad_() for w in (x, *params)]
        loss = loss_fn(*leaves)
        return (loss, *torch.autograd.grad(loss, leaves))

    eager = step(block)
    compiled = step(torch.compile(block, fullgraph=True))
    for name, a, b in zip(("loss", "dx", "dnorm", "dqkv", "dout", "dvocab"), eager, compiled):
        assert not b.isnan().any(), name
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2 * a.float().abs().max().item(),
                                   msg=name)
    # and the attention's gradients agree with torch's attention in the same block
    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=True).transpose(1, 2)
    leaves = [w.detach().requires_grad_() for w in (x, *params)]
    ref = torch.autograd.grad(_transformer_block_loss(*leaves, target, heads, heads_kv, sdpa), leaves)
    for name, a, r in zip(("dx", "dnorm", "dqkv", "dout", "dvocab"), eager[1:], ref):
        assert (a.float() - r.float()).abs().max().item() <= 3e-2 * r.float().abs().max().item() + 1e-3, name


@gpu
def test_varlen_prepare_pass_writes_the_rows_where_the_backward_kernel_reads_them():
    # NaN-poisoned outputs: every row a sequence owns holds its LSE in log2 units (+inf for
    # -inf) and D = rowsum(dO * O); every row between sequences zero; the whole accumulator zero
    from cute_kernels.attention.bwd_sm90 import padded_row_offset
    from cute_kernels.attention.dq_accum import accum_rows
    from cute_kernels.attention.op import _compiled, _varlen_rows

    lens = [5, 0, 300, 128, 1, 77, 3]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).int()
    total, heads, dim, tile_m = sum(lens), 3, 64, 128
    out, dout = (torch.randn(1, total, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lse = torch.randn(heads, total, device="cuda")
    lse[1, 10] = float("-inf")
    lse_rows, dsum_rows = (_varlen_rows(lse, len(lens)).fill_(float("nan")) for _ in range(2))
    acc = torch.full((heads, accum_rows(len(lens), total, tile_m, True), dim), float("nan"), device="cuda")
    _compiled("bwd_prepare", (dim, True), torch.bfloat16, torch.cuda.current_device())(
        out, dout, lse[None], lse_rows, dsum_rows, acc, cu, max(lens))
    assert lse_rows.stride(1) % 4 == 0 and (acc == 0).all()
    dsum = (out.float() * dout.float()).sum(-1)[0].T
    expected_lse = (lse * math.log2(math.e)).masked_fill(lse.isneginf(), math.inf)
    used = torch.zeros(lse_rows.shape[2], dtype=torch.bool, device="cuda")
    for b, n in enumerate(lens):
        start, first = padded_row_offset(int(cu[b]), b), int(cu[b])
        assert start % 4 == 0 and not used[start:start + n].any()
        used[start:start + n] = True
        torch.testing.assert_close(lse_rows[0, :, start:start + n], expected_lse[:, first:first + n])
        torch.testing.assert_close(dsum_rows[0, :, start:start + n], dsum[:, first:first + n],
                                   rtol=1e-4, atol=1e-4)
    assert (lse_rows[0][:, ~used] == 0).all() and (dsum_rows[0][:, ~used] == 0).all()
