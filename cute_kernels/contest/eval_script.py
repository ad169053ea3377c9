"""The evaluation script of a contest run: ``python eval.py test|benchmark|leaderboard CASEFILE``.

The harness copies this file into a flat run folder as ``eval.py``, next to the problem's
``reference.py`` / ``task.py`` and the ``submission.py`` under test, and runs it with
``POPCORN_FD`` (the write end of a pipe) and, for a secret run, ``POPCORN_SEED``. It needs only
the standard library and torch, so a bundled submission runs without cute_kernels installed.

The protocol is the public leaderboards': a worker process (spawn) imports the submission once
and serves every case; per case ``generate_input(**case)`` -> ``custom_kernel(clone(data))`` ->
``check_implementation(data, out)``; benchmark and leaderboard modes first make an untimed
warm-up pass over the first case (up to 100 repeats or 0.1 s / 0.01 s of timed calls), then
time each case until the mean is known to 0.1%, the timed calls add up to 10 s / 30 s, or 120 s
have passed; results go to POPCORN_FD as ``key: value`` lines
(``test.i.status``, ``benchmark.i.mean`` in nanoseconds, ..., then ``check: pass|fail``). Unlike the
upstream script, anything a submission does -- an exception of any type, a crash of the worker,
a hang past the case timeout, a multi-line message -- fails that case only: the worker is
replaced and the output format stays intact.

Exit codes: 0 pass, 112 a case failed, 111 no POPCORN_FD, 2 bad arguments, 113 a bad case line.
"""

import math
import multiprocessing
import os
import sys
import time

CASE_TIMEOUT_S = {"test": 120.0, "benchmark": 180.0, "leaderboard": 300.0}
BUDGET_S = {"benchmark": 10.0, "leaderboard": 30.0}  # timed (kernel) seconds per case
WARMUP_BUDGET_S = {"benchmark": 0.1, "leaderboard": 0.01}  # the warm-up pass over the first case
WARMUP_REPEATS = 100
MAX_REPEATS = {"benchmark": 100, "leaderboard": 1000}
WALL_S = 120.0  # per case, timing loop included
L2_CLEAR_BYTES = 256 * 1024 * 1024
RECHECK_SEED_STEP = 13


def one_line(text) -> str:
    """A message safe for one ``key: value`` line."""
    return " | ".join(str(text).strip().splitlines()) or "(no message)"


def cantor(a: int, b: int) -> int:
    return (a + b) * (a + b + 1) // 2 + b


def parse_cases(path):
    cases = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            case = {}
            for part in line.strip().split(";"):
                if not part.strip():
                    continue
                key, sep, value = part.partition(":")
                if not sep or not key.strip():
                    raise ValueError(f"case line {number}: expected 'key: value', got {part.strip()!r}")
                case[key.strip()] = _scalar(value.strip())
            cases.append(case)
    return cases


def _scalar(text):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


# ----------------------------------------------------------------------------- worker side

_modules = {}


def _import():
    if not _modules:
        import reference
        from submission import custom_kernel

        _modules.update(reference=reference, custom_kernel=custom_kernel)
    return _modules["reference"], _modules["custom_kernel"]


def _clone(data):
    import torch

    if isinstance(data, torch.Tensor):
        return data.clone()
    if isinstance(data, (tuple, list)):
        return type(data)(_clone(x) for x in data)
    if isinstance(data, dict):
        return {k: _clone(v) for k, v in data.items()}
    return data


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _check(case):
    """One correctness check: (ok, message)."""
    reference, custom_kernel = _import()
    data = reference.generate_input(**case)
    out = custom_kernel(_clone(data))
    _sync()
    return _verdict(reference.check_implementation(data, out))


def _verdict(result):
    """check_implementation's answer as (ok, message): ``(ok, msg)``, or a message alone
    (empty when right), as some references return."""
    if isinstance(result, tuple):
        ok, message = result[0], result[1] if len(result) > 1 else ""
    else:
        ok, message = not result, result
    return bool(ok), one_line(message) if message else ""


def worker_test(case):
    try:
        return _check(case)
    except BaseException as exc:  # the case fails, the worker lives on
        return False, one_line(f"{type(exc).__name__}: {exc}")


