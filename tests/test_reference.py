"""The float64 references themselves, checked on the CPU against torch and by hand."""

import math

import torch
import torch.nn.functional as F

from cute_kernels.reference.attention import attention_mask, attention_ref, attention_varlen_ref


def _sdpa(q, k, v, mask, scale):
    """torch's attention in float64 on (B, S, H, D) tensors with a (Sq, Sk) bool mask."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2).double(), k.transpose(1, 2).double(),
                                         v.transpose(1, 2).double(), attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def test_masks_are_bottom_right_aligned():
    causal = attention_mask(2, 5, causal=True)
    assert causal.tolist() == [[True, True, True, True, False], [True] * 5]
    local = attention_mask(4, 4, window_size=(1, 1))
    assert local.tolist() == [[True, True, False, False], [True, True, True, False],
                              [False, True, True, True], [False, False, True, True]]
    assert attention_mask(3, 3, causal=True, window_size=(0, 5)).tolist() == [
        [True, False, False], [False, True, False], [False, False, True]]
    assert not attention_mask(4, 2, causal=True)[:2].any()  # rows above the keys see nothing


def test_matches_torch_sdpa_mha_and_gqa():
    torch.manual_seed(0)
    for sq, sk, causal, window in ((17, 17, False, (-1, -1)), (17, 17, True, (-1, -1)),
                                   (5, 33, True, (-1, -1)), (33, 33, False, (8, 3))):
        q = torch.randn(2, sq, 8, 16)
        k, v = torch.randn(2, sk, 2, 16), torch.randn(2, sk, 2, 16)
        out, lse = attention_ref(q, k, v, causal=causal, window_size=window)
        mask = attention_mask(sq, sk, causal, window)
        ref = _sdpa(q, k.repeat_interleave(4, 2), v.repeat_interleave(4, 2), mask, 1 / math.sqrt(16))
        torch.testing.assert_close(out, ref)
        scores = torch.einsum("bihd,bjhd->bhij", q.double(), k.double().repeat_interleave(4, 2)) / 4
        torch.testing.assert_close(lse, torch.logsumexp(scores.masked_fill(~mask, -math.inf), -1))


def test_softcap_scale_and_empty_rows():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 6, 2, 8), torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8)
    out, lse = attention_ref(q, k, v, causal=True, softmax_scale=0.3, softcap=5.0)
    assert (out[0, :3] == 0).all() and torch.isneginf(lse[0, :, :3]).all()
    s = 5.0 * torch.tanh(torch.einsum("ihd,jhd->hij", q[0].double(), k[0].double()) * 0.3 / 5.0)
    s = s.masked_fill(~attention_mask(6, 3, causal=True), -math.inf)
    torch.testing.assert_close(out[0, 3:], torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v[0].double())[3:])


def test_varlen_is_each_sequence_on_its_own():
    torch.manual_seed(2)
    lens_q, lens_k = [3, 0, 5], [4, 2, 5]
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6, 11], dtype=torch.int32)
    q, k, v = torch.randn(8, 4, 8), torch.randn(11, 2, 8), torch.randn(11, 2, 8)
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True)
    for b in (0, 2):
        q0, k0 = int(cu_q[b]), int(cu_k[b])
        o, s = attention_ref(q[None, q0:q0 + lens_q[b]], k[None, k0:k0 + lens_k[b]],
                             v[None, k0:k0 + lens_k[b]], causal=True)
        torch.testing.assert_close(out[q0:q0 + lens_q[b]], o[0])
        torch.testing.assert_close(lse[:, q0:q0 + lens_q[b]], s[0])


def test_reference_is_differentiable():
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 4, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda q, k, v: attention_ref(q, k, v, causal=True, softcap=2.0)[0],
                                    (q, k, v))
