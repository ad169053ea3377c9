"""Every kernel configuration compiled for sm_90a on this machine (no GPU needed), PTX read.

A configuration the self-check (``python -m cute_kernels``) compiled from the same source is
read from the disk cache, report and PTX, rather than compiled again."""

import re

import pytest

from cute_kernels.attention import op as attention_op
from cute_kernels.gemm import op as gemm_op
from cute_kernels.quant import int8 as int8_op
from cute_kernels.quant import nvfp4 as nvfp4_op
from cute_kernels.rowwise import cross_entropy_op, norm_op
from cute_kernels.rowwise.softmax_op import compile_configurations as softmax_configurations
from cute_kernels.runtime import inspect_kernel

pytestmark = pytest.mark.compile

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _id(case):
    kernel, config, specs = case
    dtypes = "-".join(s.dtype for s in specs if hasattr(s, "dtype"))
    if config is None or isinstance(config, int):
        return f"{kernel.__name__}-{config}-{dtypes}"
    rows = getattr(config, "row", config)
    flags = "+".join(k for k, v in vars(config).items() if v is True)
    return f"{kernel.__name__}-n{rows.n}-v{rows.vec}-c{rows.cluster_n}-{flags}-{dtypes}"


SOFTMAX = softmax_configurations()


@pytest.mark.parametrize("case", SOFTMAX, ids=[_id(c) for c in SOFTMAX])
def test_softmax_configuration_compiles_without_spills(case):
    kernel, config, specs = case
    report = inspect_kernel(kernel, config, specs, arch="sm_90a", reuse=True)
    assert not report.local_memory, f"local memory / spills: {report.summary()}"
    assert 0 < report.registers <= 255
    ptx = report.ptx
    access_bytes = [config.vec * ITEMSIZE[s.dtype] for s in specs if hasattr(s, "dtype")]
    if config.stage_smem:
        assert "cp.async.c" in ptx and "ld.global" not in ptx, "loads go through cp.async"
    elif min(access_bytes) >= 8:
        assert "ld.global.v" in ptx, "rows must be loaded in vectors"
    if min(access_bytes) >= 8:
        assert "st.global.v" in ptx, "rows must be stored in vectors"
    if max(access_bytes) == 16:
        assert ".global.v4" in ptx, "16-byte accesses expected"
    if config.cluster_n > 1:
        assert "st.async.shared::cluster" in ptx and "mbarrier" in ptx
    else:
        assert "st.async" not in ptx


NORMS = norm_op.compile_configurations()


@pytest.mark.parametrize("case", NORMS, ids=[_id(c) for c in NORMS])
def test_norm_configuration_compiles_without_spills(case):
    kernel, config, specs = case
    report = inspect_kernel(kernel, config, specs, arch="sm_90a", reuse=True)
    assert not report.local_memory, f"local memory / spills: {report.summary()}"
    if kernel.__name__ == "ColumnSumSm90":  # the column sums of the backward's partials
        assert "ld.global.v4" in report.ptx, "partial rows are read in 16-byte vectors"
        return
    rows = config.row
    if rows.cluster_n > 1:
        assert "st.async.shared::cluster" in report.ptx
    if kernel.__name__ == "NormBwdSm90" and rows.vec * 2 >= 4:
        assert "cp.async" in report.ptx, "the backward pipelines x and dy through shared memory"
    if kernel.__name__ == "NormFwdSm90" and config.stage_affine:
        copies = report.ptx.count("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes")
        assert copies == config.weight + config.bias, "one bulk copy per staged vector"


CROSS_ENTROPY = cross_entropy_op.compile_configurations()


@pytest.mark.parametrize("case", CROSS_ENTROPY, ids=[_id(c) for c in CROSS_ENTROPY])
def test_cross_entropy_configuration_compiles_without_spills(case):
    kernel, config, specs = case
    report = inspect_kernel(kernel, config, specs, arch="sm_90a", reuse=True)
    assert not report.local_memory, f"local memory / spills: {report.summary()}"
    if config is None:  # the one-CTA count of counted rows
        return
    if getattr(config, "row", config).cluster_n > 1 and kernel.__name__ == "CrossEntropyFwdSm90":
        assert "st.async.shared::cluster" in report.ptx


