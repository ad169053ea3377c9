"""The contest harness on the CPU: task files, case files, the output protocol, scoring, and
submissions that are right, wrong, broken, crashing or hanging."""

import math
import textwrap

import pytest

from cute_kernels.contest import bundle as bundle_module
from cute_kernels.contest import harness
from cute_kernels.contest.taskfile import TaskFileError, format_case, parse_case, parse_task, read_task

TASK = """\
# A problem in the public format.
files:
  - {"name": "submission.py", "source": "@SUBMISSION@"}
  - {"name": "task.py", "source": "task.py"}
  - {"name": "reference.py", "source": "reference.py"}
  - {"name": "eval.py", "source": "../eval.py"}
description: |
  Double a vector.

  Input: a float32 tensor.
tests:
  - {"size": 7, "seed": 1}
  - {"size": 128, "seed": 2}
  - size: 1000
    seed: 3
benchmarks:
  - {"size": 4096, "seed": 10}
  - {"size": 65536, "seed": 11}
ranking_by: "geom"
"""

REFERENCE = """\
import torch

def generate_input(size, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, generator=g)

def ref_kernel(data):
    return data * 2

def check_implementation(data, out):
    ref = ref_kernel(data)
    if out.shape != ref.shape:
        return False, f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    if not torch.allclose(out, ref, rtol=1e-5, atol=1e-8):
        return False, f"max error {(out - ref).abs().max().item():.3e}"
    return True, ""
"""

SUBMISSIONS = {
    "good": "def custom_kernel(data):\n    return data * 2\n",
    "wrong": "def custom_kernel(data):\n    return data * 3\n",
    "broken": ("def custom_kernel(data):\n"
               "    raise RuntimeError('line one\\nline two: with a colon')\n"),
    "wrong_shape": "def custom_kernel(data):\n    return data[:1] * 2\n",
    "crash": ("import os\n"
              "def custom_kernel(data):\n"
              "    if data.numel() == 128:\n"
              "        os._exit(3)\n"
              "    return data * 2\n"),
    "needs_package": ("import cute_kernels\n"
                      "def custom_kernel(data):\n"
                      "    return data * 2\n"),
    "hang": ("import time\n"
             "def custom_kernel(data):\n"
             "    if data.numel() == 128:\n"
             "        time.sleep(600)\n"
             "    return data * 2\n"),
}


@pytest.fixture(scope="module")
def problem(tmp_path_factory):
    folder = tmp_path_factory.mktemp("double")
    (folder / "task.yml").write_text(TASK)
    (folder / "task.py").write_text("import torch\ninput_t = torch.Tensor\noutput_t = torch.Tensor\n")
    (folder / "reference.py").write_text(REFERENCE)
    for name, text in SUBMISSIONS.items():
        (folder / f"{name}.py").write_text(text)
    (folder / "submission.py").write_text(SUBMISSIONS["good"])
    return folder


def test_task_file_subset():
    task = parse_task(TASK)
    assert task["tests"][2] == {"size": 1000, "seed": 3}
    assert task["description"].startswith("Double a vector.\n\nInput")
    assert task["files"][0] == {"name": "submission.py", "source": "@SUBMISSION@"}
    assert task["ranking_by"] == "geom"
    with pytest.raises(TaskFileError, match="task.yml:2"):
        parse_task("tests:\n  just text\n  - {a: 1}\n")


def test_case_lines_round_trip():
    case = {"size": 4096, "seed": 10, "dtype": "bfloat16", "scale": 0.5, "causal": True}
    assert parse_case(format_case(case)) == case
    with pytest.raises(TaskFileError):
        format_case({"name": "a;b"})
    with pytest.raises(TaskFileError):
        parse_case("size 12; seed: 1")


def test_output_lines_parse_even_when_cut_short():
    text = "test-count: 3\ntest.0.spec: size: 7\ntest.0.status: pass\ntest.1.spec: size: 8\n"
    cases, check = harness.parse_output(text, "test")
    assert [c.ok for c in cases] == [True, False, False] and check == "missing"
    assert cases[2].error == "no result"


def test_score_by_ranking():
    run = harness.RunResult("benchmark", None, 0, [
        harness.CaseResult("a", True, mean_ns=1e3), harness.CaseResult("b", True, mean_ns=4e3)], "pass")
    assert run.score("last") == pytest.approx(4e-6)
    assert run.score("geom") == pytest.approx(math.sqrt(4) * 1e-6)
    assert run.score("mean") == pytest.approx(2.5e-6)


def _test_run(problem, name, **kw):
    (result,) = harness.run(problem, "test", problem / f"{name}.py", **kw)
    return result


def test_a_right_submission_passes(problem):
    result = _test_run(problem, "good")
    assert result.passed and result.exit_code == 0 and result.check == "pass"
    assert [c.spec for c in result.cases] == [format_case(c) for c in read_task(problem)["tests"]]


