"""Quantized matmul: int8 GEMM (TOP/s), int8 quantize (GB/s), Int8Linear; peers in the same run.

    python benchmarks/bench_quant.py [--quick]

Rows (the ``cublas`` peer is what a torch user calls instead):
  - ``gemm_int8_int32``: the exact int32 product against ``torch._int_mm``.
  - ``gemm_int8_scaled``: per-row / per-column scales and a bias in the epilogue, bf16 out,
    against ``torch._int_mm`` followed by the same epilogue in torch.
  - ``quantize_int8_row``: per-token dynamic quantization (bytes read + written), against the
    same rule in torch eager and compiled by ``torch.compile``.
  - ``int8_linear``: ``Int8Linear`` (quantize + GEMM) against the bf16 ``nn.Linear`` it
    replaces, in TFLOP/s-equivalent (2 M N K per call).
  - ``nvfp4_quantize``: NVFP4 quantization with a given global scale (bytes read + written:
    x, packed codes, block scales), against the same rule in torch eager and compiled.
  - ``gemm_w4a16``: bf16 activations times NVFP4 weights. Up to 64 rows: effective GB/s over
    the weight and scale bytes (every peer is counted on the same bytes, so the ratios are
    time ratios), against quack's ``gemm_w4a16`` (nvfp4, its repacked weights) and cuBLAS bf16 on
    the dequantized weights; larger M in TFLOP/s. ``gemm_w4a16_prepared`` rows: the same calls
    with the weight prepared once (``nvfp4_prepare_weight``: the GEMM's TMA + wgmma kernel).
    Up to 64 rows the calls are shorter than their host time, so the rows also carry
    ``gpu_GBps``: the same calls' GPU time (host work hidden behind a queued GPU wait).
  - ``gemm_nvfp4``: both operands NVFP4, fp16 out (the public NVFP4 problems), TFLOP/s, against
    dequantizing both operands in torch and cuBLAS bf16 (the problems' torch baseline).
  - ``gemv_nvfp4``: the public nvfp4_gemv shapes, GB/s of the matrix, its scales and the
    output in GPU time (the contest's measure: host work hidden behind a queued GPU wait), with
    the fraction of the bandwidth floor, the rate of back-to-back calls (host included) and the
    host time per call.
  - ``nvfp4_dual_gemm``: ``silu(a b1^T) * (a b2^T)`` at the public shapes, TFLOP/s of both
    products, against the torch dequantize + cuBLAS baseline.

``--nvfp4`` runs only the NVFP4 rows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Results, bench_many, ceilings, gbps, host_us, make_input_sets, tflops, usable  # noqa: E402

import cute_kernels as ck  # noqa: E402
from cute_kernels.quant.formats import nvfp4_quantize_ref  # noqa: E402
from cute_kernels.reference import quantize_int8_ref  # noqa: E402

ROUNDS = 5
GEMM_SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096), (16384, 1024, 4096), (4096, 14336, 4096),
               (2048, 6144, 4096), (128, 4096, 4096), (16, 14336, 4096)]


def codes(*shape):
    return torch.randint(-128, 128, shape, device="cuda", dtype=torch.int8)


def gemm_rows(results, shapes):
    for m, n, k in shapes:
        sets = make_input_sets(lambda: (codes(m, k), codes(n, k)), m * k + n * k)
        fns = {"ours": ck.gemm_int8, "cublas": lambda a, b: torch._int_mm(a, b.t())}
        if not usable(fns["cublas"], *sets[0]):  # _int_mm needs M > 16
            del fns["cublas"]
        ms = bench_many(fns, sets, rounds=ROUNDS)
        rates = {key: tflops(2 * m * n * k, v) for key, v in ms.items()}
        results.add("quant", "gemm_int8_int32", (m, n, k), "int8", "TOPs", rates.pop("ours"), rates)
    for m, n, k in shapes[:4]:
        scale_a = torch.rand(m, device="cuda") * 1e-2
        scale_b = torch.rand(n, device="cuda") * 1e-2
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        sets = make_input_sets(lambda: (codes(m, k), codes(n, k)), m * k + n * k)

        def torch_scaled(a, b):
            acc = torch._int_mm(a, b.t())
            return (acc.float() * scale_a[:, None] * scale_b[None, :] + bias).to(torch.bfloat16)

        fns = {"ours": lambda a, b: ck.gemm_int8(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias),
               "cublas": torch_scaled}
        ms = bench_many(fns, sets, rounds=ROUNDS)
        rates = {key: tflops(2 * m * n * k, v) for key, v in ms.items()}
        results.add("quant", "gemm_int8_scaled", (m, n, k), "int8", "TOPs", rates.pop("ours"), rates)


def quantize_rows(results, shapes):
    compiled = torch.compile(lambda x: quantize_int8_ref(x, "row", True))
    for m, n in shapes:
        sets = make_input_sets(lambda: (torch.randn(m, n, device="cuda", dtype=torch.bfloat16),), m * n * 2)
        fns = {"ours": lambda x: ck.quantize_int8(x, "row"),
               "torch": lambda x: quantize_int8_ref(x, "row", True),
               "torch_compile": compiled}
        ms = bench_many(fns, sets, rounds=ROUNDS)
        moved = m * n * 3 + m * 4  # bf16 in, int8 out, fp32 scales
        rates = {key: gbps(moved, v) for key, v in ms.items()}
        results.add("quant", "quantize_int8_row", (m, n), "bfloat16", "GBps", rates.pop("ours"), rates)


def nvfp4_quantize_rows(results, shapes):
    gs = torch.tensor(0.01, device="cuda")
    compiled = torch.compile(lambda x: nvfp4_quantize_ref(x, gs)[:2])
    for m, n in shapes:
        sets = make_input_sets(lambda: (torch.randn(m, n, device="cuda", dtype=torch.bfloat16),), m * n * 2)
        fns = {"ours": lambda x: ck.nvfp4_quantize(x, gs),
               "torch": lambda x: nvfp4_quantize_ref(x, gs),
               "torch_compile": compiled}
        ms = bench_many(fns, sets, rounds=ROUNDS)
        moved = m * n * 2 + m * n // 2 + m * n // 16  # bf16 in, 4-bit codes and e4m3 scales out
        rates = {key: gbps(moved, v) for key, v in ms.items()}
        results.add("quant", "nvfp4_quantize", (m, n), "bfloat16", "GBps", rates.pop("ours"), rates)


def _nvfp4_weight(n, k):
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    scales = torch.randint(0x20, 0x48, (n, k // 16), dtype=torch.uint8, device="cuda")
    return packed, scales.view(torch.float8_e4m3fn)


def _quack_w4a16():
    try:
        from quack.gemm_w4 import gemm_w4a16, prepare_w4_weight
    except Exception as exc:  # an older quack: the peer is left out
        print(f"[quack gemm_w4a16 unavailable: {exc}]", file=sys.stderr)
        return None
    return gemm_w4a16, prepare_w4_weight


def w4a16_rows(results, shapes):
    quack = _quack_w4a16()
    for m, n, k in shapes:
        weight_bytes = n * k // 2 + n * k // 16

        def make():
            packed, scales = _nvfp4_weight(n, k)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            dense = ck.nvfp4_dequantize(packed, scales, 1.0)
            extra = quack[1](packed, scales, "nvfp4") if quack else (None, None)
            return x, packed, scales, dense, ck.nvfp4_prepare_weight(packed, scales), *extra

        sets = make_input_sets(make, weight_bytes + n * k * 2)
        fns = {"ours": lambda x, p, s, d, w, qb, qs: ck.gemm_w4a16(x, p, s),
               "ours_prepared": lambda x, p, s, d, w, qb, qs: ck.gemm_w4a16(x, w, None),
               "cublas": lambda x, p, s, d, w, qb, qs: torch.matmul(x, d.t())}
        if quack and usable(lambda x, p, s, d, w, qb, qs: quack[0](x, qb, qs, wformat="nvfp4"), *sets[0]):
            fns["quack"] = lambda x, p, s, d, w, qb, qs: quack[0](x, qb, qs, wformat="nvfp4")
        extra = {}
        with torch.no_grad():
            ms = bench_many(fns, sets, rounds=ROUNDS)
            if m <= 64:  # calls shorter than their host time: their GPU time too
                gpu = bench_many(fns, sets, rounds=ROUNDS, device_only=True)
                extra = {key: round(gbps(weight_bytes, v), 1) for key, v in gpu.items()}
        if m <= 64:
            rates = {key: gbps(weight_bytes, v) for key, v in ms.items()}
            unit = "GBps"
        else:
            rates = {key: tflops(2 * m * n * k, v) for key, v in ms.items()}
            unit = "TFLOPs"
        packed_rate, prepared_rate = rates.pop("ours"), rates.pop("ours_prepared")
        gpu_rates = {key: v for key, v in extra.items() if not key.startswith("ours")}
        packed_extra = {"gpu_GBps": {"ours": extra["ours"], **gpu_rates}} if extra else {}
        prepared_extra = {"gpu_GBps": {"ours": extra["ours_prepared"], **gpu_rates}} if extra else {}
        results.add("quant", "gemm_w4a16", (m, n, k), "bfloat16", unit, packed_rate, rates, **packed_extra)
        # the weight prepared once (nvfp4_prepare_weight): the GEMM's TMA + wgmma pipeline
        results.add("quant", "gemm_w4a16_prepared", (m, n, k), "bfloat16", unit, prepared_rate, rates,
                    **prepared_extra)


def nvfp4_gemm_rows(results, shapes):
    from cute_kernels.quant.formats import nvfp4_dequantize_ref

    def torch_baseline(a, b, sa, sb):
        da = nvfp4_dequantize_ref(a, sa, 1.0).to(torch.bfloat16)
        db = nvfp4_dequantize_ref(b, sb, 1.0).to(torch.bfloat16)
        return torch.matmul(da, db.t()).to(torch.float16)

    for m, n, k in shapes:
        def make():
            return (*_nvfp4_weight(m, k), *_nvfp4_weight(n, k))

        sets = [(a, b, sa, sb) for a, sa, b, sb in (make() for _ in range(
            max(2, min(16, -(-3 * 50 * 2**20 // ((m + n) * k // 2 + 1))))))]
        fns = {"ours": lambda a, b, sa, sb: ck.gemm_nvfp4(a, b, sa, sb), "torch": torch_baseline}
        ms = bench_many(fns, sets, rounds=3)
        rates = {key: tflops(2 * m * n * k, v) for key, v in ms.items()}
        results.add("quant", "gemm_nvfp4", (m, n, k), "nvfp4", "TFLOPs", rates.pop("ours"), rates)


def nvfp4_gemv_rows(results, shapes, copy_gbps):
    """``gemv_nvfp4`` at the public nvfp4_gemv problem's shapes (m, k, l), blocked scales as
    the problem passes them: GB/s of a, its scales and the output (the problem's bandwidth
    floor is those bytes over the copy rate), GPU time (``device_only``: the contest
    harness's measure) and, beside it, the host time of one call."""
    from cute_kernels.quant.formats import to_blocked

    for m, k, batch in shapes:
        nbytes = batch * (m * k // 2 + m * k // 16 + m * 2)

        def make():
            a, sa = _nvfp4_weight(batch * m, k)
            x, sx = _nvfp4_weight(batch, k)
            blocked_a = torch.stack([to_blocked(t) for t in sa.view(batch, m, -1)])
            blocked_x = torch.stack([to_blocked(t) for t in sx.view(batch, 1, -1)])
            return a.view(batch, m, -1), x, blocked_a, blocked_x

        sets = make_input_sets(make, nbytes)
        fns = {"ours": lambda a, x, sa, sx: ck.gemv_nvfp4(a, x, sa, sx, scale_layout="blocked")}
        device = bench_many(fns, sets, rounds=ROUNDS, device_only=True)["ours"]
        called = bench_many(fns, sets, rounds=ROUNDS)["ours"]
        host = host_us(fns, *sets[0], calls=500)["ours"]
        floor_ms = nbytes / copy_gbps / 1e6
        results.add("quant", "gemv_nvfp4", (m, k, batch), "nvfp4", "GBps", gbps(nbytes, device), {},
                    floor_fraction=round(floor_ms / device, 3), gpu_us=round(device * 1e3, 1),
                    call_GBps=round(gbps(nbytes, called), 1), host_us=round(host, 1))


def nvfp4_dual_gemm_rows(results, shapes):
    """``nvfp4_dual_gemm`` at the public nvfp4_dual_gemm problem's shapes (m, n, k), TFLOP/s of
    both products, against dequantizing in torch and two cuBLAS bf16 GEMMs (the problem's
    torch baseline)."""
    from cute_kernels.quant.formats import nvfp4_dequantize_ref

    def torch_baseline(a, b1, b2, sa, s1, s2):
        da = nvfp4_dequantize_ref(a, sa, 1.0).to(torch.bfloat16)
        first = torch.matmul(da, nvfp4_dequantize_ref(b1, s1, 1.0).to(torch.bfloat16).t()).float()
        second = torch.matmul(da, nvfp4_dequantize_ref(b2, s2, 1.0).to(torch.bfloat16).t()).float()
        return (torch.nn.functional.silu(first) * second).to(torch.float16)

    for m, n, k in shapes:
        def make():
            (a, sa), (b1, s1), (b2, s2) = _nvfp4_weight(m, k), _nvfp4_weight(n, k), _nvfp4_weight(n, k)
            return a, b1, b2, sa, s1, s2

        sets = make_input_sets(make, (m + 2 * n) * k // 2)
        fns = {"ours": ck.nvfp4_dual_gemm, "torch": torch_baseline}
        ms = bench_many(fns, sets, rounds=3)
        rates = {key: tflops(4 * m * n * k, v) for key, v in ms.items()}
        results.add("quant", "nvfp4_dual_gemm", (m, n, k), "nvfp4", "TFLOPs", rates.pop("ours"), rates)


NVFP4_GEMV_SHAPES = [(7168, 16384, 1), (4096, 7168, 8), (7168, 2048, 4)]
NVFP4_DUAL_GEMM_SHAPES = [(256, 4096, 7168), (512, 3072, 7168)]
W4A16_SHAPES = [(1, 8192, 8192), (16, 8192, 8192), (64, 8192, 8192), (1, 14336, 4096),
                (16, 28672, 4096), (16, 4096, 14336), (4096, 8192, 8192)]
NVFP4_GEMM_SHAPES = [(1, 7168, 16384), (128, 7168, 16384), (128, 4096, 7168), (128, 7168, 2048),
                     (16, 7168, 2048)]


def linear_rows(results, shapes):
    for m, n, k in shapes:
        linear = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        layer = ck.Int8Linear.from_float(linear)
        sets = make_input_sets(lambda: (torch.randn(m, k, device="cuda", dtype=torch.bfloat16),), m * k * 2)
        with torch.no_grad():
            ms = bench_many({"ours": layer, "cublas": linear}, sets, rounds=ROUNDS)
        rates = {key: tflops(2 * m * n * k, v) for key, v in ms.items()}
        results.add("quant", "int8_linear", (m, n, k), "bfloat16", "TFLOPs", rates.pop("ours"), rates)


def host_times(results):
    """Host time per call (us) of a decode-sized Int8Linear and the nn.Linear it replaces, with
    the GPU work queued behind (the CPU is the limit at these sizes)."""
    linear = torch.nn.Linear(4096, 4096, device="cuda", dtype=torch.bfloat16)
    layer = ck.Int8Linear.from_float(linear)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        host = host_us({"ours": layer, "nn_linear": linear, "quantize_int8": ck.quantize_int8}, x,
                       calls=2000)
    host = {k: round(v, 2) for k, v in host.items()}
    print(f"host time 16x4096x4096: Int8Linear {host['ours']} us, nn.Linear {host['nn_linear']} us, "
          f"quantize_int8 {host['quantize_int8']} us")
    results.data.setdefault("runtime", {})["int8_linear_16x4096x4096_host_us"] = host


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--nvfp4", action="store_true", help="the NVFP4 rows only")
    args = parser.parse_args()
    results = Results()
    results.start(ceilings())
    nvfp4_quantize_rows(results, [(8192, 4096)] if args.quick else [(8192, 4096), (16384, 8192), (16, 7168)])
    w4a16_rows(results, W4A16_SHAPES[:2] if args.quick else W4A16_SHAPES)
    nvfp4_gemm_rows(results, NVFP4_GEMM_SHAPES[:1] if args.quick else NVFP4_GEMM_SHAPES)
    nvfp4_gemv_rows(results, NVFP4_GEMV_SHAPES[:1] if args.quick else NVFP4_GEMV_SHAPES,
                    results.data["ceilings"]["copy_GBps"])
    nvfp4_dual_gemm_rows(results, NVFP4_DUAL_GEMM_SHAPES[:1] if args.quick else NVFP4_DUAL_GEMM_SHAPES)
    if args.nvfp4:
        results.save()
        return
    gemm_rows(results, GEMM_SHAPES[:2] if args.quick else GEMM_SHAPES)
    quantize_rows(results, [(8192, 4096)] if args.quick else [(8192, 4096), (16384, 8192), (4096, 14336), (64, 4096)])
    linear_rows(results, [(4096, 4096, 4096)] if args.quick else [(4096, 4096, 4096), (8192, 14336, 4096), (16, 4096, 4096)])
    host_times(results)
    results.save()


if __name__ == "__main__":
    main()
