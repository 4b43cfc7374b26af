"""Head against base for the reports `run.sh` wrote: one markdown table of the headline figures, as ratios.

    python benchmarks/ab/compare.py OUT_DIR [PLOT.png] > table.md

A ratio is head / base for a rate (higher is faster) and base / head for a time (higher is faster too), so
every ratio above 1 means the newer commit is faster.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(out: Path) -> list[tuple[str, str, float, float, bool]]:
    """(benchmark, figure, base, head, is_time) for every headline figure present in both reports."""
    found = []
    for name, figures in FIGURES.items():
        base, head = (out / f"{name}-{side}.json" for side in ("base", "head"))
        if base.is_file() and head.is_file():
            b, h = figures(json.loads(base.read_text())), figures(json.loads(head.read_text()))
            found += [(name, label, b[label][0], h[label][0], b[label][1]) for label in b if label in h]
    return found


def compression(report: dict) -> dict[str, tuple[float, bool]]:
    figures = {}
    for r in report["results"]:
        figures[f"{r['policy']} output tok/s"] = (r["output_tokens_per_s"], False)
        figures[f"{r['policy']} decode tok/s"] = (r["decode_tokens_per_s"], False)
    return figures


def offload(report: dict) -> dict[str, tuple[float, bool]]:
    return {
        f"{r['policy']} ({r['tier']}) {r['context']} tokens, batch {r['batch']}: ms/step": (r["ms_per_step"], True)
        for r in report["results"]
    }


def prompt_cache(report: dict) -> dict[str, tuple[float, bool]]:
    return {
        f"{r['method']} {r['target_tokens']} tokens: median TTFT (s)": (r["median_ttft_s"], True)
        for r in report["results"]
    }


def prefill(report: dict) -> dict[str, tuple[float, bool]]:
    return {
        f"{method} {length} tokens: TTFT (s)": (seconds, True)
        for method, by_length in report["results"]["ttft_s"].items()
        for length, seconds in by_length.items()
    }


def latency(report: dict) -> dict[str, tuple[float, bool]]:
    (r,) = [r for r in report["results"] if r["engine"] == "kvserve"]
    figures = {f"prefill {n} tokens (s)": (s, True) for n, s in r["prefill_s"].items()}
    figures["decode tok/s"] = (r["decode_tokens_per_s"], False)
    return figures


def speed(report: dict) -> dict[str, tuple[float, bool]]:
    (r,) = [r for r in report["results"] if r["engine"].startswith("kvserve")]
    figures = {f"prefill {n} tokens (s)": (s, True) for n, s in r["prefill_s"].items()}
    figures["decode b=1 tok/s"] = (r["decode_tokens_per_s"], False)
    figures.update({f"{b} sequences tok/s": (t, False) for b, t in r["batch_tokens_per_s"].items()})
    return figures


def throughput(report: dict) -> dict[str, tuple[float, bool]]:
    (r,) = [r for r in report["results"] if r["engine"] == "kvserve"]
    return {"output tok/s": (r["output_tokens_per_s"], False)}


def prefix(report: dict) -> dict[str, tuple[float, bool]]:
    return {
        f"prefix caching {'on' if r['prefix_caching'] else 'off'}: wall time (s)": (r["seconds"], True)
        for r in report["results"]
    }


FIGURES = {
    "compression": compression, "offload": offload, "prompt-cache": prompt_cache, "prefill": prefill,
    "latency": latency, "speed": speed, "throughput": throughput, "prefix": prefix,
}  # fmt: skip


def plot(found: list[tuple[str, str, float, float, bool]], path: Path) -> None:
    """One horizontal bar per figure: head vs base, with the 1.0 line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{name}: {label}" for name, label, *_ in found]
    ratios = [base / head if is_time else head / base for _, _, base, head, is_time in found]
    fig, ax = plt.subplots(figsize=(9, 0.28 * len(found) + 1.2))
    ax.barh(range(len(found)), ratios, color=["tab:green" if r >= 1 else "tab:orange" for r in ratios])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(found)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("head vs base (> 1: the newer commit is faster)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    out = Path(sys.argv[1])
    found = rows(out)
    print("| benchmark | figure | base | head | head vs base (>1: faster) |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, label, base, head, is_time in found:
        ratio = base / head if is_time else head / base
        print(f"| {name} | {label} | {base:.4g} | {head:.4g} | {ratio:.2f}x |")
    if len(sys.argv) > 2:
        plot(found, Path(sys.argv[2]))


if __name__ == "__main__":
    main()
