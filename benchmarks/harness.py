"""The one benchmark harness every ``bench_<family>.py`` uses.

* Inputs are rotated through enough copies that each call finds its operands cold in L2.
* Each call is timed with CUDA events; the statistic is the median.
* The same run measures the ceilings (device copy bandwidth, bf16 matmul rate) and times the
  peers that import (torch eager, torch.compile, quack, ...), so ratios compare like with like.
* Results merge into ``benchmarks/results/<gpu>.json`` (one row per family/op/shape/dtype).
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
L2_BYTES = 50 * 2**20  # H100 / H200


def gpu_kind() -> str:
    name = torch.cuda.get_device_name().lower()
    for kind in ("h200", "h100", "b200", "a100"):
        if kind in name:
            return kind
    return name.replace(" ", "_")


def make_input_sets(make: Callable[[], tuple], bytes_per_set: int, min_sets: int = 2) -> list:
    """Enough independent input sets that cycling through them keeps L2 cold (>= 3x L2)."""
    count = max(min_sets, -(-3 * L2_BYTES // max(bytes_per_set, 1)))
    return [make() for _ in range(min(count, 64))]


# GPU cycles of the wait queued ahead of each timed call by ``bench(..., device_only=True)``:
# ~0.55 ms at 1.8 GHz, beyond every call's host time measured on the device's hosts (quack's
# gemm_w4a16 takes 80-150 us; a 200k-cycle wait let part of it into its readings).
HIDE_HOST_CYCLES = 1_000_000


def bench(fn: Callable, input_sets: Sequence[tuple], warmup: int = 5, reps: int = 30,
          device_only: bool = False) -> float:
    """Median milliseconds of ``fn(*inputs)`` over ``reps`` calls, rotating the input sets.

    A call shorter than its own host time finds the GPU idle, so its reading is host time plus
    GPU time. ``device_only`` queues a GPU wait (``torch.cuda._sleep``) ahead of each timed
    call, so that the call's host work happens while the GPU is busy and the reading is its GPU
    time alone -- what the contest harness and ``triton.testing.do_bench`` measure (their L2
    flush plays the wait's part); report the host time beside it (``host_us``)."""
    for i in range(warmup):
        fn(*input_sets[i % len(input_sets)])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        inputs = input_sets[i % len(input_sets)]
        if device_only:
            torch.cuda._sleep(HIDE_HOST_CYCLES)
        starts[i].record()
        fn(*inputs)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def kernel_profile(fn: Callable, args: tuple, calls: int = 1, rows: int = 12) -> None:
    """Print the CUDA kernels of ``calls`` calls of ``fn(*args)`` grouped by name, microseconds
    per call, largest first (torch profiler)."""
    from collections import defaultdict

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(*args)
        torch.cuda.synchronize()
    totals, counts = defaultdict(float), defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:90]] += event.device_time_total / calls
            counts[event.name[:90]] += 1
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:rows]:
        print(f"{us:10.1f} us/call  x{counts[name] // calls:<4} {name}")


def bench_many(fns: dict, input_sets: Sequence[tuple], rounds: int = 3, reps: int = 20,
               device_only: bool = False) -> dict:
    """Median milliseconds of each candidate, measured in interleaved rounds whose order rotates
    and turns round every other round (a, b, c, d; then a, d, c, b; c, d, a, b; ...), so that
    clock and thermal drift fall on all of them alike, none is always the first after a
    cool-down, and none always follows the same candidate (a rotation alone keeps each one's
    predecessor: a fast kernel timed right after a slow, cool one starts at higher clocks every
    round); each round's median, then the median over rounds."""
    per_round = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in (order if r % 2 == 0 else order[::-1]):
            per_round[name].append(bench(fns[name], input_sets, warmup=3, reps=reps,
                                         device_only=device_only))
    return {name: statistics.median(times) for name, times in per_round.items()}


