"""Rebuild BENCHMARKS.md's tables and the plots from benchmarks/results/*.json.

    python benchmarks/report.py
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent
MARK_BEGIN = "<!-- results:begin -->"
MARK_END = "<!-- results:end -->"


def load() -> dict:
    return {p.stem: json.loads(p.read_text()) for p in sorted((ROOT / "results").glob("*.json"))}


def table(rows: list) -> str:
    peers = sorted({k for r in rows for k in r["peers"]})
    head = ["op", "shape", "dtype", "ours"] + peers + [f"ours/{p}" for p in peers] + ["run"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        values = [r["op"], r["shape"], r["dtype"], f"{r['ours']:.0f} {r['metric']}"]
        values += [f"{r['peers'][p]:.0f}" if p in r["peers"] else "" for p in peers]
        values += [f"{r['ours'] / r['peers'][p]:.3f}x" if p in r['peers'] else '' for p in peers]
        values.append(r.get("date", "earlier"))  # rows keep the date of the run that measured them
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines)


def gpu_time_table(rows: list) -> str:
    """Rows that also carry GPU-time rates (``bench(..., device_only=True)``: the calls' host
    work hidden behind a queued GPU wait), with the bandwidth floor's fraction and host time
    where measured."""
    peers = sorted({k for r in rows for k in r.get("gpu_GBps", {}) if k != "ours"})
    head = ["op", "shape", "ours GPU GB/s"] + [f"{p} GPU GB/s" for p in peers] + [
        "of the floor", "host us/call", "run"]
    lines = ["GPU time alone (host work hidden behind a queued GPU wait, as the contest harness "
             "times; the table above times calls back to back, host included):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        gpu = r.get("gpu_GBps", {"ours": r["ours"]})
        values = [r["op"], r["shape"], f"{gpu['ours']:.0f}"] + [
            f"{gpu[p]:.0f}" if p in gpu else "" for p in peers]
        values += [f"{r['floor_fraction']:.2f}" if "floor_fraction" in r else "",
                   f"{r['host_us']}" if "host_us" in r else "", r.get("date", "earlier")]
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines)


def plotted_gpu(results: dict, family: str) -> str | None:
    """The GPU whose rows a family's plot shows: the first (by file name) that has any (the
    plots have one file per family)."""
    return next((gpu for gpu, data in results.items() if any(r["family"] == family for r in data["rows"])), None)


def markdown(results: dict) -> str:
    out = []
    for gpu, data in results.items():
        ceil = data.get("ceilings", {})
        out.append(f"### {data.get('device', gpu)} (latest run {data.get('date', '?')}; DSL {data.get('dsl', '?')}, "
                   f"torch {data.get('torch', '?')})")
        out.append(f"Each row's peers ran in the same run as ours (its date: `run`; `earlier`: before "
                   f"rows were dated). Ceilings of the latest run: copy {ceil.get('copy_GBps', '?')} GB/s, "
                   f"bf16 matmul {ceil.get('bf16_mm_TFLOPs', '?')} TFLOP/s.")
        families = []
        for r in data["rows"]:
            if r["family"] not in families:
                families.append(r["family"])
        for family in families:
            out.append(f"\n#### {family}\n")
            out.append(table([r for r in data["rows"] if r["family"] == family]))
            if plotted_gpu(results, family) == gpu:
                out.append(f"\n![{family}](benchmarks/plots/{family}.png)")
            if family == "gemm" and _grid_rows(data):
                out.append("\n![gemm at real model shapes](benchmarks/plots/gemm_grid.png)")
            gpu_rows = [r for r in data["rows"] if r["family"] == family and ("gpu_GBps" in r or "floor_fraction" in r)]
            if gpu_rows:
                out.append("\n" + gpu_time_table(gpu_rows))
        runtime = data.get("runtime")
        if runtime and "dispatch_us" in runtime:
            d, f = runtime["dispatch_us"], runtime["first_call_s"]
            out.append("\n#### runtime\n")
            out.append(f"Host time per call, {d['shape']} {d['dtype']} softmax: ours {d['ours']} us, "
                       f"torch.softmax {d['torch']} us ({d['ratio']}x). First call in a new process: "
                       f"{f['warm_cache']} s with the disk cache warm, {f['cold_cache']} s cold (compile).")
            if "import_s" in runtime:
                imp = runtime["import_s"]
                out.append(f"`import cute_kernels` (a fresh process, torch and the DSL included): "
                           f"{imp['cute_kernels']} s; `import torch, cutlass.cute`: {imp['torch_and_dsl']} s.")
        out.append("")
    return "\n".join(out)


def contest_markdown() -> str:
    """The contest problems' acceptance runs (``benchmarks/contest_acceptance.py``): pass / fail
    of the submission's and the bundle's leaderboard runs, and the submission's public benchmark
    score against the baseline's."""
    folder = ROOT / "results" / "contest"
    reports = {p.name[:-5]: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
    problems = sorted({name.rsplit(".", 1)[0] for name in reports})
    if not problems:
        return ""

    def score(report):
        for run in (report or {}).get("runs", []):
            if run["mode"] == "benchmark" and run["secret_seed"] is None:
                return run["score_s"]
        return None

    lines = ["### Contest problems (GPU MODE protocol, `benchmarks/contest_acceptance.py`)", "",
             "Leaderboard runs (test, benchmark and leaderboard steps with the public and a secret "
             "seed) of each problem's submission and of its bundle (cute_kernels hidden); scores are "
             "the public benchmark step's, the baseline's from the same run.", "",
             "| problem | submission | bundle | score | baseline | baseline / score | GPU |",
             "|---|---|---|---|---|---|---|"]
    for problem in problems:
        got = {kind: reports.get(f"{problem}.{kind}") for kind in ("submission", "bundle", "baseline")}
        status = {k: "-" if v is None else ("pass" if v["passed"] else "FAIL") for k, v in got.items()}
        ours, base = score(got["submission"]), score(got["baseline"])
        fmt = lambda s: "-" if s is None else f"{s * 1e6:.1f} us"  # noqa: E731
        ratio = f"{base / ours:.2f}x" if ours and base else "-"
        gpus = sorted({v.get("device") or "?" for v in got.values() if v is not None})
        lines.append(f"| {problem.replace('__', '/')} | {status['submission']} | {status['bundle']} | "
                     f"{fmt(ours)} | {fmt(base)} | {ratio} | {', '.join(gpus)} |")
    return "\n".join(lines) + "\n"


def _sweep_plots(data: dict, gpu: str, ops: tuple, selected, x_of, xlabel: str, ylabel: str,
                 title: str, filename: str, ceiling: tuple | None = None) -> None:
    """One panel per op: ours and each peer against ``x_of(row)`` over the ``selected`` rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ops), figsize=(12, 4.5), sharey=True)
    for ax, op in zip(axes, ops):
        sweep = sorted((r for r in data["rows"] if r["op"] == op and selected(r)), key=x_of)
        if not sweep:
            continue
        xs = [x_of(r) for r in sweep]
        ax.plot(xs, [r["ours"] for r in sweep], "o-", label="cute-kernels", linewidth=2)
        for peer in sorted({k for r in sweep for k in r["peers"]}):
            ax.plot(xs, [r["peers"].get(peer) for r in sweep], ".--", label=peer)
        if ceiling is not None:
            ax.axhline(ceiling[0], color="gray", linestyle=":", label=ceiling[1])
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_title(op)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(ylabel)
    axes[0].legend()
    fig.suptitle(f"{title} on {data.get('device', gpu)}")
    fig.tight_layout()
    (ROOT / "plots").mkdir(exist_ok=True)
    fig.savefig(ROOT / "plots" / filename, dpi=110)


def plot_softmax(results: dict) -> None:
    """GB/s against row length at 2^27 elements, forward and backward."""
    gpu = plotted_gpu(results, "softmax")
    if gpu is not None:
        data = results[gpu]
        _sweep_plots(data, gpu, ("softmax_fwd", "softmax_bwd"),
                     lambda r: r["family"] == "softmax" and _elements(r["shape"]) == 1 << 27,
                     lambda r: _n(r["shape"]), "N (M = 2^27 / N), bf16", "GB/s (read + written)",
                     "softmax", "softmax.png", (data["ceilings"]["copy_GBps"], "device copy"))


def plot_attention(results: dict) -> None:
    """TFLOP/s against sequence length (head dim 128, 16 heads, 16k tokens), without and with a
    causal mask: ours and each peer."""
    gpu = plotted_gpu(results, "attention")
    if gpu is not None:
        data = results[gpu]
        _sweep_plots(data, gpu, ("attn_fwd_full", "attn_fwd_causal"),
                     lambda r: r["family"] == "attention" and _attention_sweep(r["shape"]),
                     lambda r: int(r["shape"].split("x")[1]),
                     "sequence length (batch = 16384 / S), hdim 128, 16 heads, bf16", "TFLOP/s",
                     "attention forward", "attention.png")


def _attention_sweep(shape: str) -> bool:
    batch, seqlen, heads, heads_kv, *dims = (int(x) for x in shape.split("x"))
    return dims == [128] and heads == heads_kv == 16 and batch * seqlen == 16384


def plot_families(results: dict) -> None:
    """One bar chart per family (other than softmax and attention): ours and each peer, per op
    and shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for gpu, data in results.items():
        for family in sorted({r["family"] for r in data["rows"]} - {"softmax", "attention"}):
            if plotted_gpu(results, family) != gpu:
                continue
            rows = [r for r in data["rows"] if r["family"] == family]
            peers = sorted({k for r in rows for k in r["peers"]})
            labels = [f"{r['op']}\n{r['shape']}" for r in rows]
            width = 0.8 / (1 + len(peers))
            fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(rows)), 4.5))
            for i, name in enumerate(["ours"] + peers):
                values = [r["ours"] if name == "ours" else r["peers"].get(name, 0) for r in rows]
                ax.bar([x + i * width for x in range(len(rows))], values, width,
                       label="cute-kernels" if name == "ours" else name)
            ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], labels, fontsize=7)
            ax.set_ylabel(" / ".join(sorted({r["metric"] for r in rows})))
            ax.set_title(f"{family} on {data.get('device', gpu)}")
            ax.legend(fontsize=8)
            ax.grid(axis="y", alpha=0.3)
            fig.tight_layout()
            fig.savefig(ROOT / "plots" / f"{family}.png", dpi=110)


