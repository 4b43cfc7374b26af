"""The KV policy interface: how many slots each layer keeps, and which ones.

A policy is a small frozen dataclass fed by kvserve's own metadata: the layer, the sequence's token
count, the attention weights the step computed (when the policy asks for them). It never sees
blocks; the runner compacts the slots a policy keeps and the KV manager frees the blocks left over.

Slots of a layer are kept in position order (compaction preserves order and new tokens append), so
"the most recent w tokens" are the last w slots and attention sinks are the first ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvserve.kv.row_codec import PlainRows
from kvserve.policies.scoring import head_column_sums

# What attention weights a policy scores slots by (see ``KVPolicy.scores``).
SCORES_NONE = "none"  # positional policies (full cache, local window)
SCORES_RECENT = "recent"  # the attention the most recent tokens pay (PyramidInfer)
SCORES_ACCUMULATED = "accumulated"  # attention summed over every query so far (H2O)


@dataclass(frozen=True)
class KVPolicy:
    """Lossless full cache; lossy policies subclass it.

    ``budget`` is the fraction of the full cache kept (averaged over layers); a layer never keeps fewer
    than ``min_tokens`` slots (or the whole sequence, if shorter). ``slack`` is how far a layer may grow
    past its capacity while decoding before it is compressed again (one block: compaction then frees a
    block at a time instead of running every step).
    """

    budget: float = 1.0
    min_tokens: int = 8

    name = "full"
    scores = SCORES_NONE
    drops_rows = False  # deeper layers compute only the tokens shallower ones kept (PyramidInfer)
    offload_only = False  # changes what an offloading engine fetches, not what a layer keeps (kv_offload)
    per_head = False  # scores and keeps tokens per KV head while prefilling (SnapKV); else the same in every head
    head_budgets = False  # heads of a layer keep different numbers of tokens (Ada-KV: ``select_heads``)
    rehearsed = False  # an offloading cache selects rows by rehearsing the next layer (InfiniGen: ``offload_state``)

    def __post_init__(self) -> None:
        if not 0 < self.budget <= 1:
            raise ValueError(f"kv_budget must be in (0, 1], got {self.budget!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 1:
            raise ValueError(f"min_tokens must be an integer >= 1, got {self.min_tokens!r}")

    @property
    def lossless(self) -> bool:
        return self.name == "full"

    @property
    def per_layer_groups(self) -> bool:
        """Whether layers keep different slots (one KV group per layer)."""
        return not self.lossless and not self.offload_only

    def row_codec(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> PlainRows:
        """How an offloading cache holds a row in its slower tier (``kv/row_codec.py``): as it is."""
        return PlainRows(num_kv_heads, head_dim, dtype)

    def offload_state(self, rehearsal: Any, **shape: Any) -> OffloadState | None:
        """What an offloading cache keeps beside its tier to choose the rows it fetches (InfiniGen: partial keys,
        speculation, the pool's counters), made for a cache of ``shape``; None: it fetches every row."""
        return None

    def retention(self, num_layers: int) -> tuple[float, ...]:
        """Fraction of the sequence each layer keeps; uniform unless a policy says otherwise."""
        return (self.budget,) * num_layers

    def capacity(self, layer: int, num_layers: int, num_tokens: int) -> int:
        """Slots ``layer`` keeps for a sequence of ``num_tokens`` tokens."""
        if self.lossless:
            return num_tokens
        return self._keep(self.retention(num_layers)[layer], num_tokens)

    def _keep(self, fraction: float, num_tokens: int) -> int:
        return min(num_tokens, max(math.ceil(fraction * num_tokens), self.min_tokens))

    def slots_after(self, layer: int, num_layers: int, held: int, new: int, num_tokens: int, slack: int) -> int:
        """Slots ``layer`` holds after a step that adds ``new`` tokens to ``held`` slots, the sequence then
        being ``num_tokens`` long: everything, unless that passes capacity + slack; then capacity."""
        cap = self.capacity(layer, num_layers, num_tokens)
        return held + new if held + new <= cap + slack else cap

    def slots_after_per_layer(self, held: list[int], new: int, num_tokens: int, slack: int) -> list[int]:
        """``slots_after`` for every layer (``held[l]`` per layer), the retention schedule looked up once."""
        if self.lossless:
            return [h + new for h in held]
        caps = [self._keep(fraction, num_tokens) for fraction in self.retention(len(held))]
        return [h + new if h + new <= cap + slack else cap for h, cap in zip(held, caps, strict=True)]

    def select(self, scores: torch.Tensor | None, num_candidates: int, keep: int, num_tokens: int) -> torch.Tensor:
        """Which of ``num_candidates`` slots (in position order) to keep: (keep,) long, ascending.

        ``scores`` (num_candidates,) float32 are the policy's scores of every candidate, or None for a
        positional policy; ``num_tokens`` is the sequence's length. The base keeps the most recent
        ``keep`` (a lossless policy never asks). A ``per_head`` policy given per-head scores
        (num_candidates, Hkv) returns (keep, Hkv), ascending per head.
        """
        return torch.arange(num_candidates - keep, num_candidates)

    def votes(self, num_queries: int, num_tokens: int) -> tuple[int, torch.Tensor] | None:
        """Which of a chunk's ``num_queries`` queries score its candidates, and how much each counts:
        (first, weights (num_queries - first,) float32) for queries first.. of the chunk; None for a
        positional policy (the default). ``num_tokens`` is the sequence's length after the chunk.

        A whole prompt's votes are what a parallel prefill hands its ranks: each scores with its own queries
        and the last adds the shares up (``parallel/votes.py``)."""
        return None

    def prefill_scores(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        held: int,
        num_tokens: int,
        previous: torch.Tensor | None,
        softcap: float = 0.0,
    ) -> torch.Tensor | None:
        """Scores (h + m,) float32 of a sequence's candidates after a chunk: its m new queries q (m, H, D) over
        keys (h + m, Hkv, D), the first h cached with scores ``previous`` (h,) (None if h = 0): the weighted
        attention the voting queries pay (logits soft-capped by ``softcap``, 0: none), plus the earlier scores for a
        policy that accumulates them. None for a positional policy."""
        votes = self.votes(q.shape[0], num_tokens)
        if votes is None:
            return None
        return self.scores_from(head_column_sums(q, keys, held, *votes, softcap), held, previous)

    def scores_from(self, head_sums: torch.Tensor, held: int, previous: torch.Tensor | None) -> torch.Tensor:
        """``prefill_scores`` from the votes' attention summed per KV head, ``head_sums`` (h + m, Hkv) float32
        (``scoring.head_column_sums``, or ``attend_voting_rows`` where the attention pass forms it)."""
        if self.per_head:  # (h + m, Hkv); a per-head policy ranks afresh each chunk
            return head_sums
        total = head_sums.mean(dim=1)
        if previous is not None and self.scores == SCORES_ACCUMULATED:
            total[:held] += previous
        return total

    def score_update(self) -> tuple[float, float]:
        """How a decode step's attention weight w folds into a slot's running score s: (a, b) for a * s + b * w.
        The base accumulates (H2O); a policy that forgets (an exponential moving average) says how fast."""
        return 1.0, 1.0

    def update(self, scores: torch.Tensor, step_weights: torch.Tensor) -> torch.Tensor:
        """Fold one decode step's attention weights (n,) into the running scores (n,) (``score_update``)."""
        a, b = self.score_update()
        if (a, b) == (1.0, 1.0):
            return scores + step_weights
        return a * scores + b * step_weights


def recent_and_top(scores: torch.Tensor, num_candidates: int, keep: int, recent: int) -> torch.Tensor:
    """The last ``recent`` candidates, plus the ``keep - recent`` best-scored of the others (ascending)."""
    recent = min(recent, keep)
    older = num_candidates - recent
    top = torch.topk(scores[:older], keep - recent).indices if keep > recent else scores.new_empty(0, dtype=torch.long)
    return torch.cat((top.sort().values, torch.arange(older, num_candidates, device=scores.device)))


def update_scores(policies: Sequence[KVPolicy], scores: torch.Tensor, step_weights: torch.Tensor) -> torch.Tensor:
    """Each sequence's running scores (B, T) folded with its step's weights (B, T), batched per policy."""
    if all(p == policies[0] for p in policies):
        return policies[0].update(scores, step_weights)
    out = scores.clone()
    for policy in set(policies):
        rows = torch.tensor([b for b, p in enumerate(policies) if p == policy], device=scores.device)
        out[rows] = policy.update(scores[rows], step_weights[rows])
    return out


class OffloadState(Protocol):
    """What an offloading cache calls on the state a policy keeps beside its tier (``KVPolicy.offload_state``;
    InfiniGen's is ``policies/infinigen_state.py``)."""

    policy: Any  # the policy that made it
    speculated_layers: frozenset[int]  # layers whose rows it selects
    own_query_layers: frozenset[int]  # of those, the layers that speculate from their own query
    rehearsed_layers: frozenset[int]  # of those, the layers the layer before them speculates for
    rank_mean: Callable[[torch.Tensor], torch.Tensor] | None  # tensor parallelism: a mean over every rank

    @property
    def evicts(self) -> bool: ...

    def capacity(self, full_length: int) -> int: ...

    def partial_query(self, layer: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor: ...

    def partial_from_query(self, layer: int, q: torch.Tensor) -> torch.Tensor: ...

    def select_decode(
        self, layer: int, partial_q: torch.Tensor, candidates: Any, tokens: torch.Tensor
    ) -> tuple[Any, torch.Tensor]: ...

    def rows_allowed(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, partial_q: torch.Tensor, token: int, window: int | None
    ) -> torch.Tensor: ...

    def victims(self, layer: int, slots: torch.Tensor) -> torch.Tensor: ...

    def stored(
        self,
        layer: int,
        slots: torch.Tensor,
        heads: torch.Tensor,
        flat: torch.Tensor,
        k: torch.Tensor,
        tokens: torch.Tensor,
    ) -> None: ...

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None: ...

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None: ...