GEMM_ALL = gemm_op.compile_configurations()
# pad_k kernels in bf16 only: fp16 adds no code to the copy or the grid barrier (the same MMA
# with fp16 operands is compiled elsewhere), to keep CI's compile time in bounds (precompile
# builds them all).
GEMM = [case for case in GEMM_ALL if case[0].__name__ == "GemmSm90"
        and not (case[1].pad_k and case[2][0].dtype == "float16")]
PAD = [case for case in GEMM_ALL if case[0].__name__ == "PadRowsSm90"]


@pytest.mark.parametrize("case", PAD, ids=[c[2][0].dtype for c in PAD])
def test_gemm_padding_kernel_compiles_without_local_memory(case):
    kernel, config, specs = case
    report = inspect_kernel(kernel, config, specs, arch="sm_90a", reuse=True)
    assert not report.local_memory, f"local memory / spills: {report.summary()}"
    assert "st.global" in report.ptx


def test_compile_report_catches_serialized_wgmma():
    # ptxas's remark when it cannot keep wgmma in flight (each one then waits for the last).
    from cute_kernels.runtime.compile import _WGMMA_SERIALIZED

    log = ("remark[ptxas info]: ptxas output: ptxas info    : (C7511) Potential Performance Loss: "
           "wgmma.mma_async instructions are serialized due to insufficient register resources for "
           "the wgmma pipeline in the function 'kernel_x' in line 1795\n"
           "ptxas info    : Used 168 registers, used 16 barriers\n")
    assert [m.split(")")[0] for m in _WGMMA_SERIALIZED.findall(log)] == ["(C7511"]
    assert not _WGMMA_SERIALIZED.findall("ptxas info    : Used 168 registers, used 16 barriers")


@pytest.mark.parametrize("case", GEMM, ids=[f"{c.tile_m}x{c.tile_n}-c{c.cluster_m}-{i}" for i, (_, c, _) in enumerate(GEMM)])
def test_gemm_configuration_uses_wgmma_tma_and_no_spills(case):
    kernel, config, specs = case
    report = inspect_kernel(kernel, config, specs, arch="sm_90a", reuse=True)
    assert report.has("wgmma.mma_async"), "the mainloop must issue wgmma"
    assert report.has("cp.async.bulk.tensor"), "operands must move by TMA"
    assert report.has("setmaxnreg"), "warp specialization must rebalance registers"
    # Dependent launch: wait for the previous grid before any global access, release the next.
    assert report.has("griddepcontrol.wait") and report.has("griddepcontrol.launch_dependents")
    assert not report.local_memory, f"local memory / spills: {report.summary()}"
    assert not report.wgmma_serialized, f"ptxas serialized the wgmma: {report.wgmma_serialized}"


# Every configuration in bf16; fp16 (the same kernels with fp16 MMAs) for the forward at head
# dim 128 where neither softcap nor varlen adds code, to keep CI's compile time in bounds
# (precompile builds them all).
ATTENTION_ALL = attention_op.compile_configurations()
ATTENTION = [case for case in ATTENTION_ALL if case[0].__name__.startswith("FlashAttn")
             and (case[2][0].dtype == "bfloat16" or not (case[1].softcap or case[1].varlen
                                                         or case[1].head_dim != 128
                                                         or case[0].__name__.startswith("FlashAttnBwd")))]
ROW_PASSES = [case for case in ATTENTION_ALL if case[0].__name__.startswith(("BwdPrepare", "BwdFinish"))]


def _attention_id(case):
    kernel, c, specs = case
    flags = "".join(f"-{k}" for k in ("local", "softcap", "varlen", "persistent") if getattr(c, k, False))
    return f"{kernel.__name__}-d{c.head_dim}-{c.tile_m}x{c.tile_n}x{c.stages}{flags}-{specs[0].dtype}"


@pytest.mark.parametrize("case", ATTENTION, ids=[_attention_id(c) for c in ATTENTION])
def test_attention_configuration_uses_wgmma_tma_and_no_spills(case):
    kernel, config, specs = case
    report = inspect_kernel(kernel, config, specs, arch="sm_90a", reuse=True)
    assert report.has("wgmma.mma_async"), "the GEMMs must issue wgmma"
    assert report.has("cp.async.bulk.tensor"), "Q, K and V must move by TMA"
    assert report.has("setmaxnreg"), "warp specialization must rebalance registers"
    assert report.has("ex2.approx"), "the softmax runs on exp2"
    if config.softcap:
        assert report.has("tanh.approx"), "softcap uses the hardware tanh"
    if kernel.__name__.startswith("FlashAttnBwd"):
        assert report.has("cp.reduce.async.bulk.global"), "dQ is added by a bulk reduce"
    elif config.head_dim <= 128:
        assert report.has("bar.arrive"), "ping-pong hands the tensor cores over by named barriers"
    assert not report.local_memory, f"local memory / spills: {report.summary()}"
    assert not report.wgmma_serialized, f"ptxas serialized the wgmma: {report.wgmma_serialized}"