def test_a_wrong_answer_is_caught(problem):
    result = _test_run(problem, "wrong")
    assert not result.passed and result.exit_code == 112 and result.check == "fail"
    assert all(not c.ok and "max error" in c.error for c in result.cases)
    shape = _test_run(problem, "wrong_shape")
    assert all("shape" in c.error for c in shape.cases)


def test_an_exception_with_a_multi_line_message_keeps_the_format(problem):
    result = _test_run(problem, "broken")
    assert result.check == "fail" and len(result.cases) == 3
    assert all(c.error.startswith("RuntimeError: line one | line two: with a colon") for c in result.cases)


def test_a_crashing_worker_fails_its_case_only(problem):
    result = _test_run(problem, "crash")
    assert [c.ok for c in result.cases] == [True, False, True]
    assert "worker" in result.cases[1].error and result.check == "fail"


def test_a_hanging_submission_times_out(problem):
    result = _test_run(problem, "hang", case_timeout=10)
    assert [c.ok for c in result.cases] == [True, False, True]
    assert "timed out" in result.cases[1].error


def test_hide_package_makes_cute_kernels_unimportable(problem):
    assert _test_run(problem, "needs_package").passed
    hidden = _test_run(problem, "needs_package", hide_package=True)
    assert not hidden.passed and all(not c.ok for c in hidden.cases)
    assert "hidden" in hidden.stderr + " ".join(c.error for c in hidden.cases)
    assert _test_run(problem, "good", hide_package=True).passed


def test_benchmark_and_leaderboard_modes(problem):
    (bench,) = harness.run(problem, "benchmark")
    assert bench.passed and all(c.mean_ns > 0 and c.stats["runs"] >= 3 for c in bench.cases)
    runs = harness.run(problem, "leaderboard", secret_seed=12345)
    assert [r.mode for r in runs] == ["test", "benchmark", "leaderboard"] * 2
    assert [r.seed for r in runs] == [None] * 3 + [12345] * 3
    summary = harness.report(runs, "geom")
    assert summary["passed"] and summary["score_s"] > 0
    # A failing submission stops at its first failing step.
    runs = harness.run(problem, "leaderboard", problem / "wrong.py")
    assert [r.mode for r in runs] == ["test"] and not harness.report(runs, "geom")["passed"]



def test_benchmark_mode_warms_up_on_the_first_case_untimed(problem, tmp_path):
    # The upstream scripts time nothing before an untimed pass over the first case; the other
    # cases get their check and their timed repeats only.
    log = tmp_path / "calls.txt"
    counting = tmp_path / "counting.py"
    counting.write_text("def custom_kernel(data):\n"
                        f"    with open({str(log)!r}, 'a') as f:\n"
                        "        f.write(str(data.numel()) + '\\n')\n"
                        "    return data * 2\n")
    (bench,) = harness.run(problem, "benchmark", counting)
    assert bench.passed
    sizes = [int(line) for line in log.read_text().split()]
    first, second = (int(c.stats["runs"]) for c in bench.cases)
    assert sizes[0] == 4096 and sizes[-1] == 65536
    assert sizes.count(4096) >= (1 + 3) + (1 + first)  # warm-up: a check and >= 3 repeats
    assert sizes.count(65536) == 1 + second

def test_cli_writes_a_table_and_json(problem, tmp_path, capsys):
    out = tmp_path / "result.json"
    code = harness.main(["test", str(problem), "--submission", str(problem / "wrong.py"), "--json", str(out)])
    assert code == 1 and "FAIL" in capsys.readouterr().out
    assert '"passed": false' in out.read_text()


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
PROBLEMS = sorted(p.parent for p in ROOT.glob("*/*/task.yml"))


def test_the_problem_folders_are_complete():
    assert {p.parent.name for p in PROBLEMS} >= {"gemm", "attention"}
    for folder in PROBLEMS:
        task = read_task(folder)
        assert task["tests"] and task["benchmarks"], folder
        for name in ("task.py", "reference.py", "submission.py", "baseline.py"):
            source = (folder / name).read_text()
            compile(source, str(folder / name), "exec")
        submission = (folder / "submission.py").read_text()
        assert "import cute_kernels" in submission and "def custom_kernel" in submission, folder
        assert "def custom_kernel" in (folder / "baseline.py").read_text(), folder
        reference = (folder / "reference.py").read_text()
        for fn in ("generate_input", "ref_kernel", "check_implementation"):
            assert f"def {fn}" in reference, (folder, fn)
        for case in task["tests"] + task["benchmarks"]:
            assert "seed" in case, (folder, case)
            assert parse_case(format_case(case)) == case