def autograd_grad(forward: Callable) -> Callable:
    """A candidate that times a backward as users run it: ``torch.autograd.grad`` of
    ``forward(*leaves)`` with respect to every leaf that is not None (weight gradients
    included), given the output gradient last. The forward is recorded once per input set (the
    graph kept with ``retain_graph``) and is not timed."""
    graphs = {}

    def run(*inputs):
        *leaves, dy = inputs
        key = tuple(t.data_ptr() for t in leaves if t is not None)
        if key not in graphs:
            grads = [None if t is None else t.detach().requires_grad_() for t in leaves]
            graphs[key] = (forward(*grads), [g for g in grads if g is not None])
        y, grads = graphs[key]
        return torch.autograd.grad(y, grads, dy, retain_graph=True)

    return run


def usable(fn: Callable, *args) -> bool:
    """Whether a peer runs on these arguments; one that does not support the case is left out
    of the row (its error printed to stderr)."""
    try:
        fn(*args)
        torch.cuda.synchronize()
        return True
    except Exception as exc:
        print(f"[peer skipped: {type(exc).__name__}: {str(exc)[:120]}]", file=sys.stderr)
        return False


def host_us(fns: dict, *args, calls: int = 3000) -> dict:
    """Host time per call (us) of each function on ``args``, after a warm-up, with the GPU work
    queued behind (what a call costs where the CPU is the limit)."""
    import time

    host = {}
    for name, fn in fns.items():
        for _ in range(200):
            fn(*args)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        host[name] = (time.perf_counter() - start) / calls * 1e6
        torch.cuda.synchronize()
    return host


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def tflops(flops: float, ms: float) -> float:
    return flops / ms / 1e9


def ceilings() -> dict:
    """Device copy bandwidth (read + write) and bf16 matmul rate, measured now."""
    n = 1 << 28  # 512 MiB of bf16
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    copy = gbps(2 * n * 2, bench(dst.copy_, [(src,)], reps=20))
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench(torch.matmul, [(a, b)], reps=20)
    return {"copy_GBps": round(copy, 1), "bf16_mm_TFLOPs": round(tflops(2 * 8192**3, ms), 1)}


def try_import(name: str):
    try:
        return __import__(name, fromlist=["_"])
    except Exception as exc:  # a peer that does not import is simply not measured
        print(f"[peer {name} unavailable: {type(exc).__name__}: {exc}]", file=sys.stderr)
        return None


def versions() -> dict:
    import cutlass

    return {"dsl": cutlass.__version__, "torch": torch.__version__}


def _rounded(value: float) -> float:
    """A rate kept to 0.1 or to 4 significant digits, whichever is finer: a decode GEMM's 2.66
    TFLOP/s rounded to 2.7 would turn a 1.01x ratio into 1.04x."""
    return float(f"{value:.4g}") if abs(value) < 1000 else round(value, 1)


class Results:
    """Rows of one GPU kind's results file, merged by (family, op, shape, dtype)."""

    def __init__(self, path: Path | None = None):
        self.path = path or RESULTS / f"{gpu_kind()}.json"
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {"rows": []}

    def start(self, ceil: dict) -> None:
        self.data.update(
            device=torch.cuda.get_device_name(),
            date=datetime.date.today().isoformat(),
            ceilings=ceil,
            **versions(),
        )

    def add(self, family, op, shape, dtype, metric, ours, peers: dict, **extra) -> dict:
        row = {
            "family": family,
            "op": op,
            "shape": "x".join(str(d) for d in shape),
            "dtype": str(dtype).removeprefix("torch."),
            "metric": metric,
            "ours": _rounded(ours),
            "peers": {k: _rounded(v) for k, v in peers.items() if v is not None},
            "date": self.data.get("date") or datetime.date.today().isoformat(),
            **extra,
        }
        key = (row["family"], row["op"], row["shape"], row["dtype"])
        rows = [r for r in self.data["rows"] if (r["family"], r["op"], r["shape"], r["dtype"]) != key]
        self.data["rows"] = rows + [row]
        ratios = "  ".join(f"{k} {v:.1f} ({ours / peers[k]:.2f}x)" for k, v in row["peers"].items() if v)
        print(f"{op:22s} {row['shape']:>14s} {row['dtype']:9s} ours {row['ours']:8.1f} {metric}  {ratios}")
        return row

    def set_section(self, name: str, value) -> None:
        self.data[name] = value

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1) + "\n")
        out = os.environ.get("OUT")
        if out:
            Path(out, self.path.name).write_text(self.path.read_text())
