"""SnapKV (Li et al., NeurIPS'24, https://arxiv.org/abs/2404.14469) and PyramidKV (Cai et al. 2024,
https://arxiv.org/abs/2406.02069): each KV head keeps the tokens an observation window attends to.

At the end of a prompt (here: of each prefill chunk that outgrows the layer's budget) the last ``window``
queries vote: their attention over the older tokens, summed over the window and averaged over the query
heads that read each KV head (GQA), then smoothed along the sequence by an average pool of ``kernel_size``
(so a chosen token brings its neighbours: the paper's clustering). Every KV head keeps the window and its
own top-scored older tokens, so heads hold different tokens in the same slots (each head in position
order). PyramidKV is the same selection with budgets falling linearly with depth (``layer_schedule``).

While decoding, a slot's score is an exponential moving average of the attention its tokens receive (mean
over heads, as the compressed cache records it); a layer that outgrows its budget by a block keeps the
window's worth of recent slots and the best-scored others, the same slots in every head. The paper
compresses only the prompt; kvserve keeps every layer within its budget while decoding too.

Defaults follow the authors' and kvpress's code: average pooling, kernel 5; the window is 32 queries
(kvpress uses 64 on longer prompts) and at most ``MAX_WINDOW_SHARE_OF_KEEP`` of what a layer keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.policies.base import SCORES_RECENT, KVPolicy, recent_and_top
from kvserve.policies.layer_schedule import check_layer_schedule, pyramidkv_schedule
from kvserve.policies.pyramid import pyramid_schedule

MAX_WINDOW_SHARE_OF_KEEP = 0.5


@dataclass(frozen=True)
class SnapKV(KVPolicy):
    window: int = 32  # observation window: the last queries of a chunk, which vote and are always kept
    kernel_size: int = 5  # average pool over neighbouring tokens' scores (odd; 1: none)
    layer_schedule: str = "uniform"  # uniform | pyramidkv | pyramidinfer: how the budget spreads over layers
    pyramid_beta: float = 20.0  # pyramidkv: the last layer keeps budget / beta
    decode_decay: float = 0.9  # weight of the old scores at each decode step

    name = "snapkv"
    scores = SCORES_RECENT
    per_head = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"snapkv window must be an integer >= 1, got {self.window!r}")
        if not isinstance(self.kernel_size, int) or self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"snapkv kernel_size must be an odd integer >= 1, got {self.kernel_size!r}")
        check_layer_schedule(self.layer_schedule)
        if not self.pyramid_beta >= 1:
            raise ValueError(f"pyramid_beta must be >= 1, got {self.pyramid_beta!r}")
        if not 0 <= self.decode_decay < 1:
            raise ValueError(f"decode_decay must be in [0, 1), got {self.decode_decay!r}")

    def retention(self, num_layers: int) -> tuple[float, ...]:
        if self.layer_schedule == "pyramidkv":
            return pyramidkv_schedule(num_layers, self.budget, self.pyramid_beta)
        if self.layer_schedule == "pyramidinfer":
            return pyramid_schedule(num_layers, self.budget, min(0.4, 0.8 * self.budget))
        return super().retention(num_layers)

    def window_kept(self, keep: int) -> int:
        """Slots of the window among ``keep`` (the rest go to the best-scored older tokens)."""
        return min(self.window, max(1, int(MAX_WINDOW_SHARE_OF_KEEP * keep)))

    def votes(self, num_queries: int, num_tokens: int) -> tuple[int, torch.Tensor]:
        """The chunk's last ``window`` queries, summed (the paper's ``attn_weights.sum(dim=-2)``)."""
        first = num_queries - min(self.window, num_queries)
        return first, torch.ones(num_queries - first, dtype=torch.float32)

    def pool(self, scores: torch.Tensor) -> torch.Tensor:
        """Average pool of per-head scores (n, Hkv) along the sequence, same length."""
        if self.kernel_size == 1:
            return scores
        pad = self.kernel_size // 2
        pooled = F.avg_pool1d(scores.T[None], self.kernel_size, stride=1, padding=pad, count_include_pad=False)
        return pooled[0].T

    def select(self, scores: torch.Tensor | None, num_candidates: int, keep: int, num_tokens: int) -> torch.Tensor:
        """Prefill (per-head scores (n, Hkv)): each head's window and top older tokens, (keep, Hkv) ascending per
        head. Decode (slot scores (n,)): the recent window's slots and the best others, (keep,)."""
        recent = self.window_kept(keep)
        if scores.dim() == 1:
            return recent_and_top(scores, num_candidates, keep, recent)
        older = num_candidates - recent
        top = torch.topk(self.pool(scores)[:older], keep - recent, dim=0).indices.sort(dim=0).values  # (k, Hkv)
        window = torch.arange(older, num_candidates, device=scores.device)[:, None].expand(recent, scores.shape[1])
        return torch.cat((top, window))

    def score_update(self) -> tuple[float, float]:
        return self.decode_decay, 1 - self.decode_decay


@dataclass(frozen=True)
class PyramidKV(SnapKV):
    """SnapKV's selection under PyramidKV's linear layer schedule (the PyramidKV paper's method)."""

    layer_schedule: str = "pyramidkv"

    name = "pyramidkv"
