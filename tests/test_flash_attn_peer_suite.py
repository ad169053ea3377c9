"""FlashAttention's own forward / backward tests, pointed at ``ck.flash_attn`` and
``ck.flash_attn_varlen``.

FlashAttention's CuTe test module (``tests/cute/test_flash_attn.py`` in the flash-attention
repository, the version of the installed ``flash_attn.cute``) is not part of its pip package:
set ``CK_FA_TEST_FILE`` to its path to run this file; without it, or without a GPU and
``flash_attn.cute``, the file skips. Its test functions run unchanged; only the two functions
they call are replaced by a shim with ``flash_attn_func``'s (FlashAttention-2) semantics on top
of ours (``window_size`` sides of None mean unbounded). Where the upstream test asks for what
that API has no word for, the shim says so: learnable sinks, ``qv``, negative window sides,
``seqused`` (padded batches) skip. A value head dim different from the query's (the upstream
loops over both) runs ours, zero-padded (``ck.flash_attn``'s head dims).

The parameter grid is the upstream one thinned to what the shim can express: every sequence
pair of the upstream lists, head dims 64 / 96 / 128 / 256 and 192 with a value head dim of 128,
causal / local / neither, MHA / GQA / MQA, softcap and deterministic at 128; varlen with empty
sequences. The largest varlen cases hold ~20 GB of torch reference tensors each: run with
``-n 2`` at most on an 80 GB card.

    CK_FA_TEST_FILE=../flash-attention/tests/cute/test_flash_attn.py \\
        python -m pytest -q -n 2 tests/test_flash_attn_peer_suite.py
"""
import importlib.util
import itertools
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

_PATH = os.environ.get("CK_FA_TEST_FILE")
if not _PATH or not os.path.isfile(_PATH):
    pytest.skip("CK_FA_TEST_FILE is not set to FlashAttention's tests/cute/test_flash_attn.py",
                allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU on this machine", allow_module_level=True)
pytest.importorskip("flash_attn.cute.interface")

import cute_kernels as ck  # noqa: E402

_spec = importlib.util.spec_from_file_location("fa_upstream_tests", _PATH)
up = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(up)


def _window(window_size):
    """FlashAttention-3's (left, right) with None for unbounded -> FlashAttention-2's -1."""
    if window_size is None:
        return (-1, -1)
    left, right = window_size
    if (left is not None and left < 0) or (right is not None and right < 0):
        pytest.skip("a negative window side has no flash_attn_func (FlashAttention-2) counterpart")
    return (-1 if left is None else left, -1 if right is None else right)


def _unsupported(qv, learnable_sink):
    if qv is not None or learnable_sink is not None:
        pytest.skip("qv / learnable sinks have no flash_attn_func (FlashAttention-2) counterpart")


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, window_size=(None, None),
                    learnable_sink=None, softcap=0.0, deterministic=False, **unused):
    _unsupported(qv, learnable_sink)
    return ck.flash_attn(q, k, v, softmax_scale=softmax_scale, causal=causal,
                         window_size=_window(window_size), softcap=softcap,
                         deterministic=deterministic, return_lse=True)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, seqused_q=None, seqused_k=None, softmax_scale=None,
                           causal=False, window_size=(None, None), learnable_sink=None,
                           softcap=0.0, deterministic=False, qv=None, **unused):
    _unsupported(qv, learnable_sink)
    if cu_seqlens_q is None or cu_seqlens_k is None or seqused_q is not None or seqused_k is not None:
        pytest.skip("padded batches (seqused) have no flash_attn_varlen_func counterpart")
    return ck.flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                softmax_scale=softmax_scale, causal=causal,
                                window_size=_window(window_size), softcap=softcap,
                                deterministic=deterministic, return_lse=True)


up.flash_attn_func = flash_attn_func
up.flash_attn_varlen_func = flash_attn_varlen_func
up.VERBOSE = False

SEQLENS = [(1, 1), (3, 3), (64, 32), (64, 128), (64, 1), (128, 128), (128, 192), (256, 256),
           (255, 256), (239, 1), (799, 3), (113, 203), (113, 128), (128, 217), (113, 211),
           (108, 256), (256, 512), (384, 256), (640, 128), (512, 256), (1024, 1024), (1023, 1024),
           (1024, 1023), (2048, 2048), (4096, 4096), (4224, 4224)]
VARLEN_SEQLENS = [(511, 1), (3, 513), (64, 128), (128, 128), (113, 203), (128, 217), (108, 256),
                  (307, 256), (640, 128), (1024, 1023), (2048, 2048), (64, 1), (255, 256),
                  (4224, 4224)]
MASKS = [(False, 0), (True, 0), (False, 1)]  # (causal, the upstream's local_enum): both windows >= 0


def _fixed_cases():
    for d, (causal, local), mha in itertools.product([64, 96, 128, 192, 256], MASKS,
                                                     ["mha", "gqa", "mqa"]):
        if mha != "mha" and d not in (64, 128):
            continue
        for softcap, deterministic in ((0.0, False), (15.0, False), (0.0, True)):
            if (softcap or deterministic) and d != 128:
                continue
            yield d, causal, local, softcap, deterministic, mha


@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
@pytest.mark.parametrize("d,causal,local_enum,softcap,deterministic,mha_type", list(_fixed_cases()))
def test_upstream_output(seqlen_q, seqlen_k, d, causal, local_enum, softcap, deterministic, mha_type):
    up.test_flash_attn_output(seqlen_q, seqlen_k, d, causal, local_enum, softcap, deterministic,
                              False, False, mha_type, torch.bfloat16)


@pytest.mark.parametrize("seqlen_q,seqlen_k", VARLEN_SEQLENS)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal,local_enum", MASKS)
@pytest.mark.parametrize("mha_type", ["mha", "gqa"])
@pytest.mark.parametrize("zero_lengths", [False, True])
def test_upstream_varlen_output(seqlen_q, seqlen_k, d, causal, local_enum, mha_type, zero_lengths):
    up.test_flash_attn_varlen_output(seqlen_q, seqlen_k, d, False, causal, local_enum, 0.0, False,
                                     False, False, mha_type, torch.bfloat16, "random",
                                     zero_lengths, zero_lengths, True, True)
