"""The contest harness's benchmark mode against ``benchmarks/``'s timing, same kernels and shapes.

For each problem folder: the harness's ``benchmark`` mode with the problem's submission (the
public protocol: a fresh worker, a warm-up pass, one call per repeat after a synchronize and an
L2-clearing write), then, in this process, ``harness.bench`` on the same submission's
``custom_kernel`` over L2-cold input sets made by the problem's own ``generate_input`` for each
benchmark case (calls back to back, median). Prints both and their ratio per case:

    python benchmarks/contest_agreement.py gemm/matmul attention/flash_attn_fwd

Where a kernel runs for less than a call's host time (a few tens of microseconds), the two
measure different things -- back-to-back calls are bound by the host, the harness's single
call is not -- and the ratio says so rather than anything about the kernel.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import bench, make_input_sets  # noqa: E402

from cute_kernels.contest import harness as contest  # noqa: E402
from cute_kernels.contest.taskfile import parse_case  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def problem_modules(folder: Path):
    """The problem's ``reference`` and its submission's ``custom_kernel``, imported from the
    folder (its ``task.py`` importable as ``task``, as the harness's run folder has it)."""
    for name in ("task", "reference", "submission"):
        sys.modules.pop(name, None)
    sys.path.insert(0, str(folder))
    try:
        modules = {}
        for name in ("task", "reference", "submission"):
            spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            modules[name] = module
        return modules["reference"], modules["submission"].custom_kernel
    finally:
        sys.path.remove(str(folder))


def input_bytes(data) -> int:
    if isinstance(data, torch.Tensor):
        return data.numel() * data.element_size()
    if isinstance(data, (tuple, list)):
        return sum(input_bytes(x) for x in data)
    if isinstance(data, dict):
        return sum(input_bytes(x) for x in data.values())
    return 0


def agreement(folder: Path, reps: int = 100) -> list:
    """[(case spec, harness mean us, harness best us, benchmarks/ median us, ratio)]."""
    (run,) = contest.run(folder, "benchmark")
    if not run.passed:
        raise SystemExit(f"{folder}: the harness's benchmark mode failed: {run.stderr[-2000:]}")
    reference, custom_kernel = problem_modules(folder)
    rows = []
    for case in run.cases:
        args = parse_case(case.spec)
        seed = args.pop("seed", 0)
        counter = iter(range(1_000_000))

        def make():
            return (reference.generate_input(**args, seed=seed + next(counter)),)

        sets = make_input_sets(make, input_bytes(make()))
        median_ms = min(bench(custom_kernel, sets, reps=reps) for _ in range(3))
        ours_us = case.mean_ns / 1e3
        rows.append((case.spec, ours_us, case.stats.get("best", 0.0) / 1e3, median_ms * 1e3,
                     ours_us / (median_ms * 1e3)))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("problems", nargs="+", help="problem folders, e.g. gemm/matmul")
    args = parser.parse_args()
    for name in args.problems:
        folder = Path(name) if Path(name).is_absolute() else ROOT / name
        print(f"{name}: harness mean / best, benchmarks/ median, ratio")
        for spec, mean, best, median, ratio in agreement(folder):
            print(f"  {spec:80s} {mean:10.1f} / {best:10.1f} us  {median:10.1f} us  {ratio:6.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