def worker_benchmark(case, mode, warmup=False):
    """(ok, message or stats): a check, then timed repeats (leaderboard: each on fresh inputs,
    checked; benchmark: the same inputs every repeat). ``warmup``: the untimed pass the
    upstream scripts make over the first case before any case is timed (fewer repeats, a
    shorter budget; its statistics are dropped)."""
    try:
        import torch

        ok, message = _check(case)
        if not ok:
            return False, message
        reference, custom_kernel = _import()
        cuda = torch.cuda.is_available()
        scratch = torch.empty(L2_CLEAR_BYTES // 4, device="cuda") if cuda else None
        recheck = mode == "leaderboard" and not warmup
        budget_ns = (WARMUP_BUDGET_S if warmup else BUDGET_S)[mode] * 1e9
        data = reference.generate_input(**case)
        durations, started = [], time.perf_counter()
        for repeat in range(WARMUP_REPEATS if warmup else MAX_REPEATS[mode]):
            if recheck:  # fresh inputs each repeat, each one checked against an untouched copy
                fresh = dict(case, seed=case.get("seed", 0) + RECHECK_SEED_STEP * (repeat + 1))
                data = reference.generate_input(**fresh)
                expected_from = _clone(data)
            if cuda:
                torch.cuda.synchronize()
                scratch.normal_()  # clears L2
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = custom_kernel(data)
                end.record()
                torch.cuda.synchronize()
                durations.append(start.elapsed_time(end) * 1e6)
            else:
                t0 = time.perf_counter_ns()
                out = custom_kernel(data)
                durations.append(float(time.perf_counter_ns() - t0))
            if recheck:
                ok, message = _verdict(reference.check_implementation(expected_from, out))
                if not ok:
                    return False, one_line(f"recheck {repeat}: {message}")
            del out
            n = len(durations)
            if n >= 3:  # the upstream rule: a precise mean, the timed budget, or the wall limit
                mean = sum(durations) / n
                std = math.sqrt(sum((d - mean) ** 2 for d in durations) / (n - 1))
                if (std / math.sqrt(n) < 0.001 * mean or mean * n > budget_ns
                        or time.perf_counter() - started > WALL_S):
                    break
        n = len(durations)
        mean = sum(durations) / n
        std = math.sqrt(sum((d - mean) ** 2 for d in durations) / (n - 1)) if n > 1 else 0.0
        return True, {"runs": n, "mean": mean, "std": std, "err": std / math.sqrt(n),
                      "best": min(durations), "worst": max(durations)}
    except BaseException as exc:
        return False, one_line(f"{type(exc).__name__}: {exc}")


def serve(conn):
    """The worker's loop: (function name, arguments) in, its result out, until None."""
    while True:
        message = conn.recv()
        if message is None:
            return
        name, args = message
        conn.send(globals()[name](*args))


# ----------------------------------------------------------------------------- driver side

class WorkerDied(Exception):
    pass


class Worker:
    """One spawned process that imports the submission once and serves every case; replaced
    when it dies or hangs (multiprocessing's Pool would wait forever for a dead worker's task)."""

    def __init__(self):
        self.context = multiprocessing.get_context("spawn")
        self.start()

    def start(self):
        self.conn, child = self.context.Pipe()
        self.process = self.context.Process(target=serve, args=(child,), daemon=True)
        self.process.start()
        child.close()

    def call(self, name, args, timeout):
        self.conn.send((name, args))
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.05):
            if not self.process.is_alive():
                code = self.process.exitcode
                self.restart()
                raise WorkerDied(f"the worker process died (exit code {code})")
            if time.monotonic() > deadline:
                self.restart()
                raise TimeoutError(f"timed out after {timeout:g} s")
        try:
            return self.conn.recv()
        except (EOFError, OSError) as exc:
            self.restart()
            raise WorkerDied(f"the worker process died ({exc})") from exc

    def restart(self):
        self.process.kill()
        self.process.join()
        self.start()

    def close(self):
        try:
            self.conn.send(None)
            self.process.join(timeout=5)
        except OSError:
            pass
        if self.process.is_alive():
            self.process.kill()


def main(argv) -> int:
    if len(argv) != 3 or argv[1] not in ("test", "benchmark", "leaderboard"):
        print("usage: eval.py test|benchmark|leaderboard CASEFILE", file=sys.stderr)
        return 2
    fd = os.environ.get("POPCORN_FD")
    if not fd:
        print("POPCORN_FD is not set", file=sys.stderr)
        return 111
    mode = argv[1]
    try:
        cases = parse_cases(argv[2])
    except (OSError, ValueError) as exc:
        print(one_line(exc), file=sys.stderr)
        return 113
    secret = os.environ.get("POPCORN_SEED")
    if secret:
        cases = [dict(c, seed=cantor(int(c["seed"]), int(secret))) if "seed" in c else c for c in cases]
    out = os.fdopen(int(fd), "w", buffering=1)
    worker = Worker()
    passed = True
    prefix = "test" if mode == "test" else "benchmark"
    out.write(f"{prefix}-count: {len(cases)}\n")
    timeout = float(os.environ.get("CONTEST_CASE_TIMEOUT", CASE_TIMEOUT_S[mode]))
    if mode != "test" and cases:  # warm-up: the first case, untimed (its failure is the case's)
        try:
            worker.call("worker_benchmark", (cases[0], mode, True), timeout)
        except (TimeoutError, WorkerDied):
            pass
        except Exception:
            worker.restart()
    for i, case in enumerate(cases):
        out.write(f"{prefix}.{i}.spec: " + "; ".join(f"{k}: {v}" for k, v in case.items()) + "\n")
        try:
            if mode == "test":
                ok, detail = worker.call("worker_test", (case,), timeout)
            else:
                ok, detail = worker.call("worker_benchmark", (case, mode), timeout)
        except (TimeoutError, WorkerDied) as exc:
            ok, detail = False, one_line(exc)
        except Exception as exc:  # e.g. a result that does not pickle
            ok, detail = False, one_line(f"worker failed: {type(exc).__name__}: {exc}")
            worker.restart()
        passed = passed and ok
        if mode == "test":
            out.write(f"test.{i}.status: {'pass' if ok else 'fail'}\n")
            if detail:
                out.write(f"test.{i}.{'message' if ok else 'error'}: {detail}\n")
        elif ok:
            for key in ("runs", "mean", "std", "err", "best", "worst"):
                out.write(f"benchmark.{i}.{key}: {detail[key]}\n")
        else:
            out.write(f"benchmark.{i}.status: fail\n")
            out.write(f"benchmark.{i}.error: {detail}\n")
    out.write(f"check: {'pass' if passed else 'fail'}\n")
    out.close()
    worker.close()
    return 0 if passed else 112


if __name__ == "__main__":
    sys.exit(main(sys.argv))
