"""Run one GEMM configuration (checked against cuBLAS, then timed) in this process.

    python benchmarks/experiment_gemm.py TILE_M TILE_N WARPGROUPS CLUSTER_M [M N K]
"""

import sys

import torch

from cute_kernels.gemm.config import GemmConfig
from cute_kernels.gemm.kernel_sm90 import GemmSm90
from cute_kernels.gemm.op import _operand_spec
from cute_kernels.runtime import ScalarSpec, StreamSpec, get_kernel

tm, tn, wg, cm = (int(v) for v in sys.argv[1:5])
m, n, k = (int(v) for v in sys.argv[5:8]) if len(sys.argv) > 7 else (4096, 4096, 4096)
a = torch.randn(1, m, k, device="cuda", dtype=torch.bfloat16)
b = torch.randn(1, k, n, device="cuda", dtype=torch.bfloat16)
d = torch.empty(1, m, n, device="cuda", dtype=torch.bfloat16)
cfg = GemmConfig(tm, tn, cm, 1, 8, 132 // cm, warpgroups=wg)
specs = (_operand_spec(a), _operand_spec(b), _operand_spec(d), None, None, None, None,
         ScalarSpec("float32"), ScalarSpec("float32"), StreamSpec())
fn = get_kernel(GemmSm90, cfg, specs)
fn(a, b, d, None, None, None, None, 1.0, 0.0)
torch.cuda.synchronize()
ref = torch.matmul(a, b)
err = (d.float() - ref.float()).abs().max().item()
times = []
for _ in range(20):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); fn(a, b, d, None, None, None, None, 1.0, 0.0); e.record(); torch.cuda.synchronize()
    times.append(s.elapsed_time(e))
tc = []
for _ in range(20):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); torch.matmul(a, b); e.record(); torch.cuda.synchronize()
    tc.append(s.elapsed_time(e))
ours, cub = sorted(times)[10], sorted(tc)[10]
fl = 2 * m * n * k / 1e9
print(f"cfg {tm}x{tn} wg{wg} c{cm} {m}x{n}x{k}: err {err:.3g}  ours {fl / ours:.0f} TFLOP/s  cublas {fl / cub:.0f}  ratio {cub / ours:.3f}")
