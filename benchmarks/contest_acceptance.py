"""The contest problems' GPU acceptance, resumable in pieces that fit one device call.

For each problem folder (default: every ``*/*/task.yml`` of the repository) and each run kind:

  submission  ``leaderboard`` with the problem's submission.py (public and secret seeds)
  bundle      ``leaderboard`` with its bundle (built here) and cute_kernels hidden
  baseline    ``benchmark`` with its baseline.py

Each finished run is kept as OUT/<group>__<problem>.<kind>.json (the harness's report) and
skipped when the script runs again, so a later call picks up where the last one stopped;
``--budget`` stops starting runs once that many seconds have passed (a leaderboard of an
attention problem takes about five minutes). The summary compares each submission's benchmark
score with its baseline's:

    python benchmarks/contest_acceptance.py --out benchmarks/results/contest --budget 500

``--gpus N`` spreads the problems over N GPUs of one host, one worker process per GPU
(``CUDA_VISIBLE_DEVICES``): a problem's submission and baseline run on the same GPU, the
heaviest problems (attention, then quant) first, and every worker does the submissions and
baselines of its problems before their bundles.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cute_kernels.contest import harness  # noqa: E402
from cute_kernels.contest.bundle import bundle  # noqa: E402
from cute_kernels.contest.taskfile import read_task  # noqa: E402

KINDS = ("submission", "bundle", "baseline")
SECRET_SEED = 20261126


def problems(selected) -> list:
    found = sorted(p.parent for p in ROOT.glob("*/*/task.yml"))
    if selected:
        found = [p for p in found if f"{p.parent.name}/{p.name}" in selected or p.name in selected]
    return found


def _device_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:  # a torch without CUDA support
        return None


def run_one(problem: Path, kind: str, scratch: Path) -> dict:
    if kind == "submission":
        runs = harness.run(problem, "leaderboard", problem / "submission.py", SECRET_SEED)
    elif kind == "bundle":
        single = scratch / f"{problem.name}_bundle.py"
        bundle(problem / "submission.py", single)
        runs = harness.run(problem, "leaderboard", single, SECRET_SEED, hide_package=True)
    else:
        runs = harness.run(problem, "benchmark", problem / "baseline.py")
    report = harness.report(runs, read_task(problem)["ranking_by"])
    report["device"] = _device_name()
    report["table"] = harness.table(runs, read_task(problem)["ranking_by"])
    return report


def benchmark_score(report: dict | None, public: bool = True):
    """The score of the (public-seed) benchmark step of a report."""
    if report is None:
        return None
    for run in report["runs"]:
        if run["mode"] == "benchmark" and (run["secret_seed"] is None) == public:
            return run["score_s"]
    return None


def summary(out: Path, folders: list) -> str:
    lines = ["| problem | submission | bundle | sub. benchmark | baseline | baseline / sub. |",
             "|---|---|---|---|---|---|"]
    for problem in folders:
        name = f"{problem.parent.name}__{problem.name}"
        got = {}
        for kind in KINDS:
            path = out / f"{name}.{kind}.json"
            got[kind] = json.loads(path.read_text()) if path.exists() else None
        status = {k: "-" if got[k] is None else ("pass" if got[k]["passed"] else "FAIL") for k in KINDS}
        ours, base = benchmark_score(got["submission"]), benchmark_score(got["baseline"])
        ratio = f"{base / ours:.2f}x" if ours and base else "-"
        fmt = lambda s: "-" if s is None else f"{s * 1e6:.1f} us"  # noqa: E731
        lines.append(f"| {problem.parent.name}/{problem.name} | {status['submission']} | "
                     f"{status['bundle']} | {fmt(ours)} | {fmt(base)} | {ratio} |")
    return "\n".join(lines)


# Minutes one leaderboard run of a problem in the group took on an H100 (for spreading work).
GROUP_WEIGHT = {"attention": 4, "quant": 3, "gemm": 2}


def spread(folders: list, gpus: int) -> list:
    """The problems of each of ``gpus`` workers: heaviest first, each to the least loaded."""
    loads = [[0, []] for _ in range(gpus)]
    for problem in sorted(folders, key=lambda p: -GROUP_WEIGHT.get(p.parent.name, 1)):
        worker = min(loads, key=lambda w: w[0])
        worker[0] += GROUP_WEIGHT.get(problem.parent.name, 1)
        worker[1].append(problem)
    return [problems for _, problems in loads]


def run_workers(args, folders: list) -> None:
    """One process of this script per GPU, on its share of the problems: submissions and
    baselines first, then bundles, within the one ``--budget``."""
    kinds_first = [k for k in args.kinds if k != "bundle"]
    deadline = time.time() + args.budget
    procs = []
    for gpu, share in enumerate(spread(folders, args.gpus)):
        if not share:
            continue
        names = [f"{p.parent.name}/{p.name}" for p in share]
        steps = [kinds_first] + ([["bundle"]] if "bundle" in args.kinds else [])
        script = " && ".join(
            f"{sys.executable} {Path(__file__).resolve()} {' '.join(names)} --out {args.out} "
            f"--kinds {' '.join(kinds)} --deadline {deadline}" for kinds in steps if kinds)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu))
        procs.append(subprocess.Popen(["bash", "-c", script], env=env))
    for proc in procs:
        proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("problems", nargs="*", help="group/name or name (default: all)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS)
    parser.add_argument("--budget", type=float, default=float("inf"),
                        help="seconds after which no new run starts")
    parser.add_argument("--gpus", type=int, default=1, help="spread the problems over this many GPUs")
    parser.add_argument("--deadline", type=float, default=float("inf"),
                        help="(workers) the time.time() after which no new run starts")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    folders = problems(args.problems)
    if args.gpus > 1:
        run_workers(args, folders)
        print(summary(args.out, folders))
        return 0
    started = time.perf_counter()
    for problem in folders:
        for kind in args.kinds:
            path = args.out / f"{problem.parent.name}__{problem.name}.{kind}.json"
            if path.exists():
                continue
            if time.perf_counter() - started > args.budget or time.time() > args.deadline:
                print(f"budget spent: stopping before {problem.name} {kind}")
                print(summary(args.out, folders))
                return 0
            t0 = time.perf_counter()
            report = run_one(problem, kind, args.out)
            path.write_text(json.dumps(report, indent=1) + "\n")
            print(f"{problem.parent.name}/{problem.name} {kind}: "
                  f"{'pass' if report['passed'] else 'FAIL'} in {time.perf_counter() - t0:.0f} s", flush=True)
    print(summary(args.out, folders))
    return 0


if __name__ == "__main__":
    sys.exit(main())
