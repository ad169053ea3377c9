"""Where the host time of a compiled-kernel call goes: TVM-FFI argument handling vs launch."""

import time

import cutlass
import cutlass.cute as cute
import torch

from cute_kernels.runtime import StreamSpec, Sym, TensorSpec, get_kernel


class Noop:
    def __init__(self, config):
        self.config = config

    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, stream):
        if cutlass.const_expr(self.config == "launch"):
            self.kernel(mX).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor):
        pass


def per_call(fn, calls=20000):
    for _ in range(500):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return t


x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(x)
spec = TensorSpec.rowmajor("bfloat16", (Sym("m"), 1024), 8)
for variant in ("no-launch", "launch"):
    fn = get_kernel(Noop, variant, (spec, spec, StreamSpec()))
    print(f"{variant:12s} {per_call(lambda: fn(x, y)):6.2f} us")
print(f"{'x.new_empty':12s} {per_call(lambda: x.new_empty(x.shape)):6.2f} us")
print(f"{'empty_like':12s} {per_call(lambda: torch.empty_like(x)):6.2f} us")
print(f"{'x.shape':12s} {per_call(lambda: x.shape):6.2f} us")
print(f"{'x.data_ptr':12s} {per_call(lambda: x.data_ptr()):6.2f} us")
print(f"{'x.stride(0)':12s} {per_call(lambda: x.stride(0)):6.2f} us")
print(f"{'x.is_cuda':12s} {per_call(lambda: x.is_cuda):6.2f} us")
print(f"{'x.dtype':12s} {per_call(lambda: x.dtype):6.2f} us")
print(f"{'pass':12s} {per_call(lambda: None):6.2f} us")