def _grid_rows(data: dict) -> list:
    return [r for r in data["rows"] if r["op"] == "gemm_bf16_linear"]


def plot_gemm_grid(results: dict) -> None:
    """``bench_gemm.py --grid``: ours over each peer per real model shape (one bar per peer),
    ratios above 2 drawn at 2 and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for gpu, data in results.items():
        rows = _grid_rows(data)
        if not rows:
            continue
        peers = sorted({k for r in rows for k in r["peers"]})
        width = 0.8 / len(peers)
        fig, ax = plt.subplots(figsize=(max(10, 0.45 * len(rows)), 4.8))
        for i, peer in enumerate(peers):
            xs = [x + i * width for x, r in enumerate(rows) if peer in r["peers"]]
            ratios = [r["ours"] / r["peers"][peer] for r in rows if peer in r["peers"]]
            ax.bar(xs, [min(v, 2.0) for v in ratios], width, label=f"ours / {peer}")
            for x, v in zip(xs, ratios):
                if v > 2.0:
                    ax.annotate(f"{v:.1f}x", (x, 2.0), ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="gray", linewidth=1)
        ax.axhline(0.9, color="gray", linestyle=":", linewidth=1)
        ax.set_ylim(0, 2.15)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], [r["shape"] for r in rows],
                      rotation=70, fontsize=7)
        ax.set_ylabel("speed ratio (TFLOP/s)")
        ax.set_title(f"bf16 GEMM at real model shapes (M x N x K, weight (N, K)) on {data.get('device', gpu)}")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(ROOT / "plots" / "gemm_grid.png", dpi=110)
        return


def _n(shape: str) -> int:
    return int(shape.split("x")[-1])


def _elements(shape: str) -> int:
    m, n = shape.split("x")
    return int(m) * int(n)


def main():
    results = load()
    doc = ROOT.parent / "BENCHMARKS.md"
    text = doc.read_text()
    start, end = text.index(MARK_BEGIN) + len(MARK_BEGIN), text.index(MARK_END)
    doc.write_text(text[:start] + "\n" + markdown(results) + contest_markdown() + text[end:])
    plot_softmax(results)
    plot_attention(results)
    plot_families(results)
    plot_gemm_grid(results)


if __name__ == "__main__":
    main()
