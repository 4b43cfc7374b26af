"""How much of the true attention InfiniGen's selection captures, and what loses the rest.

One 2,048-token WikiText-2 window runs through the model once; for every layer i >= 1 we keep the true
rotated queries and keys and the attention inputs of layers i and i - 1. For the last ``--rows`` query
rows (each over all earlier tokens), four selections of the same size rule (a token is fetched if its
logit is within alpha of the row's best; one count per row, the mean over heads; each KV head its own
top tokens) are compared by the share of the true attention weight (mean over the query heads of a KV
head) that lands on the selected tokens:

- ``true logits``: the rule applied to the exact logits (what the threshold alone costs);
- ``same layer, partial``: layer i's own input, skewed, partial dimensions (what the partial ratio costs);
- ``previous layer, full dims``: layer i - 1's input with every skewed dimension (what speculating one
  layer ahead costs);
- ``InfiniGen``: layer i - 1's input, partial dimensions: what the engine does.

    python benchmarks/infinigen/speculation.py --threads 2

writes benchmarks/infinigen/speculation.json (and prints a Markdown table).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvserve.attention.backend import AttentionMetadata
from kvserve.attention.contiguous import ContiguousKVCache
from kvserve.eval.data import WIKITEXT2
from kvserve.models import load_model
from kvserve.policies.infinigen import Rehearsal, partial_logits, speculate
from kvserve.policies.skewing import skewing_for

HERE = Path(__file__).parent


class _Recorder(ContiguousKVCache):
    """Keeps every layer's attention input, rotated queries and keys, and each layer's rotary tables (which
    differ per layer on Gemma 3: local and global layers have their own bases)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - ContiguousKVCache's
        super().__init__(*args, **kwargs)
        self.inputs, self.queries, self.keys, self.ropes = {}, {}, {}, {}

    def observe_input(self, layer, x, rope, metadata) -> None:  # noqa: ANN001 - AttentionBackend's
        # The model passes layer + 1's tables here: what the rehearsal of layer + 1 rotates with.
        self.inputs[layer], self.ropes[layer + 1] = x.clone(), rope

    def forward(self, layer, q, k, v, metadata):  # noqa: ANN001, ANN201 - AttentionBackend's
        self.queries[layer], self.keys[layer] = q.clone(), k.clone()
        return super().forward(layer, q, k, v, metadata)


def captured_mass(selection, weights: torch.Tensor) -> float:  # noqa: ANN001 - Selection
    """Mean over rows and KV heads of the true weight (R, Hkv, n) on the chosen tokens."""
    chosen = selection.chosen[:, None, :].expand_as(selection.index)
    picked = torch.zeros_like(weights, dtype=torch.bool)
    picked.scatter_(2, selection.index.where(chosen, selection.index[..., :1]), True)
    return float((weights * picked).sum(-1).mean())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=64, help="last query rows examined")
    parser.add_argument("--alphas", default="1,4,9")
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--output", type=Path, default=HERE / "speculation.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(dtype=torch.float32)
    cfg = loaded.config
    ids = loaded.tokenizer.encode(WIKITEXT2.read_text(encoding="utf-8"), add_special_tokens=False)[: args.tokens]
    n = len(ids)
    recorder = _Recorder(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, n, torch.float32)
    with torch.inference_mode():
        loaded.model(torch.tensor(ids), torch.arange(n), recorder, AttentionMetadata((0,), (n,), (0,)))
    skewing, _ = skewing_for(loaded)
    group = cfg.num_heads // cfg.num_kv_heads
    partial = Rehearsal(loaded.model, skewing.partial(max(1, round(args.ratio * cfg.head_dim))))
    everything = Rehearsal(loaded.model, skewing.partial(cfg.head_dim))
    rows = torch.arange(n - args.rows, n)
    valid = torch.arange(n)[None, :] < rows[:, None]  # earlier tokens only
    results = {}
    with torch.inference_mode():
        for alpha in (float(a) for a in args.alphas.split(",")):
            sums = dict.fromkeys(("true logits", "same layer, partial", "previous layer, full dims", "InfiniGen"), 0.0)
            fetched = 0.0
            for layer in range(1, cfg.num_layers):
                q = recorder.queries[layer][rows].view(args.rows, cfg.num_kv_heads, group, cfg.head_dim)
                k = recorder.keys[layer].transpose(0, 1)  # (Hkv, n, D)
                rope = (recorder.ropes[layer][0][rows], recorder.ropes[layer][1][rows])  # this layer's rotation
                true = partial_logits(q.transpose(0, 1), k[:, None], cfg.head_dim).transpose(0, 1)  # (R, Hkv, G, n)
                weights = torch.softmax(true.masked_fill(~valid[:, None, None, :], float("-inf")), -1).mean(2)
                variants = {
                    "true logits": true,
                    "same layer, partial": _speculated(partial, layer, recorder.inputs[layer][rows], rope, k),
                    "previous layer, full dims": _speculated(
                        everything, layer, recorder.inputs[layer - 1][rows], rope, k
                    ),  # noqa: E501
                    "InfiniGen": _speculated(partial, layer, recorder.inputs[layer - 1][rows], rope, k),
                }
                for name, logits in variants.items():
                    sums[name] += captured_mass(speculate(logits, valid, alpha), weights)
                fetched += float((speculate(variants["InfiniGen"], valid, alpha).counts / valid.sum(-1)).mean())
            results[alpha] = {name: total / (cfg.num_layers - 1) for name, total in sums.items()}
            results[alpha]["InfiniGen fetch fraction"] = fetched / (cfg.num_layers - 1)
    lines = ["| alpha | " + " | ".join(next(iter(results.values()))) + " |", "|" + " ---: |" * 6]
    for alpha, row in results.items():
        lines.append(f"| {alpha:g} | " + " | ".join(f"{v:.3f}" for v in row.values()) + " |")
    print("\n".join(lines))
    report = {"command": " ".join(sys.argv), "model": loaded.path.name, "tokens": n, "rows": args.rows,
              "ratio": args.ratio, "results": results}  # fmt: skip
    args.output.write_text(json.dumps(report, indent=2))
    return 0


def _speculated(rehearsal: Rehearsal, layer: int, x: torch.Tensor, rope, keys: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """Speculated logits (R, Hkv, G, n) of ``layer`` from attention input x (R, hidden) and its keys (Hkv, n, D)."""
    partial_q = rehearsal.partial_query(layer, x, rope)  # (R, Hkv, G, r)
    partial_k = torch.matmul(keys, rehearsal.skew[layer])  # (Hkv, n, r)
    return partial_logits(partial_q.transpose(0, 1), partial_k[:, None], rehearsal.head_dim).transpose(0, 1)


if __name__ == "__main__":
    sys.exit(main())
