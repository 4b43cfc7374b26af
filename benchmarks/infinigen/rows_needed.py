"""How many rows each layer must read to keep a share of its attention, by what predicts the attention.

On InfiniGen's calibration sample (the first 2,048 tokens of Emma, 128 query rows in its second half, as
``kvserve infinigen-setup``), for each speculating layer and three predictors of its attention logits:

- ``rehearsal``: InfiniGen's, layer i's partial query from layer i - 1's attention input (the paper's prefetch);
- ``own query``: the skewed partial dimensions of layer i's own query (no prefetch: the layer's projection first);
- ``exact``: the exact logits (the best any ranking can do under the same count rule).

Each column is the mean share of a row's earlier tokens the layer reads at the alpha the calibration would
choose for that predictor (``ThresholdCalibration``: ``--mass`` of the attention on ``--quantile`` of the rows).
The mean over all layers counts layer 0 (and window layers) as reading everything, as the accuracy tables do.

    python benchmarks/infinigen/rows_needed.py --threads 2 --output benchmarks/infinigen/rows-needed.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvserve.bench.machine import describe_machine, machine_line
from kvserve.cli import build_parser, load_from_args
from kvserve.policies.calibration import ThresholdCalibration, candidates, partial_logits
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
    valid = candidates(sample, sample.keys[0].shape[0])
    target = ThresholdCalibration(args.mass, args.quantile)
    layers = {}
    with torch.inference_mode():
        for layer in range(1, cfg.num_layers):
            if cfg.layer_windows and cfg.layer_windows[layer] is not None:
                continue
            keys = sample.keys[layer].to(rehearsal.skew.dtype)
            partial_k = rehearsal.partial_key(layer, keys).transpose(0, 1)[:, None]  # (Hkv, 1, n, r)
            q = sample.queries[layer].float().view(len(sample.rows), cfg.num_kv_heads, -1, cfg.head_dim)
            exact = partial_logits(q.transpose(0, 1), keys.float().transpose(0, 1)[:, None], cfg.head_dim)
            exact = exact.transpose(0, 1)  # (R, Hkv, G, n)
            queries = {
                "rehearsal": rehearsal.partial_query(layer, sample.inputs[layer - 1], sample.rope[layer - 1]),
                "own query": rehearsal.partial_from_query(layer, sample.queries[layer]),
            }
            logits = {
                n: partial_logits(q.transpose(0, 1), partial_k, cfg.head_dim).transpose(0, 1)
                for n, q in queries.items()
            }
            logits["exact"] = exact
            layers[layer] = {}
            for name in PREDICTORS:
                alpha = target.layer_alpha(target.row_alphas(logits[name], exact, valid))
                counts = speculate(logits[name], valid, alpha).counts
                layers[layer][name] = float((counts.float() / valid.sum(-1).float()).mean())
            print(f"layer {layer}: " + ", ".join(f"{n} {v:.3f}" for n, v in layers[layer].items()), file=sys.stderr)
    unspeculated = cfg.num_layers - len(layers)
    mean = {n: (sum(row[n] for row in layers.values()) + unspeculated) / cfg.num_layers for n in PREDICTORS}
    report = {
        "command": " ".join(sys.argv), "machine": machine_line(describe_machine()),
        "threads": torch.get_num_threads(), "model": Path(loaded.path).name,
        "mass": args.mass, "quantile": args.quantile, "layers": layers, "mean_all_layers": mean,
    }  # fmt: skip
    lines = [f"Rows read per layer to keep {args.mass:.0%} of the attention on {args.quantile:.0%} of the sample's "
             f"rows ({report['model']}; `{report['command']}`; {report['machine']})", "",
             "| layer | " + " | ".join(PREDICTORS) + " |", "| ---: |" + " ---: |" * len(PREDICTORS)]  # fmt: skip
    lines += [f"| {layer} | " + " | ".join(f"{row[n]:.1%}" for n in PREDICTORS) + " |" for layer, row in layers.items()]
    lines.append("| **all layers** | " + " | ".join(f"**{mean[n]:.1%}**" for n in PREDICTORS) + " |")
    print("\n".join(lines))
    if args.output:
        args.output.write_text(json.dumps(report, indent=1) + "\n")
        args.output.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
