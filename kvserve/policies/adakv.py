"""Ada-KV (Feng et al. 2024, https://arxiv.org/abs/2407.11550): SnapKV's scores, budgets allocated across KV heads.

SnapKV gives every KV head of a layer the same number of tokens. Attention is concentrated in some heads and
spread in others, so a layer loses less when the heads that spread get more: Ada-KV ranks the older candidates
of all the layer's heads together (the votes are softmax probabilities, comparable across heads) and keeps the
layer's best ``Hkv * (keep - window)`` of them, wherever they fall. A safeguard first gives every head
``safeguard`` of its even share, its own best (the authors' and kvpress's ``alpha_safeguard``, 0.2), so no head is
starved. Every head keeps the observation window, as in SnapKV.

A layer then holds ``keep`` slots as before, but its heads hold different numbers of tokens: the compressed cache
packs them head after head into the slots (``attention/head_budgets.py``), so the memory is the same as
SnapKV's at the same budget. Per-head budgets are allocated where a prefill chunk outgrows the layer's target;
while decoding, the tokens added since are kept within the budget by their slot scores as in SnapKV (the packed
prompt stays as it was allocated). With one KV head per layer Ada-KV is SnapKV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.policies.snapkv import SnapKV


@dataclass(frozen=True)
class AdaKV(SnapKV):
    safeguard: float = 0.2  # share of a head's even budget it keeps whatever the other heads score

    name = "adakv"
    head_budgets = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.safeguard <= 1:
            raise ValueError(f"adakv safeguard must be in [0, 1], got {self.safeguard!r}")

    def select_heads(self, scores: list[torch.Tensor], keep: int) -> list[torch.Tensor]:
        """Which candidates each KV head keeps, ``Hkv * keep`` in all: ``scores[h]`` (n_h,) float32 are head h's
        candidates' votes in position order (the newest last); returns each head's kept indices, ascending.

        Every head keeps its last ``window_kept(keep)`` candidates; of the older ones, each head first its best
        ``safeguard`` share of ``keep - window``, then the layer's best pooled scores across heads fill the rest."""
        heads = len(scores)
        recent = self.window_kept(keep)
        older = [s.shape[0] - recent for s in scores]
        if min(older) < 0:
            raise ValueError(f"each head needs {recent} candidates for the window, got {[s.shape[0] for s in scores]}")
        share = keep - recent
        floor = min(int(self.safeguard * share), min(older))
        pooled = [self.pool(s[:n, None])[:, 0] if n else s[:0] for s, n in zip(scores, older, strict=True)]
        ranked = []
        for p in pooled:  # a head's safeguarded best rank above every score
            p = p.clone()
            p[torch.topk(p, floor).indices] = float("inf")
            ranked.append(p)
        flat = torch.cat(ranked)
        chosen = torch.topk(flat, heads * share).indices.sort().values
        kept = []
        offset = 0
        for n, s in zip(older, scores, strict=True):
            mine = chosen[(chosen >= offset) & (chosen < offset + n)] - offset
            window = torch.arange(n, s.shape[0], device=s.device)
            kept.append(torch.cat((mine, window)))
            offset += n
        return kept
