"""What an offloading cache keeps beside its slower tier under InfiniGen (``policies/infinigen.py``).

The partial key cache (each slot's skewed partial key, on the device), the rehearsal that makes partial
queries and keys, and, with a KV pool limit, the pool's per-slot counters that choose each head's victim once a
sequence's pool is full. ``OffloadedKVCache`` makes one through ``KVPolicy.offload_state`` and calls it to
select the rows a decode batch or a chunk reads, to record what it stores, and to copy blocks and slots.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

# The state names neither InfiniGen nor its Rehearsal: ``InfiniGen.offload_state`` makes it, so importing them
# would be a cycle. These protocols are what it calls on them.


class SelectingPolicy(Protocol):
    """What the state calls on the InfiniGen policy that made it (``policies/infinigen.py``)."""

    alpha: Any  # a float, one per layer, or "auto" until calibrated
    pool_limit: float
    pool_eviction: str

    def layer_alpha(self, layer: int) -> float: ...

    def pool_slots(self, full_length: int) -> int: ...

    def select_decode_rows(self, *args: Any) -> tuple[Any, torch.Tensor]: ...  # (Selection, slots)

    def select_decode_blocks(self, *args: Any) -> torch.Tensor: ...  # (B, W) bool

    def rows_allowed(self, *args: Any) -> torch.Tensor: ...


class PartialProjections(Protocol):
    """What the state calls on the model's rehearsal (``infinigen.Rehearsal``): skewed partial queries and keys."""

    speculated_layers: frozenset[int]
    own_query_layers: frozenset[int]
    partial_dims: int

    def partial_query(self, layer: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor: ...

    def partial_from_query(self, layer: int, q: torch.Tensor) -> torch.Tensor: ...

    def partial_key(self, layer: int, k: torch.Tensor) -> torch.Tensor: ...


class InfiniGenState:
    """Partial keys, rehearsal and pool counters of an offloaded cache of ``num_layers`` layers, ``num_blocks``
    blocks of ``block_size`` slots and ``num_kv_heads`` KV heads of ``head_dim``."""

    def __init__(
        self,
        policy: SelectingPolicy,
        rehearsal: PartialProjections | None,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        # InfiniGen runs with the model's rehearsal and an alpha per layer (resolved from ``"auto"``).
        if rehearsal is None:
            raise ValueError("kv_policy='infinigen' needs the model's rehearsal (skewed partial weights)")
        if isinstance(policy.alpha, tuple) and len(policy.alpha) != num_layers:
            raise ValueError(
                f"infinigen_alpha has {len(policy.alpha)} per-layer values; the model has {num_layers} layers"
            )
        policy.layer_alpha(0)  # raises while alpha is still "auto"
        self.policy, self.rehearsal = policy, rehearsal
        self.block_size, self.num_kv_heads, self.head_dim, self.device = block_size, num_kv_heads, head_dim, device
        # Tensor parallelism: the count is a mean over every rank's heads.
        self.rank_mean: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.speculated_layers = rehearsal.speculated_layers
        # Layers whose partial query comes from their own query, once projected; the others' from the input of
        # the layer before (rehearsed, so their fetch overlaps that layer).
        self.own_query_layers = rehearsal.own_query_layers
        self.rehearsed_layers = self.speculated_layers - self.own_query_layers
        # Per KV head, each block's (r, block_size) transposed: speculation's dot products run across a block's
        # keys, contiguous (``csrc/speculate.cpp``). ``partial_rows`` views it by slot.
        shape = (num_layers, num_kv_heads, num_blocks, rehearsal.partial_dims, block_size)
        self.partial_keys = torch.zeros(shape, dtype=dtype, device=device)  # device tier
        self.pool = None
        if policy.pool_limit < 1:
            # Per (layer, slot, KV head): times selected, last row that selected it, row that inserted it.
            self.pool = torch.zeros((3, num_layers, num_blocks * block_size, num_kv_heads), dtype=torch.int32,
                                    device=device)  # fmt: skip

    @property
    def evicts(self) -> bool:
        """Whether a full pool overwrites slots in place (a KV pool limit), so positions no longer follow slots."""
        return self.pool is not None

    def capacity(self, full_length: int) -> int:
        """Slots a sequence that may reach ``full_length`` tokens holds at most."""
        return self.policy.pool_slots(full_length)

    def partial_rows(self, layer: int | None = None) -> torch.Tensor:
        """The partial keys by slot: (Hkv, blocks, block_size, r) of ``layer``, or (L, ...) of every layer (a view)."""
        keys = self.partial_keys if layer is None else self.partial_keys[layer]
        return keys.transpose(-1, -2)

    # ----- partial queries -----

    def partial_query(self, layer: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x (N, hidden), the attention input of layer - 1 -> (N, Hkv, G, r) partial queries of ``layer``."""
        return self.rehearsal.partial_query(layer, x, rope)

    def partial_from_query(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q (N, H, D), ``layer``'s own queries -> (N, Hkv, G, r) partial queries."""
        return self.rehearsal.partial_from_query(layer, q)

    # ----- selection -----

    def select_decode(
        self, layer: int, partial_q: torch.Tensor, candidates: Any, tokens: torch.Tensor
    ) -> tuple[Any, torch.Tensor]:
        """The rows each decode sequence reads in ``layer``: partial queries (B, Hkv, G, r) against its
        ``candidates``' partial keys; the pool counts the picks of the sequences' new rows ``tokens`` (B,).
        Returns the selection and the tier slots it picks (B, Hkv, K)."""
        selection, slots = self.policy.select_decode_rows(
            layer, partial_q, self.partial_keys[layer], candidates, self.head_dim, self.rank_mean
        )
        if self.pool is not None:
            self.note_selected(layer, slots, selection.chosen, tokens)
        return selection, slots

    def select_decode_blocks(self, layer: int, partial_q: torch.Tensor, candidates: Any) -> torch.Tensor:
        """The blocks each decode sequence reads in ``layer`` from a tier read in whole blocks: (B, W) bool over
        its ``candidates``' table (``InfiniGen.select_decode_blocks``)."""
        return self.policy.select_decode_blocks(
            layer, partial_q, self.partial_keys[layer], candidates, self.head_dim, self.rank_mean
        )

    def rows_allowed(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, partial_q: torch.Tensor, token: int,
        window: int | None,
    ) -> torch.Tensor:  # fmt: skip
        """Which of the h cached rows at ``slots`` (h,) and the m new rows (keys k (m, Hkv, D), partial queries
        (m, Hkv, G, r), tokens ``token``..) each of the m rows may read: (m, Hkv, h + m) bool."""
        held, m = slots.numel(), k.shape[0]
        cached = self.partial_rows(layer)[:, slots // self.block_size, slots % self.block_size]  # (Hkv, h, r)
        partial_k = torch.cat((cached, self.rehearsal.partial_key(layer, k).transpose(0, 1)), dim=1)  # (Hkv, h + m, r)
        allowed = self.policy.rows_allowed(layer, partial_q, partial_k, held, self.head_dim, self.rank_mean, window)
        if self.pool is not None:
            cached_picks = allowed[:, :, :held]
            last_row = torch.tensor([token + m - 1], dtype=torch.int32, device=self.device)
            every = slots[None, None, :].expand(1, self.num_kv_heads, held)
            self.note_selected(layer, every, cached_picks.any(dim=0)[None], last_row, cached_picks.sum(dim=0)[None])
        return allowed

    # ----- the pool -----

    def victims(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Each KV head's victim among a full pool's ``slots`` (cap,): (1, Hkv) slots."""
        counts, last, inserted = (a[layer].index_select(0, slots).transpose(0, 1) for a in self.pool)  # (Hkv, cap)
        return slots[choose_victims(self.policy.pool_eviction, counts, last, inserted)][None]

    def note_selected(
        self,
        layer: int,
        slots: torch.Tensor,
        chosen: torch.Tensor,
        now: torch.Tensor,
        times: torch.Tensor | None = None,
    ) -> None:
        """Pool counters: of slots (B, Hkv, K), ``chosen`` (B, K) or (B, Hkv, K) were selected (``times`` times,
        else once) by rows ``now`` (B,)."""
        if chosen.dim() == 2:
            chosen = chosen[:, None, :].expand_as(slots)
        heads = torch.arange(self.num_kv_heads, device=slots.device)[None, :, None].expand_as(slots)
        flat = (slots * self.num_kv_heads + heads)[chosen]
        counts, last = self.pool[0, layer].view(-1), self.pool[1, layer].view(-1)
        increments = times[chosen] if times is not None else torch.ones_like(flat, dtype=torch.int32)
        counts.index_add_(0, flat, increments.to(torch.int32))
        last.index_copy_(0, flat, now[:, None, None].expand_as(slots)[chosen])

    # ----- what the cache stores and copies -----

    def stored(
        self, layer: int, slots: torch.Tensor, heads: torch.Tensor, flat: torch.Tensor, k: torch.Tensor,
        tokens: torch.Tensor,
    ) -> None:  # fmt: skip
        """Rows k (R, Hkv, D) of tokens ``tokens`` (R,) go to ``slots`` (R, Hkv) (``flat``: (slot, head) indices,
        ``heads`` (1, Hkv)): their partial keys, and fresh pool counters."""
        partial = self.rehearsal.partial_key(layer, k).transpose(0, 1)  # (Hkv, R, r)
        by_head = slots.t()  # (Hkv, R)
        rows = self.partial_rows(layer)  # (Hkv, blocks, bs, r)
        rows[heads.t().expand_as(by_head), by_head // self.block_size, by_head % self.block_size] = partial
        if self.pool is not None:
            stamps = tokens[:, None].expand_as(slots).reshape(-1)
            self.pool[0, layer].view(-1).index_fill_(0, flat, 0)
            self.pool[1, layer].view(-1).index_copy_(0, flat, stamps)
            self.pool[2, layer].view(-1).index_copy_(0, flat, stamps)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write of forked sequences' blocks: their partial keys and pool counters."""
        self.partial_keys.index_copy_(2, dst, self.partial_keys.index_select(2, src))  # blocks on dim 2
        if self.pool is not None:
            blocks = self.pool.unflatten(2, (-1, self.block_size))
            blocks.index_copy_(2, dst, blocks.index_select(2, src))

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Single slots' partial keys and pool counters (a Prompt Cache module's partial last block)."""
        rows = self.partial_rows()  # (L, Hkv, blocks, bs, r)
        bs = self.block_size
        rows[:, :, dst // bs, dst % bs] = rows[:, :, src // bs, src % bs]
        if self.pool is not None:  # slots on dim 2
            self.pool.index_copy_(2, dst, self.pool.index_select(2, src))


def choose_victims(
    eviction: str, counts: torch.Tensor, last_used: torch.Tensor, inserted: torch.Tensor
) -> torch.Tensor:
    """Each KV head's victim among a full pool: (Hkv,) long indices into its ``cap`` slots.

    counts, last_used, inserted (Hkv, cap) int: times speculation selected the slot's token, the last
    row that selected it (its own index until then) and the row that inserted it. ``counter`` and
    ``lru`` choose among the older half of the pool (by insertion, as the authors' code), so a token is
    not evicted before it had a chance to be selected; ties go to the oldest. ``fifo``: the oldest.
    """
    inserted = inserted.long()
    if eviction == "fifo":
        return inserted.argmin(dim=-1)
    cap = inserted.shape[-1]
    older = inserted <= inserted.kthvalue(max(1, cap // 2), dim=-1, keepdim=True).values
    primary = counts.long() if eviction == "counter" else last_used.long()
    key = (primary << 32) | inserted  # primary first, then age
    return key.masked_fill(~older, torch.iinfo(torch.long).max).argmin(dim=-1)
