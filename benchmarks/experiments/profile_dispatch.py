"""Break the host time of a tiny softmax call into its steps (run on a GPU machine)."""

import time

import torch

import cute_kernels as ck
from cute_kernels.rowwise import softmax_op as so


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
ck.softmax(x)
fn = next(iter(so._forward_kernels.aligned.values()))
steps = {
    "torch.softmax": lambda: torch.softmax(x, -1),
    "torch.empty": lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device),
    "torch.empty_like": lambda: torch.empty_like(x),
    "is_compiling": lambda: torch.compiler.is_compiling(),
    "_validate": lambda: so._validate(x, -1, None),
    "x.stride()": lambda: x.stride(),
    "x.stride(0)": lambda: x.stride(0),
    "x.is_contiguous()": lambda: x.is_contiguous(),
    "x.element_size()": lambda: x.element_size(),
    "x.shape[1]": lambda: x.shape[1],
    "x.size(1)": lambda: x.size(1),
    "x.data_ptr()": lambda: x.data_ptr(),
    "x.requires_grad": lambda: x.requires_grad,
    "torch.is_grad_enabled()": lambda: torch.is_grad_enabled(),
    "compiled fn(x, y)": lambda: fn(x, y),
    "softmax_fwd op (eager bypass)": lambda: so.softmax_fwd(x, y),
    "_forward": lambda: so._forward(x, 1, None),
    "ck.softmax": lambda: ck.softmax(x),
}
for name, f in steps.items():
    print(f"{name:32s} {per_call(f):7.2f} us")
print("torch.Tensor has __dlpack_c_exchange_api__:", hasattr(torch.Tensor, "__dlpack_c_exchange_api__"))
