"""Running a problem folder the way the public leaderboards do.

A run copies the problem's files (``task.yml``'s ``files`` list, or every ``.py`` of the folder)
and the submission into one flat temporary folder, with ``eval_script.py`` as ``eval.py``; runs
``python submission.py`` once as the compile step (failures ignored, 120 s); then
``python eval.py MODE CASEFILE`` with ``POPCORN_FD`` set to a pipe, and reads the ``key: value``
lines back. ``leaderboard`` is the full submission: test -> benchmark -> leaderboard, stopping at
the first failure, twice: with the public seeds and with a secret seed combined into each case's.

The score of a benchmark or leaderboard run is the mean time per case in seconds, combined as
the task says (``ranking_by``: the last case, or the geometric mean).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .taskfile import TaskFileError, format_case, read_task

EVAL_SCRIPT = Path(__file__).with_name("eval_script.py")
COMPILE_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = {"test": 600.0, "benchmark": 900.0, "leaderboard": 1800.0}
MODES = ("test", "benchmark", "leaderboard")


@dataclass
class CaseResult:
    spec: str
    ok: bool
    error: str = ""
    mean_ns: float | None = None
    stats: dict = field(default_factory=dict)


@dataclass
class RunResult:
    mode: str
    seed: int | None  # the secret seed, None for the public run
    exit_code: int
    cases: list
    check: str  # "pass", "fail" or "missing" (the script died before writing it)
    stderr: str = ""

    @property
    def passed(self) -> bool:
        return self.exit_code == 0 and self.check == "pass" and all(c.ok for c in self.cases)

    def score(self, ranking_by: str) -> float | None:
        """Seconds: the last case's mean, or the geometric / arithmetic mean over cases."""
        means = [c.mean_ns * 1e-9 for c in self.cases if c.mean_ns is not None]
        if not means or len(means) != len(self.cases):
            return None
        if ranking_by == "last":
            return means[-1]
        if ranking_by == "geom":
            return math.exp(sum(math.log(m) for m in means) / len(means))
        return sum(means) / len(means)


def parse_output(text: str, mode: str) -> tuple[list, str]:
    """The POPCORN_FD lines of one run: (case results, check)."""
    values: dict = {}
    for line in text.splitlines():
        key, sep, value = line.partition(": ")
        if sep:
            values[key.strip()] = value.strip()
    prefix = "test" if mode == "test" else "benchmark"
    count = int(values.get(f"{prefix}-count", 0))
    cases = []
    for i in range(count):
        spec = values.get(f"{prefix}.{i}.spec", "")
        error = values.get(f"{prefix}.{i}.error", "")
        if mode == "test":
            status = values.get(f"test.{i}.status")
            cases.append(CaseResult(spec, status == "pass", error or ("no result" if status is None else "")))
            continue
        mean = values.get(f"benchmark.{i}.mean")
        if mean is None:
            cases.append(CaseResult(spec, False, error or "no result"))
            continue
        stats = {k: float(values[f"benchmark.{i}.{k}"]) for k in ("runs", "mean", "std", "err", "best", "worst")
                 if f"benchmark.{i}.{k}" in values}
        cases.append(CaseResult(spec, True, "", float(mean), stats))
    return cases, values.get("check", "missing")


def _copy_problem(problem: Path, run_dir: Path, submission: Path, task: dict) -> None:
    files = task.get("files")
    if files:
        for entry in files:
            name, source = entry["name"], entry["source"]
            if source == "@SUBMISSION@" or name == "eval.py":
                continue
            shutil.copy(problem / source, run_dir / name)
    else:
        for path in problem.glob("*.py"):
            if path.name not in ("submission.py", "eval.py"):
                shutil.copy(path, run_dir / path.name)
    shutil.copy(submission, run_dir / "submission.py")
    shutil.copy(EVAL_SCRIPT, run_dir / "eval.py")


def _read_all(fd: int, sink: list) -> None:
    with os.fdopen(fd, "r") as f:
        sink.append(f.read())


HIDDEN_PACKAGE = (
    'raise ImportError("cute_kernels is hidden in this run (--hide-package): a bundled '
    'submission must not need it")\n')


