"""What ``python -m cute_kernels`` runs: the self-check and ``precompile``.

The self-check, with a GPU, runs every op on random data against its float64 reference and
prints a table (op, shape, dtype, max relative error, our time, torch's time, ratio). Without
one, it compiles a sample of kernel configurations for sm_90a (in parallel processes, one per
CPU up to 8) and reports what the PTX holds; the reports are kept in the disk cache, so a
second run reads them instead of compiling.

``precompile`` compiles, in parallel processes, every configuration the heuristics can return
(and, with ``--from``, the kernels a recorded workload used) into the disk cache, where a GPU
of the same arch loads them instead of compiling.
"""

from __future__ import annotations

import dataclasses
import os
import textwrap
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

FAMILY_MODULES = {
    "softmax": "cute_kernels.rowwise.softmax_op",
    "norms": "cute_kernels.rowwise.norm_op",
    "cross_entropy": "cute_kernels.rowwise.cross_entropy_op",
    "gemm": "cute_kernels.gemm.op",
    "attention": "cute_kernels.attention.op",
    "int8": "cute_kernels.quant.int8",
    "nvfp4": "cute_kernels.quant.nvfp4",
}
# What each family's PTX must hold: the GEMM and attention run on wgmma fed by TMA; the row
# kernels use neither (plain vector loads and warp reductions), so there an absent instruction
# is expected.
TENSOR_CORE_FAMILIES = ("gemm", "attention", "int8")
TABLE_WIDTH = 100
MAX_COLUMNS = 120  # no line of the self-check is wider


def _wrapped(text: str) -> str:
    """``text`` folded to ``MAX_COLUMNS``, continuation lines indented."""
    return textwrap.fill(text, MAX_COLUMNS, subsequent_indent="    ", break_long_words=True)


def family_module(name: str):
    import importlib

    return importlib.import_module(FAMILY_MODULES[name])


# ----------------------------------------------------------------------------- config labels


def config_label(config) -> str:
    """A short name for a kernel configuration: the fields that differ from their defaults."""
    if config is None:
        return "-"
    if not dataclasses.is_dataclass(config):
        return str(config)
    label = getattr(config, "label", None)
    parts = [label] if isinstance(label, str) else []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(label, str) and field.name in config.label_fields:
            continue
        if dataclasses.is_dataclass(value):
            inner = config_label(value)
            if inner and inner != "-":
                parts.append(inner)
        elif field.default is not dataclasses.MISSING and value == field.default:
            continue
        elif value is True:
            parts.append(field.name)
        elif value is not False:
            parts.append(f"{field.name}={value}")
    return " ".join(parts)


# ----------------------------------------------------------------------------- self-check


def _time_ms(fn, reps: int = 20) -> float:
    import torch

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


def check_on_gpu() -> int:
    import torch

    print(f"GPU: {torch.cuda.get_device_name()}")
    header = (f"{'op':16s} {'shape':>14s} {'dtype':9s} {'max rel err':>11s} {'ours ms':>8s} "
              f"{'torch ms':>8s} {'speedup':>7s}  status")
    print(header)
    print("-" * len(header))
    failures = 0
    for name in FAMILY_MODULES:
        for check in family_module(name).self_checks():
            try:
                ours = check.ours()
                error = check.error(ours)
                ok = error <= check.tolerance
                t_ours, t_torch = _time_ms(check.ours), _time_ms(check.torch)
                status = "ok" if ok else f"FAIL (tolerance {check.tolerance:.1e})"
                print(f"{check.op:16s} {check.shape:>14s} {check.dtype:9s} {error:11.2e} "
                      f"{t_ours:8.3f} {t_torch:8.3f} {t_torch / t_ours:6.2f}x  {status}")
            except Exception as exc:  # report and continue: the table shows every op
                ok = False
                print(_wrapped(f"{check.op:16s} {check.shape:>14s} {check.dtype:9s} ERROR "
                               f"{type(exc).__name__}: {exc}"))
            failures += not ok
    return failures


def _mark(present: bool, expected: bool) -> str:
    if present:
        return "✓"
    return "✗" if expected else "–"


