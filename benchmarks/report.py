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
    head = ["op", "shape", "dtype", "ours"] + peers + [f"ours/{p}" for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        values = [r["op"], r["shape"], r["dtype"], f"{r['ours']:.0f} {r['metric']}"]
        values += [f"{r['peers'][p]:.0f}" if p in r["peers"] else "" for p in peers]
        values += [f"{r['ours'] / r['peers'][p]:.3f}x" if p in r['peers'] else '' for p in peers]
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines)


def markdown(results: dict) -> str:
    out = []
    for gpu, data in results.items():
        ceil = data.get("ceilings", {})
        out.append(f"### {data.get('device', gpu)} ({data.get('date', '?')}; DSL {data.get('dsl', '?')}, "
                   f"torch {data.get('torch', '?')})")
        out.append(f"Ceilings measured in the same run: copy {ceil.get('copy_GBps', '?')} GB/s, "
                   f"bf16 matmul {ceil.get('bf16_mm_TFLOPs', '?')} TFLOP/s.")
        families = []
        for r in data["rows"]:
            if r["family"] not in families:
                families.append(r["family"])
        for family in families:
            out.append(f"\n#### {family}\n")
            out.append(table([r for r in data["rows"] if r["family"] == family]))
            out.append(f"\n![{family}](benchmarks/plots/{family}.png)")
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


def plot_softmax(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for gpu, data in results.items():
        rows = [r for r in data["rows"] if r["family"] == "softmax"]
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        for ax, op in zip(axes, ("softmax_fwd", "softmax_bwd")):
            sweep = sorted(
                (r for r in rows if r["op"] == op and _elements(r["shape"]) == 1 << 27),
                key=lambda r: _n(r["shape"]),
            )
            if not sweep:
                continue
            ns = [_n(r["shape"]) for r in sweep]
            ax.plot(ns, [r["ours"] for r in sweep], "o-", label="cute-kernels", linewidth=2)
            for peer in sorted({k for r in sweep for k in r["peers"]}):
                ax.plot(ns, [r["peers"].get(peer) for r in sweep], ".--", label=peer)
            ax.axhline(data["ceilings"]["copy_GBps"], color="gray", linestyle=":", label="device copy")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("N (M = 2^27 / N), bf16")
            ax.set_title(op)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("GB/s (read + written)")
        axes[0].legend()
        fig.suptitle(f"softmax on {data.get('device', gpu)}")
        fig.tight_layout()
        (ROOT / "plots").mkdir(exist_ok=True)
        fig.savefig(ROOT / "plots" / "softmax.png", dpi=110)


def plot_attention(results: dict) -> None:
    """TFLOP/s against sequence length (head dim 128, 16 heads, 16k tokens), without and with a
    causal mask: ours and each peer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for gpu, data in results.items():
        rows = [r for r in data["rows"] if r["family"] == "attention"]
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        for ax, op in zip(axes, ("attn_fwd_full", "attn_fwd_causal")):
            sweep = sorted((r for r in rows if r["op"] == op and _attention_sweep(r["shape"])),
                           key=lambda r: int(r["shape"].split("x")[1]))
            if not sweep:
                continue
            lengths = [int(r["shape"].split("x")[1]) for r in sweep]
            ax.plot(lengths, [r["ours"] for r in sweep], "o-", label="cute-kernels", linewidth=2)
            for peer in sorted({k for r in sweep for k in r["peers"]}):
                ax.plot(lengths, [r["peers"].get(peer) for r in sweep], ".--", label=peer)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length (batch = 16384 / S), hdim 128, 16 heads, bf16")
            ax.set_title(op)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("TFLOP/s")
        axes[0].legend()
        fig.suptitle(f"attention forward on {data.get('device', gpu)}")
        fig.tight_layout()
        (ROOT / "plots").mkdir(exist_ok=True)
        fig.savefig(ROOT / "plots" / "attention.png", dpi=110)


def _attention_sweep(shape: str) -> bool:
    batch, seqlen, heads, heads_kv, dim = (int(x) for x in shape.split("x"))
    return dim == 128 and heads == heads_kv == 16 and batch * seqlen == 16384


def plot_families(results: dict) -> None:
    """One bar chart per family (other than softmax and attention): ours and each peer, per op
    and shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for gpu, data in results.items():
        for family in sorted({r["family"] for r in data["rows"]} - {"softmax", "attention"}):
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
    doc.write_text(text[:start] + "\n" + markdown(results) + text[end:])
    plot_softmax(results)
    plot_attention(results)
    plot_families(results)


if __name__ == "__main__":
    main()
