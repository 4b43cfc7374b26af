"""A paged KV cache with one KV group per layer, for policies that keep different slots in each layer.

Every layer has its own block table per sequence, and all layers draw blocks from one pool: the
storage is a single slab (num_blocks, block_size, Hkv, D) for K and one for V, so a block a deep layer
gives back can be taken by any layer of any sequence. A parallel float32 buffer holds each slot's
policy score (the attention it received), so scores move with the keys when slots are compacted and
decoding updates them for a whole batch in one gather and one scatter.

Per step and layer, for each sequence holding ``h`` slots and receiving ``m`` rows:

1. attention of the rows over the ``h`` cached slots plus their own new keys (causal). A prefill writes
   no key before choosing, so it never needs more slots than it keeps; a decode writes its one new key
   at slot ``h`` first (the scheduler reserves that slot) so a single gather reads every candidate;
2. the policy scores the ``h + m`` candidates (when it scores: a prefill's voting rows are attended explicitly,
   so one softmax gives their output and the scores, ``scoring.attend_voting_rows``), and if they exceed the
   group's target for the step (``ScheduledSequence.group_targets``), chooses which to keep;
3. the kept keys, values and scores are written to the group's first slots, in position order (or,
   with nothing to drop, the new rows are appended at slot ``h``);
4. for a row-dropping policy (PyramidInfer), rows whose key the layer dropped leave the hidden states,
   so the next layer computes only the survivors (never for a sequence that needs every row's logits).

With ``kv_offload`` the slab lives in the host or disk tier (``kv/tiers.py``) instead of the device: a
layer reads the slots it attends over from there and writes its kept ones back, so the policy's
compression is also what spares the transfers (read synchronously, without InfiniGen's prefetch).

What each group holds after the step comes back in the ``StepReport``; the scheduler shrinks the block
tables to it (freeing blocks) and remembers the counts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from kvserve.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    InPlaceDecode,
    UnsupportedKVOperation,
)
from kvserve.attention.compaction import Compaction
from kvserve.attention.compressed_decode import CompressedDecode
from kvserve.attention.compressed_metadata import CompressedAttentionMetadata, CompressedStep
from kvserve.attention.compressed_prefill import CompressedPrefill
from kvserve.attention.paged import PagedKVCache
from kvserve.attention.step_layout import row_starts, slot_ids
from kvserve.core.step import StepReport
from kvserve.kv.row_codec import PlainRows
from kvserve.kv.tiers import TierStore

if TYPE_CHECKING:
    from kvserve.core.step import SchedulerOutput


class CompressedKVCache(AttentionBackend):
    """Keys/values of every layer in one block pool, each layer with its own tables (see the module doc): its
    prefill (``compressed_prefill.py``), decode (``compressed_decode.py``) and compaction (``compaction.py``)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
        num_host_blocks: int = 0,
        tier: str = "none",
        path: str | None = None,
        layer_windows: Sequence[int | None] = (),
        softcap: float = 0.0,
    ) -> None:
        """``tier``: where the slab lives, ``none`` (the device) or a slower tier (``host``, ``disk``: kv_offload),
        from which each layer reads the rows it attends over; ``path`` is the disk tier's folder.
        ``layer_windows``: per layer, its sliding window (None: global; (): every layer global). ``softcap``: the
        attention-logit soft cap of every layer (0: none), in the attention and in the scores taken from it."""
        self.device, self.tier = torch.device(device), None
        self.layer_windows = tuple(layer_windows) or (None,) * num_layers
        self.softcap = softcap
        self.step: CompressedStep | None = None  # what the layers fill in, for ``_step_metadata`` (build_metadata)
        self._step_metadata: CompressedAttentionMetadata | None = None
        if tier == "none":  # one slab of blocks that any layer's group may hold: a paged store of one "layer"
            self.store = PagedKVCache(1, num_blocks, block_size, num_kv_heads, head_dim, dtype, device, pin_memory)
            self.k, self.v = self.store.k, self.store.v  # (1, num_blocks, block_size, Hkv, D)
        else:
            rows = PlainRows(num_kv_heads, head_dim, dtype).specs()
            self.tier = TierStore(tier, 1, num_blocks, block_size, rows, self.device.type == "cuda", path)
            self.store = None
            self.k, self.v = self.tier.blocks("k"), self.tier.blocks("v")  # (1, num_blocks, block_size, Hkv, D)
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.scores = torch.zeros(num_blocks * block_size, dtype=torch.float32, device=device, pin_memory=pin_memory)
        self.rank_mean: Callable[[torch.Tensor], torch.Tensor] | None = None  # tensor parallelism: set_rank_mean
        self.host_cache = self.make_host_cache(num_host_blocks) if num_host_blocks else None
        self.compaction, self.prefill = Compaction(self), CompressedPrefill(self)
        self.decoder = CompressedDecode(self)

    def make_host_cache(self, num_blocks: int | None = None) -> CompressedKVCache:
        return CompressedKVCache(
            self.num_layers, num_blocks or self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
            self.k.dtype, "cpu", pin_memory=self.k.is_cuda, layer_windows=self.layer_windows, softcap=self.softcap,
        )  # fmt: skip

    def build_metadata(self, out: SchedulerOutput, rows_from: Mapping[int, int]) -> CompressedAttentionMetadata:
        scheduled = out.scheduled
        step = CompressedStep(
            [len(s.token_ids) for s in scheduled],
            [list(s.group_slots) for s in scheduled],
            [list(s.group_heads) or [()] * self.num_layers for s in scheduled],
        )
        metadata = CompressedAttentionMetadata(
            seq_ids=tuple(s.seq_id for s in scheduled),
            query_lens=tuple(len(s.token_ids) for s in scheduled),
            context_lens=tuple(s.num_computed_tokens for s in scheduled),
            policies=tuple(s.kv_policy for s in scheduled),
            group_slots=tuple(s.group_slots for s in scheduled),
            group_targets=tuple(s.group_targets for s in scheduled),
            group_frozen=tuple(s.group_frozen for s in scheduled),
            group_heads=tuple(s.group_heads for s in scheduled),
            block_tables=tuple(s.block_tables for s in scheduled),
            keep_all_rows=tuple(rows_from.get(s.seq_id, len(s.token_ids)) < len(s.token_ids) - 1 for s in scheduled),
            block_size=self.block_size,
        )
        self.step, self._step_metadata = step, metadata
        return metadata

    def report(self, metadata: AttentionMetadata) -> StepReport:
        self.check_metadata(metadata)
        state = self.step
        return StepReport(
            group_slots={seq: tuple(held) for seq, held in zip(metadata.seq_ids, state.held_after, strict=True)},
            group_heads={
                seq: tuple(heads)
                for seq, heads, policy in zip(metadata.seq_ids, state.heads_after, metadata.policies, strict=True)
                if policy.head_budgets
            },
            output_rows=tuple(state.rows),
        )

    # Blocks carry their slots' scores with them; slots mean different tokens in different layers.
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if self.tier is not None:
            self.tier.copy_blocks(pairs)
        else:
            self.store.copy_blocks(pairs)
        self._move_scores(self, self, pairs)

    def swap_out(self, pairs: Sequence[tuple[int, int]], host_cache: CompressedKVCache | None = None) -> None:
        host = self._host(host_cache)
        self.store.swap_out(pairs, host.store)
        self._move_scores(self, host, pairs)

    def swap_in(self, pairs: Sequence[tuple[int, int]], host_cache: CompressedKVCache | None = None) -> None:
        host = self._host(host_cache)
        self.store.swap_in(pairs, host.store)
        self._move_scores(host, self, pairs)

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Single slots (src, dst) of the slab with their scores: a Prompt Cache module's partial last blocks,
        layer by layer (each layer's slots are its own, so the pairs name each layer's separately)."""
        if not pairs:
            return
        if self.tier is not None:
            self.tier.copy_slots(pairs)
        else:
            self.store.copy_slots(pairs)
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.scores.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.scores.device)
        self.scores.index_copy_(0, dst, self.scores.index_select(0, src))

    def bytes_moved(self) -> dict[str, int]:
        return dict(self.tier.moved) if self.tier is not None else {}

    def _host(self, host_cache: CompressedKVCache | None) -> CompressedKVCache:
        if self.tier is not None:
            raise UnsupportedKVOperation(
                f"the KV is in the {self.tier.kind} tier already: an offloading engine preempts by recompute"
            )
        host = host_cache or self.host_cache
        if not isinstance(host, CompressedKVCache):
            raise RuntimeError("per-layer KV groups swap to a CompressedKVCache host tier (it holds the slot scores)")
        return host

    def set_rank_mean(self, mean: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.rank_mean = mean

    def _move_scores(self, src: CompressedKVCache, dst: CompressedKVCache, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        bs = self.block_size
        s = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        d = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        rows = src.scores.view(-1, bs).index_select(0, s.to(src.scores.device))
        dst.scores.view(-1, bs).index_copy_(0, d.to(dst.scores.device), rows.to(dst.scores.device))

    def store_layer(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata,
        scores: torch.Tensor | None = None,
    ) -> None:
        """A whole prompt's layer from a parallel prefill, k/v (T, Hkv, D) with the policy's ``scores`` (T,) (its
        votes, added up over the ranks): the layer keeps the policy's choice, as a one-process prefill of the
        prompt would. Every rank computed every row, so no row leaves the hidden states (``drops_rows`` cannot
        hold: which rows a layer drops is known only once the last rank's queries have voted)."""
        meta = self.check_metadata(metadata)
        if len(meta.seq_ids) != 1 or meta.context_lens[0] or meta.query_lens[0] != k.shape[0]:
            raise ValueError("a parallel prefill stores one sequence's whole prompt, with nothing cached before it")
        n, target = k.shape[0], meta.group_targets[0][layer]
        kept = torch.arange(n) if n <= target else meta.policies[0].select(scores, n, target, n)
        device = self.device
        scores = None if scores is None else scores.to(device)
        self.compaction.write_kept(meta.block_tables[0][layer], k.to(device), v.to(device), scores, kept.to(device))
        self.step.held_after[0][layer] = kept.numel()

    # ----- attention -----

    def surviving_rows(self, layer: int, metadata: AttentionMetadata) -> torch.Tensor | None:
        if metadata is not self._step_metadata:
            return None
        return self.step.survivors.get(layer)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        metadata = self.check_metadata(metadata)
        state = self.step
        if k.dtype != self.k.dtype:  # a narrower cache rounds them once, here: every query sees them as it holds them
            k, v = k.to(self.k.dtype).to(q.dtype), v.to(self.v.dtype).to(q.dtype)
        apart = {i for i in range(len(state.rows)) if self._heads_apart(layer, metadata, i)}
        if metadata.decode_only and not apart:  # rows are already one per sequence, in order
            return self.decoder.decode(layer, q, k, v, metadata, list(range(len(state.rows))))
        starts = row_starts(state.rows)
        out = torch.empty_like(q)  # (N_layer, H, D)
        decodes = [i for i, n in enumerate(metadata.query_lens) if n == 1]
        for decode, seqs in (
            (self.decoder.decode, [i for i in decodes if i not in apart]),
            (self.decoder.decode_heads, [i for i in decodes if i in apart]),
        ):
            if seqs:
                rows = torch.tensor([starts[i] for i in seqs], dtype=torch.long, device=q.device)
                out.index_copy_(0, rows, decode(layer, q[rows], k[rows], v[rows], metadata, seqs))
        kept_rows: list[torch.Tensor] = []
        dropped = False
        for i, n in enumerate(state.rows):
            everything = torch.arange(starts[i], starts[i] + n, device=q.device)
            rows = slice(starts[i], starts[i] + n)
            if metadata.query_lens[i] == 1:
                kept_rows.append(everything)
                continue
            if i in apart:
                out[rows] = self.prefill.attend_heads(layer, q[rows], k[rows], v[rows], metadata, i)
                kept_rows.append(everything)
                continue
            out[rows], survivors = self.prefill.run(layer, q[rows], k[rows], v[rows], metadata, i)
            if survivors is not None and survivors.numel() < n:
                dropped = True
                state.rows[i] = survivors.numel()
                kept_rows.append(survivors + starts[i])
            else:
                kept_rows.append(everything)
        if dropped:
            state.survivors[layer] = torch.cat(kept_rows)
        return out

    def _heads_apart(self, layer: int, meta: CompressedAttentionMetadata, i: int) -> bool:
        """Whether sequence ``i``'s rows at ``layer`` attend head by head (``_attend_heads``): its policy gives KV
        heads their own budgets (a global layer with several KV heads), and the layer has packed them or this
        step packs them."""
        if not meta.policies[i].head_budgets or self.num_kv_heads == 1 or self.layer_windows[layer] is not None:
            return False
        held, new = self.step.held_after[i][layer], meta.query_lens[i]
        return bool(self.step.heads_after[i][layer]) or (new > 1 and held + new > meta.group_targets[i][layer])

    @property
    def windowed(self) -> bool:
        return any(w is not None for w in self.layer_windows)

    # ----- a decode step's layers run as one call (models/decode_chain.py): CompressedDecode -----

    def in_place_decode(self, metadata: AttentionMetadata) -> InPlaceDecode | None:
        return self.decoder.in_place_decode(metadata)

    def finish_in_place_decode(self, metadata: AttentionMetadata, weights: torch.Tensor | None) -> None:
        self.decoder.finish_in_place_decode(metadata, weights)

    def check_metadata(self, metadata: AttentionMetadata) -> CompressedAttentionMetadata:
        """``metadata`` as this cache's, built last (its step state is ``self.step``)."""
        if metadata is not self._step_metadata:
            if not isinstance(metadata, CompressedAttentionMetadata):
                raise TypeError(f"CompressedKVCache needs CompressedAttentionMetadata, got {type(metadata).__name__}")
            raise ValueError("this metadata is not the step this CompressedKVCache built last (build_metadata)")
        return metadata

    # ----- the slab -----

    def read(self, index: torch.Tensor, blocks: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots ``index`` (n,) on the compute device, (n, Hkv, D) each, or of whole blocks
        (n, block_size, Hkv, D) with ``blocks``: copies, fetched from the tier when the slab lives there."""
        k, v = (self.k[0], self.v[0]) if blocks else self.flat()
        index = index.to(k.device)
        k, v = k.index_select(0, index), v.index_select(0, index)
        if self.tier is not None:
            self.tier.moved["fetched"] += 2 * k.numel() * k.element_size()
        return k.to(self.device, non_blocking=True), v.to(self.device, non_blocking=True)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values (n, Hkv, D) into ``slots`` (n,), in the tier when the slab lives there."""
        k_flat, v_flat = self.flat()
        slots = slots.to(k_flat.device)
        k_flat.index_copy_(0, slots, k.to(k_flat.device, k_flat.dtype))
        v_flat.index_copy_(0, slots, v.to(v_flat.device, v_flat.dtype))
        if self.tier is not None:
            self.tier.moved["stored"] += 2 * k.numel() * k.element_size()

    def flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as (slots, Hkv, D) views."""
        return self.k.view(-1, self.num_kv_heads, self.head_dim), self.v.view(-1, self.num_kv_heads, self.head_dim)

    def slot_ids(self, table: tuple[int, ...], begin: int, end: int, device: torch.device) -> torch.Tensor:
        return slot_ids(table, begin, end, self.block_size, device)
