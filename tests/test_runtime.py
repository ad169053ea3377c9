"""The runtime without a GPU: import cost, the device rule, the disk cache of cross-compiled
kernels and recorded kernel lists."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import cute_kernels as ck
from cute_kernels.runtime import compile as kc
from cute_kernels.runtime.arch import constant_under_compile


def test_constant_mark_is_torchs_own():
    def f():
        return 1

    def g():
        return 1

    torch.compiler.assume_constant_result(f)
    constant_under_compile(g)
    assert {k: v for k, v in vars(f).items()} == {k: v for k, v in vars(g).items()} != {}


def test_import_pulls_in_no_compiler_machinery_and_no_kernel_module():
    # Kernel modules (the DSL classes) load at the first compile of their family.
    modules = ("torch._dynamo", "torch._inductor", "cute_kernels.gemm.kernel_sm90",
               "cute_kernels.rowwise.norm", "cute_kernels.rowwise.softmax",
               "cute_kernels.rowwise.cross_entropy")
    code = f"import sys, cute_kernels; print(sorted(m for m in {modules!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# ----------------------------------------------------------------------------- device rule


def test_functions_refuse_cpu_tensors():
    x, w = torch.randn(4, 8), torch.ones(8)
    t = torch.zeros(4, dtype=torch.long)
    for call in (lambda: ck.softmax(x), lambda: ck.rms_norm(x, w), lambda: ck.layer_norm(x, w),
                 lambda: ck.cross_entropy(x, t), lambda: ck.gemm(x.bfloat16(), x.t().bfloat16()),
                 lambda: ck.fused_linear_cross_entropy(x, torch.randn(5, 8), t)):
        with pytest.raises(ck.DeviceError):
            call()


def test_modules_follow_the_input_device():
    x = torch.randn(6, 8, requires_grad=True)
    residual = torch.randn(6, 8)
    rms, ln = ck.RMSNorm(8, eps=1e-6), ck.LayerNorm(8)
    torch.testing.assert_close(rms(x), torch.nn.RMSNorm(8, eps=1e-6)(x))
    torch.testing.assert_close(ln(x), torch.nn.LayerNorm(8)(x))
    y, h = rms(x, residual)
    torch.testing.assert_close(h, x + residual)
    torch.testing.assert_close(y, torch.nn.RMSNorm(8, eps=1e-6)(x + residual))
    t = torch.tensor([0, 3, -100, 7, 1, 2])
    torch.testing.assert_close(ck.CrossEntropyLoss()(x, t), F.cross_entropy(x, t))
    cw = torch.rand(8)
    torch.testing.assert_close(ck.CrossEntropyLoss(weight=cw)(x, t), F.cross_entropy(x, t, weight=cw))
    w, b = torch.randn(9, 8), torch.randn(9)
    loss = ck.FusedLinearCrossEntropyLoss(label_smoothing=0.1)(x, w, t, b)
    torch.testing.assert_close(loss, F.cross_entropy(x @ w.t() + b, t, label_smoothing=0.1))
    loss.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_modules_keep_the_z_loss_off_cuda(reduction):
    # the z-loss is not a torch option: the modules' torch path adds it (class dim 1, a class
    # weight, ignored rows), as the kernels do
    from cute_kernels.reference import cross_entropy_ref

    x = torch.randn(3, 7, 5) * 3 + 4  # (N, C, d): classes on dim 1
    t = torch.randint(0, 7, (3, 5))
    t[0, 1] = -100
    cw = torch.rand(7) + 0.5
    got = ck.CrossEntropyLoss(weight=cw, reduction=reduction, lse_square_scale=0.03)(x, t)
    want = cross_entropy_ref(x.movedim(1, -1).reshape(-1, 7), t.reshape(-1), reduction=reduction,
                             z=0.03, weight=cw)
    torch.testing.assert_close(got.double(), want.reshape(got.shape), rtol=1e-5, atol=1e-5)
    h, w = torch.randn(15, 8), torch.randn(7, 8)
    module = ck.FusedLinearCrossEntropyLoss(reduction=reduction, lse_square_scale=0.03, ce_weight=cw,
                                            softcap=2.0)
    want = cross_entropy_ref(2.0 * torch.tanh(h.double() @ w.double().t() / 2.0), t.reshape(-1),
                             reduction=reduction, z=0.03, weight=cw)
    torch.testing.assert_close(module(h, w, t.reshape(-1)).double(), want, rtol=1e-5, atol=1e-5)
    assert "ce_weight" in module.state_dict()


# ----------------------------------------------------------------------------- disk cache


def _small_kernel():
    from cute_kernels.rowwise.softmax_op import compile_configurations

    return min(compile_configurations(quick=True), key=lambda case: getattr(case[1], "n", 1 << 30))


def test_record_lines_round_trip():
    from cute_kernels.gemm import op as gemm_op
    from cute_kernels.rowwise import cross_entropy_op, norm_op

    cases = [_small_kernel(), gemm_op.compile_configurations(quick=True)[0],
             norm_op.compile_configurations(quick=True)[0],
             cross_entropy_op.compile_configurations(quick=True)[-1]]
    for kernel, config, specs in cases:
        line = kc.record_line(kernel, config, specs, "sm_90a")
        assert "\n" not in line
        assert kc.parse_record_line(line) == (kernel, config, tuple(specs), "sm_90a")


def test_record_lines_evaluate_nothing_but_configs():
    kernel, config, specs = _small_kernel()
    line = kc.record_line(kernel, config, specs, "sm_90a").split("\t")
    line[1] = "__import__('os').getcwd()"
    with pytest.raises(NameError):
        kc.parse_record_line("\t".join(line))


@pytest.mark.compile
def test_cross_compiled_kernels_land_in_the_disk_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CUTE_KERNELS_ARCH", "sm_90a")
    monkeypatch.delenv("CUTE_KERNELS_DISK_CACHE", raising=False)
    kernel, config, specs = _small_kernel()
    digest = kc.cache_key(kernel, config, specs, "sm_90a")
    fresh = kc.inspect_kernel(kernel, config, specs, arch="sm_90a", reuse=True)
    assert not fresh.cached and not list(kc.cache_folder().glob(f"{digest}.*"))  # nothing kept
    first = kc.inspect_kernel(kernel, config, specs, arch="sm_90a", cache=True)
    assert not first.cached and first.has("ld.global")
    assert (kc.cache_folder() / f"{digest}.o").stat().st_size > 0
    second = kc.inspect_kernel(kernel, config, specs, arch="sm_90a", cache=True)
    assert second.cached and second.registers == first.registers
    assert second.local_memory == first.local_memory
    assert second.has("wgmma.mma_async") == first.has("wgmma.mma_async")
    reused = kc.inspect_kernel(kernel, config, specs, arch="sm_90a", reuse=True)
    assert reused.cached and reused.ptx == first.ptx and reused.registers == first.registers
    # The object a GPU process would load: the cache hands it back without compiling.
    cache = kc.KernelCache()
    cache.get(kernel, config, specs, "sm_90a")
    assert cache.stats.compiles == 0 and cache.stats.disk_loads == 1


@pytest.mark.compile
def test_precompile_command_fills_the_cache_from_a_record(tmp_path):
    kernel, config, specs = _small_kernel()
    record = tmp_path / "kernels.txt"
    stale = "cute_kernels.rowwise.softmax.NoSuchKernel\tNoSuchConfig(n=1)\t()\tsm_90a"
    record.write_text(kc.record_line(kernel, config, specs, "sm_90a") + "\n" + stale + "\n")
    cache = tmp_path / "cache"
    run = subprocess.run(
        [sys.executable, "-m", "cute_kernels", "precompile", "--cache-dir", str(cache),
         "--families", "", "--from", str(record), "--jobs", "1"],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 compiled, 0 already cached, 0 failed" in run.stdout
    assert "1 line(s)" in run.stdout and "skipped" in run.stdout  # the stale line
    assert len(list(cache.rglob("*.o"))) == 1


@pytest.mark.compile
def test_self_check_table_reads_well(tmp_path, monkeypatch, capsys):
    from cute_kernels import commands

    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CUTE_KERNELS_ARCH", "sm_90a")
    small = _small_kernel()

    class Family:
        @staticmethod
        def compile_configurations(quick):
            return [small]

    monkeypatch.setattr(commands, "family_module", lambda name: Family)
    monkeypatch.setattr(commands, "FAMILY_MODULES", {"softmax": "unused"})
    assert commands.check_compile_only(everything=False) == 0
    first = capsys.readouterr().out
    assert commands.check_compile_only(everything=False) == 0  # the report kept on disk
    second = capsys.readouterr().out
    for out in (first, second):
        assert max(len(line) for line in out.splitlines()) <= commands.MAX_COLUMNS
        assert "✓ in the PTX; – not used" in out and " – " in out  # legend; row kernels: no wgmma
        assert "True" not in out and "False" not in out
    assert " disk" in second and "(1 this time" in second
    assert small[1].label in first  # the short configuration name


@pytest.mark.compile
def test_self_check_compiles_in_parallel_processes_and_keeps_the_order(tmp_path, monkeypatch, capsys):
    from cute_kernels import commands
    from cute_kernels.rowwise.softmax_op import compile_configurations

    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CUTE_KERNELS_ARCH", "sm_90a")
    two = sorted(compile_configurations(quick=True), key=lambda case: getattr(case[1], "n", 1 << 30))[:2]

    class Family:
        @staticmethod
        def compile_configurations(quick):
            return two

    monkeypatch.setattr(commands, "family_module", lambda name: Family)
    monkeypatch.setattr(commands, "FAMILY_MODULES", {"softmax": "unused"})
    assert commands.check_compile_only(everything=False, jobs=2) == 0
    out = capsys.readouterr().out
    assert "(2 kernels, 2 processes)" in out
    rows = [line for line in out.splitlines() if line.startswith("softmax ")]
    assert [r.split()[2] for r in rows] == [commands.config_label(c).split()[0] for _, c, _ in two]
    assert len(list(tmp_path.rglob("*.report.json"))) == 2  # the workers kept their reports


def test_wgmma_serialization_remarks_are_read_across_wrapped_lines():
    # ptxas's log as the DSL hands it over: each remark wrapped over indented lines
    log = (
        "          ptxas info    : (C7517) wgmma.wait_group is injected in around line 1207 by compiler to\n"
        "          allow use of registers defined by GMMA in function\n"
        "          'kernel_a'\n"
        "          ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are\n"
        "          serialized due to insufficient register resources for the wgmma pipeline in the function\n"
        "          'kernel_a'\n"
        "ptxas info    : Used 168 registers, used 1 barriers\n")
    remarks = kc.wgmma_serialized_remarks(log)
    assert remarks == ("(C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized "
                       "due to insufficient register resources for the wgmma pipeline in the function "
                       "'kernel_a'",)
    one_line = "ptxas info : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to the presence of Extern calls in the function 'k'\n"
    assert len(kc.wgmma_serialized_remarks(one_line)) == 1
    assert kc.wgmma_serialized_remarks(log.replace("serialized", "kept")) == ()
