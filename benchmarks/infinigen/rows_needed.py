"""How many rows each layer must read to keep a share of its attention, by what predicts the attention.

On InfiniGen's calibration sample (the first 2,048 tokens of Emma, 128 query rows in its second half, as
``kvserve infinigen-setup``), for every layer past the first and three predictors of its attention logits:

- ``rehearsal``: InfiniGen's, layer i's partial query from layer i - 1's attention input (the paper's prefetch);
- ``own query``: the skewed partial dimensions of layer i's own query (no prefetch: the layer's projection first);
- ``exact``: the exact logits (the best any ranking can do under the same count rule).

Each column is the mean share of a row's earlier tokens the layer reads at the alpha the calibration would
choose for that predictor (``ThresholdCalibration``: ``--mass`` of the attention on ``--quantile`` of the rows);
a sliding-window layer (Gemma 3) selects within its window. ``kvserve now`` is what the engine reads at
``--mass``: layer 0 everything it sees, layer 1 and window layers their own query's selection, the others the
rehearsal's (the engine's window layers keep ``--calibration-window-mass`` instead, and a window layer 0 selects
too: neither is modelled here). The last row averages over layers, as the accuracy tables do.

    python benchmarks/infinigen/rows_needed.py --threads 1 --output benchmarks/infinigen/rows-needed.json
    python benchmarks/infinigen/rows_needed.py --threads 1 --model gemma3-270m \
        --output benchmarks/infinigen/rows-needed-gemma3.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvserve.entrypoints.cli import build_parser
from kvserve.entrypoints.cli_common import load_from_args
from kvserve.platform.machine import describe_machine, machine_line
from kvserve.policies.calibration import SampleRows, ThresholdCalibration, candidates, layer_logits
from kvserve.policies.infinigen import InfiniGen, Rehearsal, speculate
from kvserve.policies.skewing import (
    CALIBRATION_ROWS,
    SAMPLE_TOKENS,
    calibration_rows,
    record_sample,
    sample_tokens,
    skew_recorded,
)

PREDICTORS = ("rehearsal", "own query", "exact")


def _predicted(
    sample: SampleRows,
    rehearsal: Rehearsal,
    layer: int,
    valid: torch.Tensor,
    earlier: torch.Tensor,
    target: ThresholdCalibration,
) -> dict[str, float]:
    """Per predictor, the mean share of each row's earlier tokens that ``layer`` reads at the calibrated alpha."""
    rehearsed = rehearsal.partial_query(layer, sample.inputs[layer - 1], sample.rope[layer - 1])
    logits = {}  # (R, Hkv, G, n) each
    logits["rehearsal"], logits["exact"] = layer_logits(sample, rehearsal, layer, rehearsed)
    logits["own query"], _ = layer_logits(
        sample, rehearsal, layer, rehearsal.partial_from_query(layer, sample.queries[layer])
    )
    shares = {}
    for name in PREDICTORS:
        alpha = target.layer_alpha(target.row_alphas(logits[name], logits["exact"], valid))
        counts = speculate(logits[name], valid, alpha).counts
        shares[name] = float((counts.float() / earlier.sum(-1).float()).mean())
    return shares


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--mass", type=float, default=ThresholdCalibration.mass)
    parser.add_argument("--quantile", type=float, default=ThresholdCalibration.quantile)
    parser.add_argument("--output", type=Path, default=None, help="writes OUTPUT (.json) and a .md beside it")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_from_args(
        build_parser().parse_args(["bench", "offload", "--model", args.model, "--dtype", args.dtype])
    )
    cfg = loaded.config
    ids = sample_tokens(loaded.tokenizer, min(SAMPLE_TOKENS, cfg.max_position_embeddings))
    recorder = record_sample(loaded.model, ids, calibration_rows(len(ids), CALIBRATION_ROWS))
    rehearsal = Rehearsal(
        loaded.model, skew_recorded(loaded.model, recorder).partial(InfiniGen().partial_dims(cfg.head_dim))
    )
    sample = recorder.sample()
    target = ThresholdCalibration(args.mass, args.quantile)
    layers = {}
    n = sample.keys[0].shape[0]
    earlier = candidates(sample, n)  # (R, n): the share is of each row's earlier tokens, as the accuracy tables'
    with torch.inference_mode():
        for layer in range(cfg.num_layers):
            window = cfg.layer_windows[layer] if cfg.layer_windows else None
            valid = candidates(sample, n, window)
            row = {"kvserve now": float((valid.sum(-1).float() / earlier.sum(-1)).mean())}  # window, or everything
            if layer > 0:
                row.update(_predicted(sample, rehearsal, layer, valid, earlier, target))
                row["kvserve now"] = row["own query" if layer in rehearsal.own_query_layers else "rehearsal"]
            layers[layer] = row
            print(f"layer {layer}: " + ", ".join(f"{n} {v:.3f}" for n, v in row.items()), file=sys.stderr)
    columns = ("kvserve now", *PREDICTORS)
    mean = {c: sum(row.get(c, row["kvserve now"]) for row in layers.values()) / cfg.num_layers for c in columns}
    report = {
        "command": " ".join(sys.argv), "machine": machine_line(describe_machine()),
        "threads": torch.get_num_threads(), "model": Path(loaded.path).name,
        "mass": args.mass, "quantile": args.quantile, "layers": layers, "mean_all_layers": mean,
    }  # fmt: skip
    lines = [f"Rows read per layer (share of a row's earlier tokens) to keep {args.mass:.0%} of the attention on "
             f"{args.quantile:.0%} of the sample's rows ({report['model']}; `{report['command']}`; "
             f"{report['machine']}, {report['threads']} threads). Window layers select within their window.", "",
             "| layer | " + " | ".join(columns) + " |", "| ---: |" + " ---: |" * len(columns)]  # fmt: skip
    lines += [f"| {layer} | " + " | ".join(f"{row[c]:.1%}" if c in row else "-" for c in columns) + " |"
              for layer, row in layers.items()]  # fmt: skip
    lines.append("| **all layers** | " + " | ".join(f"**{mean[c]:.1%}**" for c in columns) + " |")
    print("\n".join(lines))
    if args.output:
        args.output.write_text(json.dumps(report, indent=1) + "\n")
        args.output.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
