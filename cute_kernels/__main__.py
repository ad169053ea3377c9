"""``python -m cute_kernels``: the self-check.

With a GPU: runs every op on random data against its float64 reference and prints a table
(op, shape, dtype, max relative error, our time, torch's time, ratio).
Without one: compiles the kernels for sm_90a and reports what the PTX contains.
The exit code is non-zero if anything fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from .runtime import CuteKernelsError, has_gpu, inspect_kernel


def _families():
    from .gemm import op as gemm_op
    from .rowwise import cross_entropy_op, norm_op, softmax_op

    return [softmax_op, norm_op, cross_entropy_op, gemm_op]


def _time_ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def run_on_gpu() -> int:
    print(f"GPU: {torch.cuda.get_device_name()}")
    header = f"{'op':16s} {'shape':>14s} {'dtype':9s} {'max rel err':>11s} {'ours ms':>8s} {'torch ms':>8s} {'ratio':>6s}  status"
    print(header)
    print("-" * len(header))
    failures = 0
    for family in _families():
        for check in family.self_checks():
            try:
                ours = check.ours()
                error = check.error(ours)
                ok = error <= check.tolerance
                t_ours, t_torch = _time_ms(check.ours), _time_ms(check.torch)
                status = "ok" if ok else f"FAIL (tolerance {check.tolerance:.1e})"
                print(f"{check.op:16s} {check.shape:>14s} {check.dtype:9s} {error:11.2e} "
                      f"{t_ours:8.3f} {t_torch:8.3f} {t_torch / t_ours:5.2f}x  {status}")
            except Exception as exc:  # report and continue: the table shows every op
                ok = False
                print(f"{check.op:16s} {check.shape:>14s} {check.dtype:9s} ERROR {type(exc).__name__}: {exc}")
            failures += not ok
    return failures


def _describe(config) -> str:
    if config is None:  # a kernel with nothing to configure
        return "-"
    if isinstance(config, int):  # a kernel configured by one number (the column sum's width)
        return str(config)
    fields = []
    for key, value in vars(config).items():
        if hasattr(value, "__dataclass_fields__"):
            fields.append(_describe(value))
        elif not isinstance(value, bool) or value:
            fields.append(key if isinstance(value, bool) else f"{key}={value}")
    return ", ".join(fields)


def compile_only(everything: bool) -> int:
    print("No CUDA GPU found: compiling every kernel for sm_90a and reading its PTX instead.")
    print(f"{'kernel':16s} {'config':66s} {'regs':>4s} {'spill':>5s} {'wgmma':>5s} {'tma':>5s}  secs")
    failures = 0
    for family in _families():
        for kernel, config, specs in family.compile_configurations(quick=not everything):
            label = _describe(config)
            try:
                report = inspect_kernel(kernel, config, specs, arch="sm_90a")
            except CuteKernelsError as exc:
                print(f"{kernel.__name__:16s} {label:66s} FAILED: {exc}")
                failures += 1
                continue
            summary = report.summary()
            spills = report.spill_stores + report.spill_loads
            failures += report.local_memory or bool(report.wgmma_serialized)
            print(f"{kernel.__name__:16s} {label:66s} {report.registers:4d} {spills:5d} "
                  f"{str(summary['wgmma']):>5s} {str(summary['tma']):>5s}  {report.seconds:.1f}")
            for remark in report.wgmma_serialized:
                print(f"    ptxas: {remark}")
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cute_kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90a even with a GPU")
    parser.add_argument("--all", action="store_true", help="compile every configuration, not a sample")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if has_gpu() and not args.compile_only:
        failures = run_on_gpu()
    else:
        os.environ.setdefault("CUTE_KERNELS_ARCH", "sm_90a")
        failures = compile_only(args.all)
    print(f"\n{'FAILED' if failures else 'passed'}: {failures} failure(s) in {time.perf_counter() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
