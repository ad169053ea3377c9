"""Every public op traced by torch.compile (fullgraph, forward and backward) on the meta device,
over changing shapes: torch turns the sizes (and float arguments) symbolic after the first
change, and the Python around the custom ops must trace with them. The ops' CUDA checks are
lifted and their fake implementations run (no GPU, no kernel); the GPU tests check the values.
"""

import importlib

import pytest
import torch

import cute_kernels as ck

BF16 = torch.bfloat16
CHECKED_MODULES = ("attention.op", "attention.packed", "gemm.op", "quant.int8", "quant.nvfp4",
                   "quant.nvfp4_gemm", "rowwise.softmax_op", "rowwise.cross_entropy_op",
                   "rowwise.norm_op", "losses.fused_linear_cross_entropy")


@pytest.fixture
def on_meta(monkeypatch):
    def check_tensor(name, t, dtypes, like=None):
        if dtypes is not None and t.dtype not in dtypes:
            raise TypeError(f"{name}: {t.dtype}")

    for name in CHECKED_MODULES:
        monkeypatch.setattr(importlib.import_module(f"cute_kernels.{name}"), "check_tensor", check_tensor)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def meta(*shape, dtype=BF16, grad=True):
    return torch.empty(shape, device="meta", dtype=dtype, requires_grad=grad)


def targets(*shape):
    return torch.empty(shape, device="meta", dtype=torch.long)


def _norms(x, w, b, r, eps, layer_norm):
    y, h = (ck.layer_norm(x, w, b, eps=eps, residual=r) if layer_norm
            else ck.rms_norm(x, w, eps, residual=r, bias=b))
    return y.float().sum() + h.float().sum()


def _norm_case(shape, wshape, layer_norm=False):
    return (meta(*shape), meta(*wshape, dtype=torch.float32), meta(*wshape, dtype=torch.float32),
            meta(*shape), 1e-5 if shape[0] % 2 else 1e-6, layer_norm)


def _int8(a, b):
    qa, sa, _ = ck.quantize_int8(a)
    qb, sb, _ = ck.quantize_int8(b)
    return ck.gemm_int8(qa, qb, scale_a=sa, scale_b=sb)


def _w4a16(x, w):
    return ck.gemm_w4a16(x, *ck.nvfp4_quantize(w))


def _w4a4(a, b):
    pa, sa, ga = ck.nvfp4_quantize(a)
    pb, sb, gb = ck.nvfp4_quantize(b)
    return ck.gemm_nvfp4(pa, pb, sa, sb, alpha=ga * gb)


# op: (function, argument makers, one per call). Norm shapes: RMSNorm per row and per head
# (the (1, 1, H, D) case after a (B, S, H, D) one), then LayerNorm; all with a residual.
CASES = {
    "norms": (_norms, [lambda: _norm_case((3, 256), (256,)), lambda: _norm_case((199, 512), (512,)),
                       lambda: _norm_case((2, 16, 4, 64), (4, 64)),
                       lambda: _norm_case((1, 1, 32, 128), (32, 128)),
                       lambda: _norm_case((5, 9, 96), (96,), True)]),
    "softmax": (lambda x: ck.softmax(x).float().sum(), [lambda: (meta(4, 256),), lambda: (meta(7, 512),),
                                                        lambda: (meta(3, 5, 1024),)]),
    "cross_entropy": (lambda x, t: ck.cross_entropy(x, t, label_smoothing=0.1),
                      [lambda: (meta(4, 256), targets(4)),
                       lambda: (meta(7, 1000), targets(7)),
                       lambda: (meta(2, 9, 32000), targets(2, 9))]),
    "cross_entropy_weighted_smoothing": (
        lambda x, t, w: sum(ck.cross_entropy(x, t, weight=w, label_smoothing=0.1, softcap=20.0,
                                             lse_square_scale=1e-4, return_z_loss=True)),
        [lambda: (meta(4, 256), targets(4), meta(256, dtype=torch.float32, grad=False)),
         lambda: (meta(7, 1000), targets(7), meta(1000, dtype=torch.float32, grad=False))]),
    "fused_linear_cross_entropy": (
        lambda h, w, t, b: ck.fused_linear_cross_entropy(h, w, t, b),
        [lambda: (meta(64, 256), meta(1024, 256), targets(64), None),
         lambda: (meta(2, 50, 256), meta(2048, 256), targets(2, 50), meta(2048)),
         lambda: (meta(37, 512), meta(1000, 512), targets(37), None)]),
    "fused_linear_cross_entropy_per_token": (
        lambda h, w, t: (ck.fused_linear_cross_entropy(h, w, t, reduction="none", softcap=30.0).sum()
                         + ck.fused_linear_cross_entropy(h, w, t, ce_weight=w[:, 0].float())
                         + ck.fused_linear_cross_entropy(h, w, t, ce_weight=w[:, 1].float(),
                                                         label_smoothing=0.1, softcap=20.0)),
        [lambda: (meta(64, 256), meta(1024, 256), targets(64)),
         lambda: (meta(2, 50, 256), meta(2048, 256), targets(2, 50))]),
    "gemm": (lambda a, b: ck.gemm(a, b).float().sum(), [lambda: (meta(128, 64), meta(64, 256)),
                                                        lambda: (meta(200, 128), meta(128, 512))]),
    "flash_attn": (lambda q, k, v: ck.flash_attn(q, k, v, causal=True).float().sum(),
                   [lambda: (meta(2, 128, 4, 64), meta(2, 128, 2, 64), meta(2, 128, 2, 64)),
                    lambda: (meta(1, 200, 4, 64), meta(1, 200, 2, 64), meta(1, 200, 2, 64))]),
    "flash_attn_padded_head_dims": (
        lambda q, k, v: ck.flash_attn(q, k, v, causal=True).float().sum(),
        [lambda: (meta(2, 128, 4, 80), meta(2, 128, 2, 80), meta(2, 128, 2, 80)),
         lambda: (meta(1, 200, 4, 192), meta(1, 200, 2, 192), meta(1, 200, 2, 128))]),
    "int8": (_int8, [lambda: (meta(128, 64, grad=False), meta(256, 64, grad=False)),
                     lambda: (meta(200, 128, grad=False), meta(512, 128, grad=False))]),
    "nvfp4": (lambda a, b: (_w4a16(a, b), _w4a4(a, b)),
              [lambda: (meta(16, 512, grad=False), meta(256, 512, grad=False)),
               lambda: (meta(7, 256, grad=False), meta(512, 256, grad=False))]),
}


@pytest.mark.parametrize("op", list(CASES))
def test_traces_over_changing_shapes(on_meta, op):
    fn, makers = CASES[op]
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for make in makers:
        args = make()
        with torch._dynamo.config.patch(recompile_limit=len(makers)):
            out = compiled(*args)
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if leaves:
            grads = torch.autograd.grad(out, leaves)
            assert [g.shape for g in grads] == [a.shape for a in leaves]
