"""Plots for benchmark reports (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def plot_decode_scaling(scaling: dict[str, dict[int, float]], path: Path, title: str) -> None:
    """Decode tokens/s against batch size, one line per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for engine, values in scaling.items():
        sizes = sorted(values)
        ax.plot(sizes, [values[b] for b in sizes], marker="o", label=engine)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (concurrent sequences)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Decode throughput vs batch size\n{title}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