def test_inspect_keeps_the_machine_code_on_request():
    # benchmarks/dump_sass.py disassembles these images; without the request none are kept.
    kernel, config, specs = SOFTMAX[0]
    report = inspect_kernel(kernel, config, specs, arch="sm_90a", keep_cubin=True)
    assert report.cubins and all(image[:4] == b"\x7fELF" for image in report.cubins)
    assert not inspect_kernel(kernel, config, specs, arch="sm_90a").cubins


@pytest.mark.parametrize("case", ROW_PASSES, ids=[f"{c[0].__name__}-{c[1].label.replace(' ', '-')}-{c[2][1].dtype}"
                                                  for c in ROW_PASSES])
def test_attention_row_passes_move_16_byte_vectors_without_spills(case):
    kernel, config, specs = case
    report = inspect_kernel(kernel, config, specs, arch="sm_90a", reuse=True)
    assert report.has("ld.global.v4"), "rows must be read in 16-byte vectors"
    assert report.has("st.global.v4"), "rows must be written in 16-byte vectors"
    if kernel.__name__.startswith("BwdPrepare"):
        assert "shfl.sync.bfly" in report.ptx, "the row sum is reduced by warp shuffles"
    assert not report.local_memory, f"local memory / spills: {report.summary()}"


INT8 = int8_op.compile_configurations()


def _int8_id(case):
    kernel, c, specs = case
    if kernel.__name__ == "GemmSm90":
        epi = "+".join(k for k, v in vars(c.epilogue).items() if v) or "plain"
        return f"gemm-{c.tile_m}x{c.tile_n}-c{c.cluster_m}-{epi}-{specs[2].dtype}"
    return f"quantize-{c.label.replace(' ', '-')}-{specs[0].dtype}"


@pytest.mark.parametrize("case", INT8, ids=[_int8_id(c) for c in INT8])
def test_int8_configuration_compiles_to_s8_wgmma_or_exact_rounding(case):
    kernel, config, specs = case
    report = inspect_kernel(kernel, config, specs, arch="sm_90a", reuse=True)
    assert not report.local_memory, f"local memory / spills: {report.summary()}"
    if kernel.__name__ == "GemmSm90":
        assert ".s32.s8.s8" in report.ptx, "int8 operands must run on s8 wgmma into int32"
        assert report.has("cp.async.bulk.tensor") and report.has("setmaxnreg")
        assert not report.wgmma_serialized, f"ptxas serialized the wgmma: {report.wgmma_serialized}"
        converts = "cvt.rn.f32.s32" in report.ptx
        assert converts == (specs[2].dtype != "int32"), "int32 out stays exact; float out converts"
    else:
        assert "cvt.rni.s32.f32" in report.ptx, "codes round half to even"
        # once per row, IEEE: the scale (a division) and its inverse (a reciprocal)
        assert report.ptx.count("div.rn.f32") == 1 and report.ptx.count("rcp.rn.f32") == 1
        assert "approx" not in report.ptx and ".ftz" not in report.ptx
        assert "shfl.sync.bfly" in report.ptx, "the row range is reduced by warp shuffles"


NVFP4 = [c for c in nvfp4_op.compile_configurations() if c[0].__name__ == "QuantizeNvfp4Sm90"]
NVFP4_PRODUCTS = [c for c in nvfp4_op.compile_configurations() if c[0].__name__ != "QuantizeNvfp4Sm90"]


