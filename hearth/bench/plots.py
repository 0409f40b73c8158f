"""Plots of the benchmark reports (matplotlib, written to a file; no display needed)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def roofline_plot(report: dict, out: str | Path) -> Path:
    """Attainable FLOP/s against arithmetic intensity: the memory slope, the compute roof, and a
    point per phase and batch size at its ceiling (hollow) and, if measured, at hearth's rate."""
    plt = _pyplot()
    m = report["machine"]
    rows = report["rows"]
    intensities = [r["arithmetic_intensity"] for r in rows] + [m["ridge_flops_per_byte"]]
    lo, hi = min(intensities) / 4, max(intensities) * 4
    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs = [lo, m["ridge_flops_per_byte"], hi]
    ax.plot(xs, [min(x * m["bandwidth"], m["flops"]) / 1e9 for x in xs], color="black", lw=2,
            label=f"roof: {m['bandwidth'] / 1e9:.1f} GB/s, {m['flops'] / 1e9:.0f} GFLOP/s ({m['dtype']})")
    for kind, peak in m.get("flops_by_dtype", {}).items():  # the other matmul roofs, for reference
        if kind != m["dtype"]:
            ridge = peak / m["bandwidth"]
            ax.plot([ridge, hi], [peak / 1e9, peak / 1e9], color="gray", lw=1, ls="--")
            ax.annotate(f"{kind} matmul", (hi, peak / 1e9), textcoords="offset points", xytext=(-60, 3), fontsize=7,
                        color="gray")
    colors = {"prefill": "tab:orange", "decode": "tab:blue"}
    for i, r in enumerate(rows):
        x = r["arithmetic_intensity"]
        ceiling = min(x * m["bandwidth"], m["flops"]) / 1e9
        label = f"{r['phase']} B={r['batch_size']}"
        ax.scatter([x], [ceiling], facecolors="none", edgecolors=colors[r["phase"]], s=60)
        ax.annotate(label, (x, ceiling), textcoords="offset points", xytext=(5, -14 - 10 * (i % 3)), fontsize=8)
        if "measured_tokens_per_s" in r:
            achieved = r["flops_per_step"] / r["tokens_per_step"] * r["measured_tokens_per_s"] / 1e9
            ax.scatter([x], [achieved], color=colors[r["phase"]], s=40)
            ax.plot([x, x], [achieved, ceiling], color=colors[r["phase"]], lw=0.8, ls=":")
    ax.scatter([], [], facecolors="none", edgecolors="gray", label="ceiling")
    if any("measured_tokens_per_s" in r for r in rows):
        ax.scatter([], [], color="gray", label="hearth, measured")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs / byte)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(f"roofline: {Path(report['model']).name}, context {report['context']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def serve_plot(report: dict, out: str | Path) -> Path:
    """Latency percentiles (TTFT, TPOT, end to end) and throughput against the load of each run."""
    plt = _pyplot()
    runs = report["runs"]
    kind = runs[0]["load"]
    runs = [r for r in runs if r["load"] == kind]
    loads = [r[kind] for r in runs]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    for ax, metric, title in zip(axes, ("ttft", "tpot", "e2el"), ("time to first token", "time per output token", "end-to-end latency")):
        for q, style in zip((50, 90, 99), ("-o", "--s", ":^")):
            ax.plot(loads, [r[f"p{q}_{metric}_ms"] for r in runs], style, label=f"p{q}")
        ax.set_title(title)
        ax.set_ylabel("ms")
    ax = axes[3]
    ax.plot(loads, [r["output_throughput"] for r in runs], "-o", label="output tokens/s")
    if "goodput" in runs[0]:
        ax2 = ax.twinx()
        ax2.plot(loads, [r["goodput"] for r in runs], "--s", color="tab:green", label="goodput (req/s)")
        ax2.set_ylabel("req/s")
        ax2.legend(loc="lower right", fontsize=8)
    ax.set_title("throughput")
    ax.set_ylabel("tokens/s")
    spread = max(loads) / min(loads) if min(loads) > 0 else 1
    for ax in axes:
        if spread >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency" if kind == "concurrency" else "request rate (req/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"{report['model']} at {report['base_url']}")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
