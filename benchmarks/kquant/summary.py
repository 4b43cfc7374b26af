"""The K-quant issue's figures from ``bench speed`` reports, one row per model: each engine's batch-1 decode, the
32 sequences' decode, prefill of 512 tokens (tokens/s), load time, peak RSS and batch-1 decode as a share of the copy
bandwidth, and kvserve over llama.cpp.

    python benchmarks/kquant/summary.py benchmarks/kquant/baseline-*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def figures(report: dict, result: dict) -> dict[str, float | None]:
    (batch,) = result["batch_decode_tokens_per_s"].values()
    (length,) = result["prefill_s"]
    rss = result.get("peak_rss_bytes")
    return {
        "decode b=1 (tok/s)": result["decode_tokens_per_s"],
        "decode 32 seqs (tok/s)": batch,
        f"prefill {length} (tok/s)": int(length) / result["prefill_s"][length],
        "load (s)": result["load_s"],
        "peak RSS (GiB)": rss / 2**30 if rss else None,
        "decode b=1 / copy bandwidth": result["decode_bytes_per_token"]
        * result["decode_tokens_per_s"]
        / (report["roofline"]["copy_gb_per_s"] * 1e9),
    }


def main() -> None:
    lines = []
    for path in map(Path, sys.argv[1:]):
        report = json.loads(path.read_text())
        ours, peer = (figures(report, r) for r in report["results"][:2])
        if not lines:
            lines += ["| model | engine | " + " | ".join(ours) + " |", "| --- | --- |" + " ---: |" * len(ours)]
        for name, values in ((report["results"][0]["engine"], ours), (report["results"][1]["engine"], peer)):
            cells = [f"{v:.0%}" if "bandwidth" in k else f"{v:.2f}" for k, v in values.items()]
            lines.append(f"| {report['model']} | {name} | " + " | ".join(cells) + " |")
        ratios = [f"**{ours[k] / peer[k]:.2f}x**" if ours[k] and peer[k] else "-" for k in ours]
        lines.append(f"| {report['model']} | **kvserve / llama.cpp** | " + " | ".join(ratios) + " |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