def run_mode(problem: Path, mode: str, submission: Path, secret_seed: int | None = None,
             timeout: float | None = None, case_timeout: float | None = None,
             hide_package: bool = False) -> RunResult:
    """One ``eval.py`` process for ``mode`` over the task's tests (test) or benchmarks. With
    ``hide_package`` a ``cute_kernels.py`` that raises ImportError shadows the package in the
    run folder (first on the path), as on a machine without it."""
    problem = Path(problem).resolve()
    task = read_task(problem)
    cases = task["tests"] if mode == "test" else task["benchmarks"]
    with tempfile.TemporaryDirectory(prefix="contest-") as tmp:
        run_dir = Path(tmp)
        _copy_problem(problem, run_dir, Path(submission).resolve(), task)
        (run_dir / "cases.txt").write_text("".join(format_case(c) + "\n" for c in cases))
        if hide_package:
            (run_dir / "cute_kernels.py").write_text(HIDDEN_PACKAGE)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(run_dir)] + [p for p in sys.path if p])
        try:
            subprocess.run([sys.executable, "submission.py"], cwd=run_dir, env=env,
                           timeout=COMPILE_TIMEOUT_S, capture_output=True)
        except subprocess.TimeoutExpired:
            pass  # the compile step's failures are ignored, as upstream
        read_fd, write_fd = os.pipe()
        env["POPCORN_FD"] = str(write_fd)
        if secret_seed is not None:
            env["POPCORN_SEED"] = str(secret_seed)
        if case_timeout is not None:
            env["CONTEST_CASE_TIMEOUT"] = str(case_timeout)
        sink: list = []
        reader = threading.Thread(target=_read_all, args=(read_fd, sink), daemon=True)
        reader.start()
        proc = subprocess.Popen([sys.executable, "eval.py", mode, "cases.txt"], cwd=run_dir, env=env,
                                pass_fds=(write_fd,), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        os.close(write_fd)
        try:
            _, stderr = proc.communicate(timeout=timeout or RUN_TIMEOUT_S[mode])
            code = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
            code, stderr = -9, (stderr or "") + f"\nthe run took longer than {timeout or RUN_TIMEOUT_S[mode]} s"
        reader.join(timeout=10)
    results, check = parse_output("".join(sink), mode)
    # Cases the script never reported (it died or was killed) count as failed.
    for case in cases[len(results):]:
        results.append(CaseResult(format_case(case), False, "no result (the evaluation stopped)"))
    return RunResult(mode, secret_seed, code, results, check, stderr[-4000:])


def run(problem: Path, mode: str, submission: Path | None = None, secret_seed: int | None = None,
        timeout: float | None = None, case_timeout: float | None = None,
        hide_package: bool = False) -> list:
    """``test`` or ``benchmark``: one run. ``leaderboard``: test -> benchmark -> leaderboard,
    stopping at the first failure, with the public seeds, then again with a secret seed."""
    problem = Path(problem)
    submission = Path(submission) if submission else problem / "submission.py"
    if mode != "leaderboard":
        return [run_mode(problem, mode, submission, secret_seed, timeout, case_timeout, hide_package)]
    runs = []
    secret = secret_seed if secret_seed is not None else random.randrange(1, 2**31)
    for seed in (None, secret):
        for step in MODES:
            result = run_mode(problem, step, submission, seed, timeout, case_timeout, hide_package)
            runs.append(result)
            if not result.passed:
                return runs
    return runs


def report(runs: list, ranking_by: str) -> dict:
    """A JSON-ready summary: every run's cases, pass / fail, and the score."""
    out = {"passed": all(r.passed for r in runs), "runs": []}
    for r in runs:
        out["runs"].append({
            "mode": r.mode, "secret_seed": r.seed, "exit_code": r.exit_code, "check": r.check,
            "passed": r.passed, "score_s": r.score(ranking_by) if r.mode != "test" else None,
            "cases": [{"spec": c.spec, "ok": c.ok, "error": c.error, "mean_ns": c.mean_ns, **c.stats}
                      for c in r.cases],
        })
    ranked = [r for r in runs if r.mode == "leaderboard" and r.passed]
    scores = [r.score(ranking_by) for r in ranked]
    out["score_s"] = scores[-1] if scores else None
    return out


def table(runs: list, ranking_by: str) -> str:
    lines = []
    for r in runs:
        seed = "public" if r.seed is None else f"secret {r.seed}"
        score = r.score(ranking_by) if r.mode != "test" else None
        head = f"{r.mode} ({seed}): {'pass' if r.passed else 'FAIL'}"
        if score is not None:
            head += f", score {score * 1e6:.3f} us ({ranking_by})"
        lines.append(head)
        for c in r.cases:
            timing = f"{c.mean_ns / 1e3:10.3f} us" if c.mean_ns is not None else " " * 13
            status = "pass" if c.ok else f"FAIL {c.error}"
            lines.append(f"  {c.spec:50s} {timing}  {status}")
        if not r.passed and r.check == "missing" and r.stderr:
            lines.append("  stderr: " + r.stderr.strip().splitlines()[-1][:200])
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bundle":
        return bundle_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m cute_kernels.contest",
                                     description="Run a contest problem folder as the leaderboards do "
                                                 "(or 'bundle PROBLEM_DIR -o FILE').")
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("problem", type=Path)
    parser.add_argument("--submission", type=Path, help="default: PROBLEM/submission.py")
    parser.add_argument("--seed", type=int, help="the secret seed (default: random)")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--timeout", type=float, help="seconds for each eval.py run")
    parser.add_argument("--case-timeout", type=float, help="seconds for each case")
    parser.add_argument("--hide-package", action="store_true",
                        help="make cute_kernels unimportable for the submission (a bundle's run)")
    args = parser.parse_args(argv)
    try:
        task = read_task(args.problem)
    except (OSError, TaskFileError) as exc:
        print(f"cannot read {args.problem}/task.yml: {exc}", file=sys.stderr)
        return 2
    runs = run(args.problem, args.mode, args.submission, args.seed, args.timeout, args.case_timeout,
               args.hide_package)
    print(table(runs, task["ranking_by"]))
    if args.json:
        args.json.write_text(json.dumps(report(runs, task["ranking_by"]), indent=1) + "\n")
    return 0 if all(r.passed for r in runs) else 1


def bundle_main(argv) -> int:
    """``bundle PROBLEM_DIR [--submission FILE] -o OUT``: one standalone submission file."""
    import argparse

    from .bundle import BundleError, bundle

    parser = argparse.ArgumentParser(prog="python -m cute_kernels.contest bundle")
    parser.add_argument("problem", type=Path)
    parser.add_argument("--submission", type=Path, help="default: PROBLEM/submission.py")
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        bundle(args.submission or args.problem / "submission.py", args.output)
    except (OSError, SyntaxError, BundleError) as exc:
        print(f"cannot bundle: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0