def _import_bundle(folder, tmp_path, code="import submission"):
    """Run ``code`` in a fresh interpreter, in a folder holding the bundle as submission.py
    and the problem's task.py, with cute_kernels made unimportable."""
    import subprocess
    import sys

    from cute_kernels.contest.bundle import bundle

    run_dir = tmp_path / folder.name
    run_dir.mkdir()
    bundle(folder / "submission.py", run_dir / "submission.py")
    (run_dir / "task.py").write_text((folder / "task.py").read_text())
    script = "import sys; sys.modules['cute_kernels'] = None\n" + code
    # the interpreter's own path minus the folder holding cute_kernels (the DSL may come from
    # PYTHONPATH, as on the GPU machine: it stays importable)
    path = [p for p in sys.path if p and not (__import__("pathlib").Path(p) / "cute_kernels").exists()]
    env = dict(__import__("os").environ, CUTE_KERNELS_ARCH="sm_90a", PYTHONPATH=":".join(path))
    proc = subprocess.run([sys.executable, "-c", script], cwd=run_dir, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir, proc.stdout


@pytest.mark.parametrize("folder", PROBLEMS, ids=[f"{p.parent.name}/{p.name}" for p in PROBLEMS])
def test_every_bundle_imports_without_cute_kernels(folder, tmp_path):
    run_dir, out = _import_bundle(folder, tmp_path, "import submission\nprint(submission.custom_kernel)")
    text = (run_dir / "submission.py").read_text()
    directives = [line for line in (folder / "submission.py").read_text().splitlines()
                  if line.startswith("#!POPCORN")]
    assert text.splitlines()[:len(directives)] == directives
    imports = [n for n in __import__("ast").walk(__import__("ast").parse(text))
               if type(n).__name__ in ("Import", "ImportFrom")]
    names = [a.name for n in imports for a in n.names] + [getattr(n, "module", None) or "" for n in imports]
    assert not any(name.split(".")[0] == "cute_kernels" for name in names)
    assert "<function custom_kernel" in out


def test_a_bundle_resolves_a_function_scope_package_import(tmp_path):
    # softmax_op's kernel builder imports the kernel classes inside a function, under names a
    # module-level function also has nearby: the bundle must reach the classes, not the function.
    code = textwrap.dedent("""\
        import torch
        import submission as s
        for kernels, name in ((s.cute_kernels_rowwise_softmax_op___forward_kernels, "SoftmaxFwdSm90"),
                              (s.cute_kernels_rowwise_softmax_op___backward_kernels, "SoftmaxBwdSm90")):
            dtypes = (torch.bfloat16,) * kernels.build.tensors_held
            kernel_class, _, _ = kernels.build(dtypes + (4096,), 8)
            assert kernel_class.__name__.endswith(name), kernel_class
        print("resolved")
    """)
    _, out = _import_bundle(ROOT / "attention" / "softmax", tmp_path, code)
    assert "resolved" in out


def test_bundler_refuses_one_name_imported_from_two_places(tmp_path):
    source = textwrap.dedent("""\
        def f():
            from .gemm import gemm as op
            return op
        def g():
            from .attention import flash_attn as op
            return op
    """)
    with pytest.raises(bundle_module.BundleError, match="imported from two places"):
        bundle_module.Module("cute_kernels.example", source, "example.py")


@pytest.mark.compile
def test_a_bundle_compiles_its_kernels_from_its_own_source(tmp_path):
    # The DSL re-reads each jit function's source: it must find it in the flattened file.
    folder = ROOT / "attention" / "flash_attn_fwd"
    code = textwrap.dedent("""\
        import submission as s
        cfg = s.cute_kernels_attention_config__attention_fwd_config(
            128, local=True, softcap=False, varlen=False, max_seqlen_k=1024)
        specs = s.cute_kernels_attention_op__kernel_specs("bfloat16", 128, False)
        report = s.cute_kernels_runtime_compile__inspect_kernel(
            s.cute_kernels_attention_fwd_sm90__FlashAttnFwdSm90, cfg, specs, arch="sm_90a")
        assert report.has("wgmma.mma_async") and not report.local_memory, report.summary()
        print("compiled")
    """)
    _, out = _import_bundle(folder, tmp_path, code)
    assert "compiled" in out


def test_acceptance_spreads_problems_over_gpus_heaviest_first():
    import importlib.util

    spec = importlib.util.spec_from_file_location("contest_acceptance", ROOT / "benchmarks" / "contest_acceptance.py")
    acceptance = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(acceptance)
    folders = acceptance.problems([])
    shares = acceptance.spread(folders, 4)
    assert sorted(p for share in shares for p in share) == sorted(folders)  # each problem once
    loads = [sum(acceptance.GROUP_WEIGHT.get(p.parent.name, 1) for p in share) for share in shares]
    assert max(loads) - min(loads) <= max(acceptance.GROUP_WEIGHT.values())
    assert all(share and share[0].parent.name == "attention" for share in shares)
    assert acceptance.spread(folders, 1) == [sorted(folders, key=lambda p: -acceptance.GROUP_WEIGHT.get(p.parent.name, 1))]