CHECK_JOBS = 8  # the self-check's processes at most (each holds the DSL: ~0.7 GB)
# The running self-check's kernels, (family, kernel class, config, specs): its worker
# processes, forked, find them here by index (a kernel class need not pickle).
_CHECK_PLAN: list = []


def _inspect_chunk(indices: list) -> list:
    """Worker: (index, the report's facts as a dict, or the compile error's text) for each
    kernel of ``_CHECK_PLAN`` at ``indices`` (reports kept in the disk cache)."""
    from .runtime import CuteKernelsError, inspect_kernel

    found = []
    for index in indices:
        _, kernel, config, specs = _CHECK_PLAN[index]
        try:
            report = inspect_kernel(kernel, config, specs, arch="sm_90a", cache=True)
        except CuteKernelsError as exc:
            found.append((index, str(exc)))
            continue
        found.append((index, {
            "cached": report.cached, "registers": report.registers,
            "spills": report.spill_stores + report.spill_loads,
            "local_memory": report.local_memory, "serialized": tuple(report.wgmma_serialized),
            "wgmma": report.has("wgmma.mma_async"), "tma": report.has("cp.async.bulk.tensor"),
            "seconds": report.seconds,
        }))
    return found


def check_compile_only(everything: bool, jobs: int | None = None) -> int:
    import multiprocessing

    print("No CUDA GPU: compiling kernels for sm_90a and reading their PTX instead.")
    _CHECK_PLAN[:] = [(name, kernel, config, specs) for name in FAMILY_MODULES
                      for kernel, config, specs
                      in family_module(name).compile_configurations(quick=not everything)]
    indices = list(range(len(_CHECK_PLAN)))
    jobs = max(1, min(jobs or min(default_jobs(), CHECK_JOBS), len(indices)))
    if jobs == 1:
        results = dict(_inspect_chunk(indices))
    else:  # round-robin chunks in forked processes (the slow GEMM and attention kernels spread)
        print(f"({len(indices)} kernels, {jobs} processes)")
        results = {}
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            for future in as_completed([pool.submit(_inspect_chunk, indices[j::jobs])
                                        for j in range(jobs)]):
                results.update(future.result())
    print(f"{'family':13s} {'kernel':18s} {'configuration':38s} {'regs':>4s} {'spill':>5s} "
          f"{'wgmma':>5s} {'tma':>3s} {'secs':>5s}")
    print("-" * TABLE_WIDTH)
    failures = cached = 0
    for index, (name, kernel, config, _) in enumerate(_CHECK_PLAN):
        # a family's helper kernels without GEMMs (attention's preprocess) say so
        tensor_cores = getattr(kernel, "tensor_cores", name in TENSOR_CORE_FAMILIES)
        label = config_label(config)
        if len(label) > 38:
            label = label[:37] + "…"
        report = results[index]
        if isinstance(report, str):
            print(_wrapped(f"{name:13s} {kernel.__name__:18s} {label:38s} FAILED: {report}"))
            failures += 1
            continue
        cached += report["cached"]
        wgmma, tma = report["wgmma"], report["tma"]
        bad = report["local_memory"] or bool(report["serialized"]) or (
            tensor_cores and not (wgmma and tma))
        failures += bad
        secs = "disk" if report["cached"] else f"{report['seconds']:5.1f}"
        print(f"{name:13s} {kernel.__name__:18s} {label:38s} {report['registers']:4d} "
              f"{report['spills']:5d} {_mark(wgmma, tensor_cores):>5s} "
              f"{_mark(tma, tensor_cores):>3s} {secs:>5s}" + ("  FAIL" if bad else ""))
        for remark in report["serialized"]:
            print(_wrapped(f"    ptxas: {remark}"))
    _CHECK_PLAN.clear()
    print("-" * TABLE_WIDTH)
    print("wgmma / tma: ✓ in the PTX; – not used by this family (row-wise kernels run on plain "
          "vector\nloads and warp reductions); ✗ missing where required (a failure). A row fails "
          "on any spill,\nlocal memory or serialized wgmma. secs: compile time, or 'disk' for a "
          f"report kept from an\nearlier run ({cached} this time; the cache is keyed by the "
          "package's source).")
    return failures


