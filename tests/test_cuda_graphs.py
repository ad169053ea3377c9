"""Every op family captured in a CUDA graph (as inference engines and torch.compile's
"reduce-overhead" do): after one warm-up call, the forward (and the backward, through autograd,
inside the same capture) records without a host synchronization or a driver call the capture
forbids, and replays on new input values with the results of eager calls on those values."""

import pytest
import torch

import cute_kernels as ck

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _rms_norm(x, w, r):
    y, h = ck.rms_norm(x, w, residual=r)
    return y, h


def _flce(h, w):
    t = (h[:, 0].float().abs() * 1000).long() % w.shape[0]  # targets that follow the inputs
    return ck.fused_linear_cross_entropy(h, w, t)


def _flce_per_token(h, w):
    t = (h[:, 0].float().abs() * 1000).long() % w.shape[0]
    return ck.fused_linear_cross_entropy(h, w, t, reduction="none", softcap=20.0)


def _attention(q, k, v):
    return ck.flash_attn(q, k, v, causal=True)


def _varlen(q, k, v, cu_seqlens):
    return ck.flash_attn_varlen(q, k, v, cu_seqlens, cu_seqlens, 140, 140, causal=True)


def _offsets():
    return torch.tensor([0, 100, 160, 300], dtype=torch.int32, device="cuda")


def _int8(x, w):
    qx, sx, _ = ck.quantize_int8(x)
    qw, sw, _ = ck.quantize_int8(w)
    return ck.gemm_int8(qx, qw, scale_a=sx, scale_b=sw)


def _nvfp4(x, w):
    packed, scales, global_scale = ck.nvfp4_quantize(w)
    xp, xs, xg = ck.nvfp4_quantize(x)
    return (ck.gemm_w4a16(x, packed, scales, global_scale),
            ck.gemm_nvfp4(xp, packed, xs, scales, alpha=xg * global_scale))


def _fp8(a, b):
    one = torch.ones((), device=a.device)
    return ck.gemm_fp8(a.to(torch.float8_e4m3fn), b.t().to(torch.float8_e4m3fn).t(), one, one)


def randn(*shape, dtype=BF16, grad=False):
    return torch.randn(shape, device="cuda", dtype=dtype).requires_grad_(grad)


# name: (function, input makers, whether the backward is captured too, tolerance of the replay
# against eager: 0 where the same kernels run in the same order, else the atomics' reordering)
CASES = {
    "rms_norm": (_rms_norm, lambda: (randn(300, 1024, grad=True), randn(1024, dtype=torch.float32, grad=True),
                                     randn(300, 1024, grad=True)), True, 0),
    "layer_norm": (lambda x, w, b: ck.layer_norm(x, w, b),
                   lambda: (randn(77, 4096, grad=True), randn(4096, grad=True), randn(4096, grad=True)), True, 0),
    "softmax": (lambda x: ck.softmax(x), lambda: (randn(64, 5000, grad=True),), True, 0),
    "cross_entropy": (lambda x: ck.cross_entropy(x, (x[:, 0].float().abs() * 100).long() % x.shape[1]),
                      lambda: (randn(128, 32000, grad=True),), True, 0),
    "fused_linear_cross_entropy": (_flce, lambda: (randn(256, 512, grad=True), (randn(8000, 512) / 8).requires_grad_()),
                                   True, 0),
    "fused_linear_cross_entropy_per_token": (_flce_per_token, lambda: (randn(1100, 256, grad=True),
                                                                       (randn(3000, 256) / 8).requires_grad_()),
                                             True, 0),
    "flash_attn": (_attention, lambda: (randn(2, 300, 8, 128, grad=True), randn(2, 300, 2, 128, grad=True),
                                        randn(2, 300, 2, 128, grad=True)), True, 2e-3),
    "flash_attn_varlen": (_varlen, lambda: (randn(300, 4, 64), randn(300, 4, 64), randn(300, 4, 64), _offsets()),
                          False, 0),
    "gemm": (lambda a, b: ck.gemm(a, b), lambda: (randn(200, 512), randn(512, 384)), False, 0),
    "gemm_fp8": (_fp8, lambda: (randn(256, 512), randn(512, 256)), False, 0),
    "int8": (_int8, lambda: (randn(64, 1024), randn(512, 1024)), False, 0),
    "nvfp4": (_nvfp4, lambda: (randn(16, 1024), randn(512, 1024)), False, 0),
}


def _run(fn, inputs, backward):
    out = fn(*inputs)
    outs = list(out) if isinstance(out, tuple) else [out]
    if backward:
        leaves = [t for t in inputs if t.requires_grad]
        loss = sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs))
        outs += list(torch.autograd.grad(loss, leaves))
    return outs


@pytest.mark.parametrize("name", list(CASES))
def test_captured_and_replayed_on_new_values(name):
    fn, make, backward, tolerance = CASES[name]
    static = make()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: kernels compiled and loaded before the capture
        _run(fn, static, backward)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _run(fn, static, backward)
    for _ in range(2):
        fresh = make()
        with torch.no_grad():
            for dst, src in zip(static, fresh):
                dst.copy_(src)
        graph.replay()
        expected = _run(fn, fresh, backward)
        for got, want in zip(captured, expected):
            assert not got.isnan().any()
            torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