@pytest.mark.parametrize("case", NVFP4, ids=[f"quantize-{c[1]}-{c[2][0].dtype}" for c in NVFP4])
def test_nvfp4_quantize_compiles_without_e2m1_conversions(case):
    # sm_90 has no e2m1 conversion (ptxas rejects the DSL's); the codes come from comparisons.
    kernel, config, specs = case
    report = inspect_kernel(kernel, config, specs, arch="sm_90a", reuse=True)
    ptx = report.ptx
    assert not report.local_memory, f"local memory / spills: {report.summary()}"
    assert "e2m1" not in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "cvt.rn.f16x2.e4m3x2" in ptx
    assert ptx.count("cvt.rn.f16x2.f32") == 8, "the codes come from one fp16x2 conversion per byte"
    assert ptx.count("ld.global.v4") == (4 if specs[0].dtype == "float32" else 2), "16-byte loads"
    assert "st.global.v2.b32" in ptx, "the 16 codes of a block leave in one 8-byte store"
    # IEEE arithmetic, as the reference's: two divisions and one reciprocal per block
    assert ptx.count("div.rn.f32") == 2 and ptx.count("rcp.rn.f32") == 1
    assert "approx" not in ptx and ".ftz" not in ptx


def _product_id(case):
    kernel, config, _ = case
    if kernel.__name__ == "DequantizeNvfp4Sm90":
        return f"dequantize-{config}"
    if kernel.__name__ == "W4A16GemmSm90":
        return f"w4a16-{config.tile_m}x{config.tile_n}-cta{config.ctas_per_sm}-bias{int(config.epilogue.bias)}"
    stream = f"-stream{config.x_rows}" if config.prefetch else ""
    return (f"skinny-t{config.token_tiles}-s{config.slabs}-w{config.warps}-{config.x_format}-"
            f"{config.out_dtype}{stream}")


@pytest.mark.parametrize("case", NVFP4_PRODUCTS, ids=[_product_id(c) for c in NVFP4_PRODUCTS])
def test_nvfp4_product_kernels_decode_in_registers_without_spills(case):
    # No e2m1 conversion on sm_90a: the codes are decoded by integer operations, then one
    # bf16x2 / f16x2 multiply by the block scale; the skinny kernel feeds mma.sync from registers.
    kernel, config, specs = case
    report = inspect_kernel(kernel, config, specs, arch="sm_90a", reuse=True)
    ptx = report.ptx
    assert not report.local_memory, f"local memory / spills: {report.summary()}"
    assert "e2m1" not in ptx
    if kernel.__name__ != "W4A16GemmSm90":  # its prepared weight holds bf16 scales
        assert "cvt.rn.f16x2.e4m3x2" in ptx
    multiply = "mul.rn.f16x2" if getattr(config, "half", False) else "mul.rn.bf16x2"
    assert multiply in ptx
    if kernel.__name__ == "DequantizeNvfp4Sm90":
        # a word of 8 codes per thread (a warp reads 128 contiguous bytes), 16-byte stores
        assert "ld.global.b32" in ptx and "ld.global.v4" not in ptx
        assert "st.global.v4" in ptx, "values leave in 16-byte stores"
        assert "mma" not in ptx
        if config != "float32":  # the global-scale-1 path: pairs reordered by byte permutes
            assert ptx.count("prmt.b32") >= 4
    elif kernel.__name__ == "W4A16GemmSm90":
        # the GEMM's pipeline: TMA loads, register-sourced wgmma (A in braces), never serialized
        assert "cp.async.bulk.tensor" in ptx and not report.wgmma_serialized, report.summary()
        assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{config.tile_n}k16\.f32\.bf16\.bf16 "
                         r"\{[^}]*\}, \{%r", ptx), "register-sourced wgmma"
    else:
        kind = "f16.f16" if config.half else "bf16.bf16"
        expected = 8 * config.slabs * config.token_tiles  # 4 words x 2 k-blocks per slab and tile
        if config.prefetch:
            # streaming: 16-byte loads straight to registers, the step loop unrolled by the
            # prefetch distance, no ring
            assert "ld.global.nc.L1::no_allocate.v4.b32" in ptx and "cp.async" not in ptx
            # the weight's loads (two rows per step and prefetch slot) carry the L2 fetch size
            fetched = ptx.count(f"ld.global.nc.L1::no_allocate.L2::{config.l2_fetch}B.v4.b32")
            assert fetched == (2 * config.prefetch * 2 if config.l2_fetch else 0), fetched
            expected *= config.prefetch
        else:
            assert "cp.async.cg.shared.global" in ptx, "a ring of 16-byte cp.async copies feeds the MMAs"
        assert ptx.count(f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.f32") == expected
