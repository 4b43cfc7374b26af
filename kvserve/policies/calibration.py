"""InfiniGen's threshold calibrated per layer: the smallest alpha whose selection keeps a target share of attention.

InfiniGen (Lee et al., OSDI'24, https://arxiv.org/abs/2406.19707) fetches the tokens whose speculated logit is
within a fixed alpha (4) of the best one, a threshold set on models (OPT, Llama-2 at 6.7B-70B) that concentrate
their attention. A model that spreads it, and spreads it differently per layer, loses most of its accuracy at
that alpha (SmolLM2-135M: +69% WikiText-2 perplexity, benchmarks/infinigen/README.md), although the rehearsal
ranks the tokens well. So kvserve chooses each layer's alpha from the attention mass it must keep.

On the sample text that skews the heads (``policies/skewing.py``), for each layer i >= 1 and each calibration
query row: the rehearsal's speculated logits (layer i's partial query from layer i - 1's input, against the
partial keys of the row's earlier tokens) rank the tokens per KV head as decode does, and the exact attention
weights (softmax over the earlier tokens, mean over a KV head's query heads) say how much of the row's attention
each KV head's top c tokens hold. The row's alpha is the smallest whose count (``speculate``'s rule: the mean
over query heads of each head's tokens within alpha of its best, truncated) reaches the smallest c that keeps
``mass`` of it (mean over KV heads). The layer's alpha is the smallest at which a share ``quantile`` of the rows
keep ``mass``. Layer 0 reads its whole cache (its alpha, 0, is never used) unless it has a sliding window;
sliding-window layers (Gemma 3) speculate from their own query among their window's rows and keep
``window_mass``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.attention.softcap import cap_logits
from kvserve.policies.infinigen import Rehearsal, Selection, partial_logits

# A row's alpha is one of its own logit gaps, which float32 rounding in ``peak - alpha`` may miss by an ulp:
# the threshold is raised by this much (relative) so that speculation counts the token that set it.
ROUNDING_SLACK = 1e-5


@dataclass(frozen=True)
class ThresholdCalibration:
    """What a calibrated alpha guarantees on the sample: a share ``quantile`` of its rows keep ``mass`` of
    their attention (InfiniGen, Lee et al., OSDI'24, https://arxiv.org/abs/2406.19707; see the module doc)."""

    mass: float = 0.92  # share of a row's exact attention weight the selected tokens must hold
    quantile: float = 0.9  # share of the calibration rows that must reach ``mass``
    # ``mass`` in sliding-window layers (Gemma 3): they are many (15 of 18) and each one's loss adds up, where
    # the few global layers lose little (WikiText-2 +3.65% from the window layers at 0.92, +0.20% from the rest).
    window_mass: float = 0.94

    def for_window(self) -> ThresholdCalibration:
        """This target as a sliding-window layer keeps it."""
        return dataclasses.replace(self, mass=self.window_mass)

    def describe(self, layer_windows: Sequence[int | None]) -> str:
        """What the alphas keep, in words (the window layers' share only for a model that has them)."""
        windowed = any(w is not None for w in layer_windows)
        window = f" (sliding-window layers {self.window_mass:g})" if windowed else ""
        return f"{self.mass:g}{window} of the attention on {self.quantile:g} of the sample's rows"

    def __post_init__(self) -> None:
        for name in ("mass", "quantile", "window_mass"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 1):
                raise ValueError(f"infinigen calibration {name} must be in (0, 1], got {value!r}")

    def row_alphas(self, speculated: torch.Tensor, exact: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The smallest alpha per row at which speculation keeps ``mass``: (R,) float32.

        speculated, exact (R, Hkv, G, n) float32 logits over the candidates; valid (R, n) bool: a row's
        candidates (its earlier tokens; at least one per row)."""
        hidden = ~valid[:, None, None, :]
        speculated = speculated.masked_fill(hidden, float("-inf"))
        weights = torch.softmax(exact.masked_fill(hidden, float("-inf")), dim=-1).mean(dim=2)  # (R, Hkv, n)
        ranked = speculated.amax(dim=2).argsort(dim=-1, descending=True)  # (R, Hkv, n): what each KV head fetches
        kept = weights.gather(-1, ranked).cumsum(dim=-1).mean(dim=1)  # (R, n): mass of every head's top c + 1
        needed = ((kept < self.mass).sum(dim=-1) + 1).clamp(max=valid.sum(dim=-1))  # (R,) smallest count
        # count(alpha) >= c  <=>  at least H * c of the (head, token) gaps to the head's best are <= alpha.
        gaps = (speculated.amax(dim=-1, keepdim=True) - speculated).flatten(1).sort(dim=-1).values  # (R, H * n)
        heads = speculated.shape[1] * speculated.shape[2]
        alphas = gaps.gather(1, (heads * needed - 1)[:, None]).squeeze(1)  # (R,)
        return alphas * (1 + ROUNDING_SLACK)

    def layer_alpha(self, row_alphas: torch.Tensor) -> float:
        """The smallest alpha at which a share ``quantile`` of the rows keep ``mass``: the k-th smallest row
        alpha, k = ceil(quantile * R)."""
        k = max(1, math.ceil(self.quantile * row_alphas.numel() - 1e-9))
        return float(row_alphas.float().sort().values[k - 1])


def kept_mass(selection: Selection, exact: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The share of each row's exact attention weight on the tokens ``selection`` fetches, mean over KV heads:
    (R,) float32. exact (R, Hkv, G, n) logits; valid (R, n) bool, the candidates."""
    weights = torch.softmax(exact.masked_fill(~valid[:, None, None, :], float("-inf")), -1).mean(2)  # (R, Hkv, n)
    chosen = selection.chosen[:, None, :].expand_as(selection.index)
    picked = torch.zeros_like(weights, dtype=torch.bool)  # (R, Hkv, n)
    picked.scatter_(2, selection.index.where(chosen, selection.index[..., :1]), True)
    return (weights * picked).sum(dim=-1).mean(dim=1)


@dataclass(frozen=True)
class SampleRows:
    """What calibration needs of one run over the sample text, for the calibration rows only."""

    rows: torch.Tensor  # (R,) long: positions of the calibration rows
    inputs: list[torch.Tensor]  # per layer, (R, hidden): the attention input at those rows
    queries: list[torch.Tensor]  # per layer, (R, H, D): rotated queries at those rows
    keys: list[torch.Tensor]  # per layer, (n, Hkv, D): rotated keys of every token
    rope: list[tuple[torch.Tensor, torch.Tensor]]  # per layer i: rotary tables at the rows, as layer i + 1 uses


def layer_logits(
    sample: SampleRows, rehearsal: Rehearsal, layer: int, partial_q: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer`` at the calibration rows: speculated and exact logits, both (R, Hkv, G, n) float32.
    The speculation's partial queries (R, Hkv, G, r) are ``partial_q`` if given, else decode's: from layer - 1's
    input, or the layer's own query for ``Rehearsal.own_query_layers``."""
    keys = sample.keys[layer].to(rehearsal.skew.dtype)  # (n, Hkv, D)
    if partial_q is None and layer in rehearsal.own_query_layers:  # speculates from its own query, as decode does
        partial_q = rehearsal.partial_from_query(layer, sample.queries[layer])
    elif partial_q is None:
        partial_q = rehearsal.partial_query(layer, sample.inputs[layer - 1], sample.rope[layer - 1])
    partial_k = rehearsal.partial_key(layer, keys).transpose(0, 1)  # (Hkv, n, r)
    speculated = partial_logits(partial_q.transpose(0, 1), partial_k[:, None], rehearsal.head_dim)  # (Hkv, R, G, n)
    r, hkv, group = partial_q.shape[:3]
    q = sample.queries[layer].float().view(r, hkv, group, -1).transpose(0, 1)  # (Hkv, R, G, D)
    exact = partial_logits(q, keys.float().transpose(0, 1)[:, None], rehearsal.head_dim)  # (Hkv, R, G, n)
    exact = cap_logits(exact, rehearsal.softcap)  # the weights the layer's attention gives (Gemma 2's cap)
    return speculated.transpose(0, 1), exact.transpose(0, 1)


def candidates(sample: SampleRows, n: int, window: int | None = None) -> torch.Tensor:
    """(R, n) bool: each calibration row's earlier tokens (its own key is always read, so not a candidate); in a
    sliding-window layer only those within its window."""
    position = torch.arange(n)[None, :]
    earlier = position < sample.rows[:, None]
    return earlier & (position > sample.rows[:, None] - window) if window else earlier


@torch.inference_mode()
def calibrate_alphas(sample: SampleRows, rehearsal: Rehearsal, target: ThresholdCalibration) -> tuple[float, ...]:
    """Each layer's calibrated alpha for the rehearsal's partial dimensions (0, unused, where it does not
    speculate: a full-attention layer 0); a sliding-window layer's over the candidates in its window."""
    n = sample.keys[0].shape[0]
    alphas = []
    for layer in range(len(sample.keys)):
        if layer not in rehearsal.speculated_layers:
            alphas.append(0.0)
            continue
        window = rehearsal.layer_windows[layer] if rehearsal.layer_windows else None
        valid = candidates(sample, n, window)
        speculated, exact = layer_logits(sample, rehearsal, layer)
        kept = target.for_window() if window else target
        alphas.append(kept.layer_alpha(kept.row_alphas(speculated, exact, valid)))
    return tuple(alphas)


def calibration_rows(n: int, count: int) -> torch.Tensor:
    """``count`` query rows spread evenly over the second half of an n-token sample (long contexts, as decode
    has), at least position 1 so every row has a candidate: (R,) long, ascending, distinct."""
    if n < 2:
        raise ValueError(f"InfiniGen's calibration needs a sample of at least 2 tokens, got {n}")
    start = max(1, n // 2)
    return torch.linspace(start, n - 1, count).round().long().unique()