# ----------------------------------------------------------------------------- precompile


def precompile_plan(families, recorded: str | None) -> list:
    """(kernel class, config, specs, arch) for every configuration of ``families`` and every
    line of the ``recorded`` file, without duplicates."""
    from .runtime.compile import parse_record_line

    plan, seen = [], set()
    for name in families:
        for kernel, config, specs in family_module(name).compile_configurations(quick=False):
            plan.append((kernel, config, tuple(specs), None))
    if recorded:
        stale = 0
        with open(recorded) as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    plan.append(parse_record_line(line))
                except Exception:  # a kernel or config that no longer exists: nothing to build
                    stale += 1
        if stale:
            print(f"note: {stale} line(s) of {recorded} name kernels or configurations this "
                  f"version does not have (a record from older code); skipped")
    unique = []
    for item in plan:
        key = repr(item[:3])
        if key not in seen:
            seen.add(key)
            unique.append(item)
    return unique


def _precompile_chunk(items: list, arch: str) -> list:
    """Worker: compile ``items`` (indices and (kernel, config, specs)) into the disk cache."""
    from .runtime.compile import KERNELS

    results = []
    for index, (kernel, config, specs) in items:
        start = time.perf_counter()
        compiles = KERNELS.stats.compiles
        try:
            KERNELS.get(kernel, config, specs, arch)
            status = "compiled" if KERNELS.stats.compiles > compiles else "cached"
        except Exception as exc:  # report every failure, keep going
            status = f"FAILED {type(exc).__name__}: {exc}"
        results.append((index, status, time.perf_counter() - start))
    return results


def precompile(arch: str, cache_dir: str | None, families, recorded: str | None, jobs: int) -> int:
    os.environ["CUTE_KERNELS_ARCH"] = arch
    if cache_dir:
        os.environ["CUTE_KERNELS_CACHE_DIR"] = cache_dir
    os.environ.pop("CUTE_KERNELS_DISK_CACHE", None)
    os.environ.pop("CUTE_KERNELS_RECORD", None)
    from .runtime.compile import cache_folder

    start = time.perf_counter()
    plan = precompile_plan(families, recorded)
    for _, _, _, planned_arch in plan:
        if planned_arch not in (None, arch):
            print(f"note: a recorded kernel was for {planned_arch}; compiling it for {arch}")
            break
    items = [(i, item[:3]) for i, item in enumerate(plan)]
    jobs = max(1, min(jobs, len(items)))
    # Round-robin chunks: the GEMM configurations (slow to compile) spread over every worker.
    chunks = [items[j::jobs] for j in range(jobs)]
    print(f"precompiling {len(items)} kernels for {arch} into {cache_folder()} with {jobs} processes")
    failures = counts = 0
    done = {"compiled": 0, "cached": 0}
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(_precompile_chunk, chunk, arch) for chunk in chunks]
        for future in as_completed(futures):
            for index, status, seconds in future.result():
                counts += 1
                if status in done:
                    done[status] += 1
                else:
                    failures += 1
                    kernel, config, _ = items[index][1]
                    print(_wrapped(f"  {kernel.__name__} {config_label(config)}: {status}"))
    print(f"{done['compiled']} compiled, {done['cached']} already cached, {failures} failed "
          f"in {time.perf_counter() - start:.0f} s")
    return failures


def default_jobs() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def main_check(compile_only: bool, everything: bool) -> int:
    from .runtime import has_gpu

    start = time.perf_counter()
    if has_gpu() and not compile_only:
        failures = check_on_gpu()
    else:
        os.environ.setdefault("CUTE_KERNELS_ARCH", "sm_90a")
        failures = check_compile_only(everything)
    print(f"\n{'FAILED' if failures else 'passed'}: {failures} failure(s) in "
          f"{time.perf_counter() - start:.0f} s")
    return 1 if failures else 0

