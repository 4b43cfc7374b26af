"""InfiniGen (Lee et al., OSDI'24, https://arxiv.org/abs/2406.19707): fetch only the KV the next layer needs.

The full KV cache lives in a slower tier (``kv/tiers.py``). At layer i-1, a rehearsal predicts layer i's
attention: layer i's query projection applied to layer i-1's attention input, rotated, skewed
(``policies/skewing.py``) and cut to the few skewed dimensions that carry most of the magnitude, scored
against a partial key cache of the same dimensions kept on the device. A token is fetched when its
speculated score is within ``alpha`` of the best one; how many tokens is one count per layer (the mean
over heads of each head's count, as the paper), and each KV head fetches its own top tokens. Layer 0
reads its whole cache. Layer 1 speculates from its own query instead (``Rehearsal.own_query_layers``): the
input of layer 0 is the token embedding, which says nothing of where layer 1 attends (SmolLM2-135M's
calibration sample: 99.8% of the rows to keep 93% of the attention from layer 0's input, 28.4% from layer 1's
own query), so its fetch waits for its own projection instead of overlapping layer 0. Sliding-window layers
(Gemma 3), layer 0 included, select among their window's rows, from their own query too, at their own
calibrated share of the attention (``ThresholdCalibration.window_mass``).

``alpha="auto"`` (the default) takes each layer's alpha from the model's calibration (``policies/calibration.py``:
the smallest alpha that keeps a target share of the attention on the sample text); the place that loads the
skewing resolves it into a tuple (``resolve_alpha``). A number is every layer's alpha.

An optional KV pool limit caps each sequence's slots in the slower tier at ``pool_limit`` of the KV it
would reach (prompt + max_tokens); past it a victim's slot is overwritten in place, chosen by how often
speculation selected it (``counter``, the paper's), least recently selected (``lru``) or oldest (``fifo``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvserve.models.layers import RotaryEmbedding
from kvserve.models.packed_linear import dense_linear, prepack
from kvserve.platform.cpu_kernels import use_cpu_kernel
from kvserve.policies.base import KVPolicy

if TYPE_CHECKING:
    from kvserve.policies.infinigen_state import InfiniGenState

# Under tensor parallelism, the mean over the ranks of a per-rank value (``parallel/tensor_model.RankMean``).
RankMean = Callable[[torch.Tensor], torch.Tensor]

POOL_EVICTIONS = ("counter", "lru", "fifo")
AUTO = "auto"  # infinigen_alpha: each layer's calibrated alpha

# "auto", one alpha for every layer, or one per layer.
Alpha = str | float | tuple[float, ...]


@dataclass(frozen=True)
class InfiniGen(KVPolicy):
    alpha: Alpha = AUTO  # fetch tokens whose speculated logit is within alpha of the best ("auto": calibrated)
    partial_ratio: float = 0.3  # share of each head's skewed dimensions in the partial query/key
    pool_limit: float = 1.0  # slots a sequence may hold in the slower tier, as a share of its full KV
    pool_eviction: str = "counter"

    name = "infinigen"
    offload_only = True
    rehearsed = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.budget != 1:
            raise ValueError(
                f"kv_policy='infinigen' keeps the whole cache in the slower tier; kv_budget must be 1, "
                f"got {self.budget}"
            )
        check_alpha(self.alpha)
        if not 0 < self.partial_ratio <= 1:
            raise ValueError(f"infinigen_partial_ratio must be in (0, 1], got {self.partial_ratio!r}")
        if not 0 < self.pool_limit <= 1:
            raise ValueError(f"kv_pool_limit must be in (0, 1], got {self.pool_limit!r}")
        if self.pool_eviction not in POOL_EVICTIONS:
            raise ValueError(f"kv_pool_eviction must be one of {list(POOL_EVICTIONS)}, got {self.pool_eviction!r}")

    def layer_alpha(self, layer: int) -> float:
        """Layer ``layer``'s alpha; a ValueError while it is still ``"auto"`` (unresolved)."""
        if isinstance(self.alpha, tuple):
            if not 0 <= layer < len(self.alpha):
                raise ValueError(f"InfiniGen has alphas for {len(self.alpha)} layers, asked for layer {layer}")
            return self.alpha[layer]
        if self.alpha == AUTO:
            raise ValueError(
                "infinigen_alpha='auto' is resolved from the model's calibration (`kvserve infinigen-setup`) "
                "when the offloaded cache is built; this policy was not"
            )
        return float(self.alpha)

    def resolve_alpha(self, calibrated: tuple[float, ...] | None) -> InfiniGen:
        """This policy with ``"auto"`` replaced by the model's per-layer alphas (itself if alpha is set);
        a ValueError saying how to calibrate when there are none."""
        if self.alpha != AUTO:
            return self
        if calibrated is None:
            raise ValueError(
                "infinigen_alpha='auto' needs the model's calibrated alphas, which its skewing file lacks: run "
                "`kvserve infinigen-setup` for this model (or give infinigen_alpha a number)"
            )
        return dataclasses.replace(self, alpha=tuple(float(a) for a in calibrated))

    def of_layers(self, layers: Sequence[int]) -> InfiniGen:
        """This policy for a cache holding only ``layers`` of the model, numbered 0.. in their order (the global
        layers a split offload keeps in its tier): per-layer alphas narrowed to them."""
        if isinstance(self.alpha, tuple):
            return dataclasses.replace(self, alpha=tuple(self.alpha[layer] for layer in layers))
        return self

    def partial_dims(self, head_dim: int) -> int:
        return max(1, math.ceil(self.partial_ratio * head_dim))

    def pool_slots(self, full_length: int) -> int:
        """Slots a sequence that may reach ``full_length`` tokens holds at most."""
        return max(1, math.ceil(self.pool_limit * full_length)) if self.pool_limit < 1 else full_length

    def offload_state(self, rehearsal: Rehearsal | None, **shape: Any) -> InfiniGenState:
        from kvserve.policies.infinigen_state import InfiniGenState  # it builds on this module

        return InfiniGenState(self, rehearsal, **shape)

    def select_decode_rows(
        self,
        layer: int,
        partial_q: torch.Tensor,
        partial_keys: torch.Tensor,
        candidates: PagedCandidates,
        head_dim: int,
        rank_mean: RankMean | None = None,
    ) -> tuple[Selection, torch.Tensor]:
        """The rows each decode sequence's layer ``layer`` reads: partial queries (B, Hkv, G, r) against the
        partial keys of their candidates, read in place from the layer's partial key cache (Hkv, blocks, r,
        block_size): each block's keys transposed, so the op's dot products run across a block's keys.
        Returns the selection (positions in each sequence's table) and the tier slots it picks (B, Hkv, K).

        One compiled op on the CPU (``csrc/speculate.cpp``); under tensor parallelism (the count is a mean
        over every rank's heads) and off the CPU, the torch reference ``speculate_paged``."""
        alpha = self.layer_alpha(layer)
        if rank_mean is None and use_cpu_kernel(partial_q, partial_keys):
            c = candidates
            index, counts, slots = torch.ops.kvserve.speculate_rows(
                partial_q.contiguous(), partial_keys, c.block_tables, c.block_size, c.starts, c.ends,
                1.0 / math.sqrt(head_dim), alpha,
            )  # fmt: skip
            chosen = torch.arange(index.shape[-1])[None, :] < counts[:, None]
            return Selection(index, chosen, counts), slots
        return speculate_paged(partial_q, partial_keys, candidates, head_dim, alpha, rank_mean)

    def select_decode_blocks(
        self,
        layer: int,
        partial_q: torch.Tensor,
        partial_keys: torch.Tensor,
        candidates: PagedCandidates,
        head_dim: int,
        rank_mean: RankMean | None = None,
    ) -> torch.Tensor:
        """The blocks (pages) each decode sequence's layer ``layer`` reads from a tier read in whole blocks (the
        direct-I/O disk tier): (B, W) bool over its candidates' table, its own row's block always among them.

        Each row's speculated attention is the softmax of its speculated logits (partial queries (B, Hkv, G, r)
        against the candidates' partial keys); a block's predicted mass is the *sum* of its rows', averaged over
        the query heads, since a read brings every row of the block for every head (Quest's max of q.k bounds is
        for when only per-block key bounds are known; here every row has a speculated score, and a block of one
        sharp row and a block of many middling ones are told apart by their sums). The budget is InfiniGen's own
        count of rows (those within ``alpha`` of the best, the mean over heads): blocks are taken by mass, highest
        first, until their cached rows cover it, so a page read moves about the bytes the rows would; a budget of
        every candidate row takes every block."""
        batch, hkv, group = partial_q.shape[:3]
        c = candidates
        width, bs = c.block_tables.shape[1], c.block_size
        # Each block's (r, bs) partial keys as they lie: one small matmul per block, no transposed copy.
        blocks = partial_keys.index_select(1, c.block_tables.long().view(-1)).float()  # (Hkv, B * W, r, bs)
        q = partial_q.transpose(0, 1).float()[:, :, None]  # (Hkv, B, 1, G, r)
        logits = torch.matmul(q, blocks.view(hkv, batch, width, -1, bs)).mul_(1 / math.sqrt(head_dim))
        logits = logits.permute(1, 0, 3, 2, 4).reshape(batch, hkv, group, width * bs)  # (B, Hkv, G, T)
        position = torch.arange(width * bs, device=partial_q.device)[None, :]
        valid = (position >= c.starts.long()[:, None]) & (position < c.ends.long()[:, None])  # (B, T)
        logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
        peak = logits.amax(dim=-1, keepdim=True)
        per_head = (logits >= peak - self.layer_alpha(layer)).sum(dim=-1)  # (B, Hkv, G)
        mass = torch.softmax(logits, dim=-1).view(batch, hkv, group, width, bs).sum(dim=-1).mean(dim=(1, 2))
        heads = hkv * group
        if rank_mean is None:
            counts = per_head.sum(dim=(1, 2)) // heads  # InfiniGen's count: the mean over heads, truncated
        else:  # every rank reads the same blocks: counts and masses over every rank's heads
            counts = (rank_mean(per_head.sum(dim=(1, 2)).float()) / heads).floor().long()
            mass = rank_mean(mass)
        counts = counts.clamp(min=1)
        rows = valid.view(batch, width, bs).sum(dim=-1)  # (B, W) cached rows of each block
        own = c.ends.long() // bs  # (B,) the block the new row goes in (at position ends): read whatever its mass
        block = torch.arange(width, device=partial_q.device)[None, :]
        real = block <= own[:, None]
        key = mass.masked_fill(block == own[:, None], float("inf")).masked_fill(~real, float("-inf"))
        order = key.argsort(dim=-1, descending=True)
        ranked = rows.gather(1, order).masked_fill(~real.gather(1, order), 0)
        before = ranked.cumsum(dim=-1) - ranked  # rows of the blocks taken before each
        take = (before < counts[:, None]) & real.gather(1, order)
        take[:, 0] = True  # the own block
        return torch.zeros_like(take).scatter_(1, order, take)

    def rows_allowed(
        self,
        layer: int,
        partial_q: torch.Tensor,
        partial_k: torch.Tensor,
        held: int,
        head_dim: int,
        rank_mean: RankMean | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """Which of h cached and m new rows each of m new rows of a chunk reads at layer ``layer``, as decoding
        them one by one would: partial queries (m, Hkv, G, r) against partial keys (Hkv, h + m, r) ->
        (m, Hkv, h + m) bool, each row its selection among the rows before it (the last ``window`` - 1 of them in
        a window layer, whose h cached rows are then the first row's window), plus itself."""
        m, hkv = partial_q.shape[:2]
        device = partial_q.device
        row = torch.arange(m, device=device)
        position = torch.arange(held + m, device=device)[None, :]
        earlier = position < held + row[:, None]  # (m, h + m)
        if window is not None:
            earlier &= position > held + row[:, None] - window
        grouped = partial_q.permute(1, 0, 2, 3).flatten(1, 2)  # (Hkv, m * G, r): one matmul per KV head
        logits = partial_logits(grouped, partial_k, head_dim).view(hkv, m, -1, held + m).transpose(0, 1)
        selection = speculate(logits, earlier, self.layer_alpha(layer), rank_mean)  # over (m, Hkv, G, h + m) logits
        allowed = torch.zeros((m, hkv, held + m), dtype=torch.bool, device=device)
        chosen = selection.chosen[:, None, :].expand_as(selection.index)
        # Only the chosen entries: past a row's count the index holds placeholders (speculate's zeros).
        allowed.scatter_(2, selection.index.where(chosen, selection.index[..., :1]), True)
        allowed[row, :, held + row] = True  # a row always reads its own key, as a decode step does
        return allowed


def check_alpha(alpha: object) -> None:
    """A ValueError naming ``alpha`` unless it is "auto", a finite number >= 0 or a non-empty tuple of them."""
    values = alpha if isinstance(alpha, tuple) and alpha else (alpha,)
    if alpha == AUTO or all(_is_alpha(value) for value in values):
        return
    raise ValueError(f"infinigen_alpha must be 'auto' or a finite number >= 0 (or one per layer), got {alpha!r}")


def parse_alpha(text: str) -> str | float:
    """A command line's infinigen_alpha: "auto", or a number (its range is checked with the engine's options)."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"infinigen_alpha must be 'auto' or a number, got {text!r}") from None


def _is_alpha(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


@dataclass(frozen=True)
class Selection:
    """Which candidates each row's KV heads fetch: ``index`` (R, Hkv, K) into the candidates, of which the
    first ``counts[r]`` per row are chosen (``chosen`` (R, K) bool); K is the largest count."""

    index: torch.Tensor
    chosen: torch.Tensor
    counts: torch.Tensor  # (R,) long


@dataclass(frozen=True)
class PagedCandidates:
    """The cached rows each of B decode sequences may fetch: positions ``starts[b] .. ends[b] - 1`` of its block
    table ((B, W) int32; position p is slot ``table[p // block_size] * block_size + p % block_size``)."""

    block_tables: torch.Tensor
    block_size: int
    starts: torch.Tensor  # (B,) int32
    ends: torch.Tensor  # (B,) int32

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Tier slots of ``positions`` (B, ...) long, each row's in its own table."""
        flat = positions.flatten(1)
        blocks = self.block_tables.long().gather(1, flat // self.block_size)
        return (blocks * self.block_size + flat % self.block_size).view_as(positions)


def speculate_paged(
    partial_q: torch.Tensor,
    partial_keys: torch.Tensor,
    candidates: PagedCandidates,
    head_dim: int,
    alpha: float,
    rank_mean: RankMean | None = None,
) -> tuple[Selection, torch.Tensor]:
    """``InfiniGen.select_decode_rows`` from torch ops (the compiled op's oracle): gather each sequence's whole
    blocks of partial keys, mask the positions outside its candidates, ``speculate``."""
    batch, hkv = partial_q.shape[:2]
    c = candidates
    width = c.block_tables.shape[1]
    # Whole blocks of partial keys, each (r, bs) -> (Hkv, B, W * bs, r).
    blocks = partial_keys.index_select(1, c.block_tables.long().view(-1)).transpose(-1, -2)
    partial_k = blocks.reshape(hkv, batch, width * c.block_size, -1)
    position = torch.arange(width * c.block_size, device=partial_q.device)[None, :]
    valid = (position >= c.starts.long()[:, None]) & (position < c.ends.long()[:, None])  # (B, W * bs)
    logits = partial_logits(partial_q.transpose(0, 1), partial_k, head_dim).transpose(0, 1)  # (B, Hkv, G, T)
    selection = speculate(logits, valid, alpha, rank_mean)
    return selection, c.slots(selection.index)


def speculate(
    logits: torch.Tensor, valid: torch.Tensor | None, alpha: float, rank_mean: RankMean | None = None
) -> Selection:
    """Select the candidates R query rows are predicted to attend to.

    logits (R, Hkv, G, n) float32: each row's speculated scores (``partial_logits``), query heads grouped
    by KV head; valid (R, n) bool: which candidates a row may see (None: all of them). ``rank_mean``: under
    tensor parallelism these are this rank's heads, and the count is the mean over every rank's.
    """
    n = logits.shape[-1]
    if valid is not None:
        logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    peak = logits.amax(dim=-1, keepdim=True)
    per_head = (logits >= peak - alpha).sum(dim=-1)  # (R, Hkv, G)
    heads = per_head.shape[1] * per_head.shape[2]
    if rank_mean is None:
        counts = per_head.sum(dim=(1, 2)) // heads  # the mean over heads, truncated
    else:  # every rank has as many heads; exact: integer sums, divided by integers, then floored
        counts = (rank_mean(per_head.sum(dim=(1, 2)).float()) / heads).floor().long()
    counts = counts.clamp(min=1)
    counts = torch.minimum(counts, valid.sum(dim=-1)) if valid is not None else counts.clamp(max=n)
    kv_logits = logits.amax(dim=2)  # (R, Hkv, n): a token is wanted if any query head of the group wants it
    top = int(counts.max()) if counts.numel() else 0
    chosen = torch.arange(top, device=counts.device)[None, :] < counts[:, None]  # a row's first counts[r]
    distinct = counts.unique().tolist()
    if len(distinct) <= 1:
        return Selection(kv_logits.topk(top, dim=-1, sorted=False).indices, chosen, counts)
    index = torch.zeros((*kv_logits.shape[:2], top), dtype=torch.long, device=logits.device)  # (R, Hkv, K)
    for count in distinct:  # an unsorted top-k per count: cheaper than sorting every row's top K
        rows = (counts == count).nonzero().squeeze(1)
        index[rows, :, :count] = kv_logits.index_select(0, rows).topk(count, dim=-1, sorted=False).indices
    index = index.masked_fill(~chosen[:, None, :], torch.iinfo(torch.long).max).sort(dim=-1).values
    index = index.masked_fill(~chosen[:, None, :], 0)
    return Selection(index, chosen, counts)


def partial_logits(q_partial: torch.Tensor, k_partial: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q_partial (..., G, r) against k_partial (..., n, r) -> (..., G, n) float32 logits, scaled by the full
    head dim as attention's are."""
    return torch.matmul(q_partial, k_partial.transpose(-1, -2)).float().mul_(1 / math.sqrt(head_dim))


def activation_dtype_device(model: torch.nn.Module) -> tuple[torch.dtype, torch.device]:
    """The dtype and device of ``model``'s hidden states, read off its token embedding: a float table's own, float32
    for an integer one, and a GGUF embedding's (ggml blocks dequantised when looked up) compute dtype."""
    embed = model.embed_tokens
    weight = getattr(embed, "weight", None)
    if weight is None:  # GGUFEmbedding
        return embed.dtype, embed.blocks.device
    return (weight.dtype if weight.is_floating_point() else torch.float32), weight.device


def speculated_layers(layer_windows: Sequence[int | None]) -> frozenset[int]:
    """The layers InfiniGen selects rows in: every one but a full-attention layer 0, which reads its whole cache
    (a window layer 0 selects within its window, from its own query)."""
    return frozenset(i for i, window in enumerate(layer_windows) if i > 0 or window is not None)


class Rehearsal:
    """Layer i's partial query from layer i-1's attention input, and the partial keys, for a model.

    Holds each layer's query projection as a dense matrix (read back from whatever form the model runs
    it in, quantised or not, by applying it to the identity), the query's per-head norm and scale where the
    model has them (Gemma 3), and the skewing restricted to the kept dimensions.

    Layers in ``own_query_layers`` are not rehearsed: their partial query is their own query's skewed
    dimensions (``partial_from_query``). Layer 1, since the layer before it sees only token embeddings; and
    sliding-window layers (Gemma 3), whose fetch is a few rows of a bounded window and whose rehearsal
    predicts worse (Gemma 3 270M: 31.4% against 27.3% of the rows for 96% of the attention,
    benchmarks/infinigen/rows-needed-gemma3-mass096.md).
    """

    def __init__(self, model: torch.nn.Module, skew_partial: torch.Tensor) -> None:
        cfg = model.config
        self.num_kv_heads, self.group = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        dtype, device = activation_dtype_device(model)
        eye = torch.eye(cfg.hidden_size, dtype=dtype, device=device)
        zero = torch.zeros(1, cfg.hidden_size, dtype=dtype, device=device)
        self.weights, self.packed, self.biases = [], [], []
        # Gemma 3: queries are RMS-normalised per head before RoPE and scaled after it.
        self.q_norms = [getattr(layer.self_attn, "q_norm", None) for layer in model.layers]
        self.q_scales = [getattr(layer.self_attn, "q_scale", 1.0) for layer in model.layers]
        self.layer_windows = tuple(cfg.layer_windows)  # a window layer selects among its window's rows
        self.softcap = cfg.attention_softcap  # Gemma 2: the exact attention's logits are capped
        self.speculated_layers = speculated_layers(self.layer_windows)
        windowed = {i for i, window in enumerate(self.layer_windows) if window is not None}
        self.own_query_layers = frozenset({1} | windowed) & self.speculated_layers
        with torch.inference_mode():
            for layer in model.layers:
                proj = layer.self_attn.qkv_proj
                bias = proj(zero)[0, : cfg.q_size]  # (q_size,)
                weight = (proj(eye)[:, : cfg.q_size] - bias).t().contiguous()  # (q_size, hidden): W_q
                self.weights.append(weight)
                self.packed.append(prepack(weight))
                self.biases.append(bias if bool(bias.any()) else None)
        self.skew = skew_partial.to(dtype=dtype, device=device)  # (L, Hkv, D, r)

    @property
    def partial_dims(self) -> int:
        return self.skew.shape[-1]

    def of_layers(self, layers: Sequence[int]) -> Rehearsal:
        """The rehearsal of ``layers`` of the model only, numbered 0.. in their order, for a cache holding those
        layers (a split offload's global layers): layer j is rehearsed from the input of model layer
        ``layers[j] - 1``, as in the whole model; it speculates unless it is model layer 0, and from its own query
        where model layer 1 does."""
        sub = copy.copy(self)
        for name in ("weights", "packed", "biases", "q_norms", "q_scales"):
            setattr(sub, name, [getattr(self, name)[layer] for layer in layers])
        sub.skew = self.skew[list(layers)]
        sub.layer_windows = tuple(self.layer_windows[layer] for layer in layers)
        sub.speculated_layers = frozenset(j for j, layer in enumerate(layers) if layer in self.speculated_layers)
        own = {j for j, layer in enumerate(layers) if layer in self.own_query_layers}
        sub.own_query_layers = frozenset(own) & sub.speculated_layers
        return sub

    def partial_query(self, layer: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x (N, hidden), the attention input of layer - 1 -> (N, Hkv, G, r) skewed partial queries of ``layer``."""
        q = dense_linear(x, self.weights[layer], self.packed[layer], self.biases[layer])  # (N, H * D)
        q = q.view(x.shape[0], -1, self.head_dim)  # (N, H, D)
        if self.q_norms[layer] is not None:
            q = self.q_norms[layer](q)
        q = RotaryEmbedding.apply(q, rope)
        if self.q_scales[layer] != 1.0:
            q = q * self.q_scales[layer]
        return self._skewed(layer, q)

    def partial_from_query(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q (N, H, D), ``layer``'s own rotated (and, for Gemma 3, normalised and scaled) queries -> (N, Hkv, G, r)
        skewed partial queries."""
        return self._skewed(layer, q.to(self.skew.dtype))

    def _skewed(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q (N, H, D) -> (N, Hkv, G, r): each KV head's G x N query rows times its skewed partial matrix (D, r),
        one bmm over the KV heads (a broadcast matmul would first copy the matrix out to every row)."""
        n = q.shape[0]
        grouped = q.reshape(n, self.num_kv_heads, self.group * self.head_dim).transpose(0, 1)
        grouped = grouped.reshape(self.num_kv_heads, n * self.group, self.head_dim)  # (Hkv, N * G, D)
        partial = torch.bmm(grouped, self.skew[layer])  # (Hkv, N * G, r)
        return partial.view(self.num_kv_heads, n, self.group, -1).transpose(0, 1)

    def partial_key(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """k (N, Hkv, D) rotated keys -> (N, Hkv, r) skewed partial keys."""
        return torch.matmul(k.transpose(0, 1), self.skew[layer]).transpose(0, 1)  # (Hkv, N, r) -> (N, Hkv, r)
