"""Attention over a KV cache offloaded to a slower tier: fetch everything, fetch INT4, or fetch what InfiniGen predicts.

Every sequence's full KV lives in a ``KVTier`` (host memory or a memory-mapped file), at the slots the
KV manager hands out; the device holds only what a step reads. Per decode step and layer:

1. at layer i's attention input (``observe_input``) the fetch for layer i + 1 is queued on the
   ``TransferQueue``, so it overlaps layer i's compute: every cached row (``full``), every row in 4-bit
   codes (``int4``), or the rows InfiniGen's rehearsal selects (``infinigen``: layer i + 1's partial
   query from layer i's input against layer i + 1's partial key cache, which stays on the device);
   layer 0 fetches its whole cache at its own input (unless it has a window, below); InfiniGen's layer 1
   selects with its own query once projected (``Rehearsal.own_query_layers``: layer 0's input predicts
   nothing of it), a fetch not overlapped;
2. layer i waits for its fetch, attends over the fetched rows plus the step's own keys, and queues the
   store of its new keys/values (behind any fetch already queued, so a later fetch reads them).

Sequences with several new rows (a prompt, a chunk, a scored continuation) run one at a time: their
cached rows are fetched whole. A prompt's rows attend to everything before them (InfiniGen speculates
for decoding, not prefill); under InfiniGen each row of a *scored* chunk (prompt logprobs, how the eval
tools score a continuation) attends only to the rows its own rehearsal selects among the rows before it,
plus itself, which is what decoding them one by one would read.
With a KV pool limit, a row past the pool's capacity is computed on its own: it selects, attends, and
its keys/values overwrite the victim's slot (per KV head) with its partial key and counters.

Sliding-window layers (``layer_windows``, Gemma 3): the tier keeps every layer's whole context, in one KV
group (the simplest layout; the tier is the large, cheap memory), but a window layer reads only the last
``window`` positions (its own included): a decode fetches just the blocks that cover its window, a chunk
fetches the rows its first row's window reaches and attends with the window's mask. InfiniGen speculates
in window layers too, layer 0 included, among the rows of the window and from the layer's own query
(``Rehearsal.own_query_layers``: a fetch of a few rows of a bounded window, not overlapped). A KV pool
limit overwrites slots in place, so positions no longer follow slots: not with windows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvserve.attention.backend import AttentionBackend, AttentionMetadata, UnsupportedKVOperation
from kvserve.attention.decode import paged_decode
from kvserve.attention.offload_chunk import OffloadChunks
from kvserve.attention.offload_direct import make_transfers
from kvserve.attention.offload_fetch import Fetch
from kvserve.attention.offload_metadata import OffloadAttentionMetadata
from kvserve.attention.offload_step import OffloadStep, plan_step
from kvserve.attention.step_layout import row_starts, slot_ids
from kvserve.core.step import StepReport
from kvserve.kv.tiers import TransferQueue
from kvserve.policies.base import KVPolicy
from kvserve.policies.infinigen import Rehearsal

if TYPE_CHECKING:
    from kvserve.core.step import SchedulerOutput


@dataclass
class OffloadStats:
    """Per layer: rows selected (InfiniGen) or fetched against the rows before them, over decode steps and
    scored chunks (a row of a chunk counts the rows before it)."""

    fetched_rows: list[int]
    cached_rows: list[int]
    decode_steps: int = 0

    def fetch_fraction(self) -> list[float]:
        return [f / c if c else 1.0 for f, c in zip(self.fetched_rows, self.cached_rows, strict=True)]


class OffloadedKVCache(AttentionBackend):
    """Full KV in a slower tier, fetched per layer and step according to ``policy`` (see the module doc)."""

    def __init__(
        self,
        policy: KVPolicy,
        tier_kind: str,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        path: str | None = None,
        rehearsal: Rehearsal | None = None,
        queue: TransferQueue | None = None,
        layer_windows: Sequence[int | None] = (),
        softcap: float = 0.0,
        disk_io: str = "mmap",
        first_fetch_at_own_input: bool = True,
    ) -> None:
        """``disk_io``: how the disk tier is read, ``mmap`` or ``direct`` (O_DIRECT, whole blocks: ``offload_direct``).
        ``first_fetch_at_own_input``: layer 0's whole cache is fetched at its own input, layer 0 being the model's
        first; False when the caller calls ``observe_input(-1, ...)`` before it (a split offload's first global
        layer, queued at the input of the model's layer before it).
        ``softcap``: the attention-logit soft cap of every layer (0: none). InfiniGen selects rows by its
        speculated logits as they are, uncapped: its threshold is calibrated on those against the capped exact
        weights (``policies/calibration.py``), so selection and calibration agree."""
        if policy.name not in ("full", "infinigen", "int4"):
            raise ValueError(f"kv_offload runs kv_policy full, infinigen or int4, not {policy.name!r}")
        self.device = torch.device(device)
        # InfiniGen's partial keys, speculation and pool counters (None: every cached row is fetched).
        self.speculation = policy.offload_state(
            rehearsal, num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
            num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=self.device,
        )  # fmt: skip
        self.layer_windows = self._check_windows(layer_windows, num_layers)
        self.softcap, self.first_fetch_at_own_input = softcap, first_fetch_at_own_input
        self.policy, self.rehearsal = policy, rehearsal
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.num_slots = num_blocks * block_size
        self.codec = policy.row_codec(num_kv_heads, head_dim, dtype)
        self.rows = self.codec.specs()
        self.queue = queue or TransferQueue(self.device, fault="kv-disk" if tier_kind == "disk" else None)
        self.tier, self.transfers = make_transfers(
            tier_kind, disk_io, num_layers, num_blocks, block_size, self.rows, path, self.queue, self.codec, self.device
        )
        self.chunks = OffloadChunks(self)
        self.stats = OffloadStats([0] * num_layers, [0] * num_layers)
        self._step: OffloadStep | None = None  # the step of ``_step_metadata``, the metadata built last
        self._step_metadata: OffloadAttentionMetadata | None = None

    def _check_windows(self, windows: Sequence[int | None], num_layers: int) -> tuple[int | None, ...]:
        """Each layer's window (a sliding-window model), or () when every layer sees its whole context."""
        if not any(w is not None for w in windows):
            return ()
        if len(windows) != num_layers:
            raise ValueError(f"layer_windows has {len(windows)} entries; the model has {num_layers} layers")
        if self.speculation is not None and self.speculation.evicts:
            raise ValueError(
                f"kv_pool_limit={self.speculation.policy.pool_limit} overwrites slots in place, so a sliding-window "
                "layer could no longer find its window by position: use kv_pool_limit=1 on a model with "
                "sliding-window layers"
            )
        return tuple(windows)

    @property
    def block_bytes(self) -> int:
        """Slower-tier bytes of one block (every layer)."""
        return self.tier.block_bytes()

    # ----- block operations the runner asks for -----

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write of forked sequences: the tier's rows, their partial keys and pool counters."""
        if not pairs:
            return
        self.queue.synchronize()  # no store may land in a block while it is copied
        self.tier.copy_blocks(pairs)
        if self.speculation is not None:
            self.speculation.copy_blocks(*self._pair_tensors(pairs))

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Single token slots (src, dst) in every layer: a Prompt Cache module's partial last block copied into a
        request that imports it, in the tier, with the slots' partial keys and pool counters."""
        if not pairs:
            return
        self.queue.synchronize()  # the module's stores have landed, and none lands in a slot while it is copied
        self.tier.copy_slots(pairs)
        if self.speculation is not None:
            self.speculation.copy_slots(*self._pair_tensors(pairs))

    def _pair_tensors(self, pairs: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        return src, dst

    def swap_out(self, pairs: Sequence[tuple[int, int]], host_cache: object = None) -> None:
        raise UnsupportedKVOperation("an offloading engine preempts by recompute (its KV is already off the device)")

    swap_in = swap_out

    def bytes_moved(self) -> dict[str, int]:
        return {"fetched": self.queue.stats.bytes_fetched, "stored": self.queue.stats.bytes_stored}

    def set_rank_mean(self, mean: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """InfiniGen fetches per KV head, but how many rows a layer fetches is the mean over every query head."""
        if self.speculation is not None:
            self.speculation.rank_mean = mean

    def close(self) -> None:
        self.queue.close()
        self.transfers.close()

    def report(self, metadata: AttentionMetadata) -> StepReport:
        self.queue.check()  # a failed store leaves rows missing from the tier: the step must not count as done
        return super().report(metadata)

    def recover(self) -> None:
        self.queue.drain()
        self.transfers.drain()

    # ----- a step -----

    def build_metadata(self, out: SchedulerOutput, rows_from: Mapping[int, int]) -> OffloadAttentionMetadata:
        self.queue.check()  # a store of the last step that failed after its report: this step's sequences redo it
        scheduled = out.scheduled
        metadata = OffloadAttentionMetadata(
            seq_ids=tuple(s.seq_id for s in scheduled),
            query_lens=tuple(len(s.token_ids) for s in scheduled),
            context_lens=tuple(s.num_computed_tokens for s in scheduled),
            block_tables=tuple(s.block_tables[0] for s in scheduled),
            full_lengths=tuple(max(s.full_length, s.num_computed_tokens + len(s.token_ids)) for s in scheduled),
            scored_from=tuple(
                max(0, s.score_from - s.num_computed_tokens) if s.seq_id in rows_from else len(s.token_ids)
                for s in scheduled
            ),
            block_size=self.block_size,
        )
        step = plan_step(
            metadata.query_lens, metadata.context_lens, metadata.block_tables, lambda i: self.capacity(metadata, i),
            self.layer_windows or (None,), self.block_size, self.num_kv_heads, self.device,
        )  # fmt: skip
        if step.decodes:
            self.stats.decode_steps += 1
        self._step, self._step_metadata = step, metadata
        return metadata

    def _step_of(self, metadata: AttentionMetadata) -> OffloadStep:
        """The step state made beside ``metadata`` (the metadata this cache built last)."""
        if metadata is not self._step_metadata:
            if not isinstance(metadata, OffloadAttentionMetadata):
                raise TypeError(f"OffloadedKVCache needs OffloadAttentionMetadata, got {type(metadata).__name__}")
            raise ValueError("this metadata is not the step this OffloadedKVCache built last (build_metadata)")
        return self._step

    def store_layer(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata,
        scores: torch.Tensor | None = None,
    ) -> None:
        """A parallel prefill's keys/values (T, Hkv, D) of one sequence's whole prompt, to its slots in the tier
        (with their partial keys and pool counters)."""
        if len(metadata.seq_ids) != 1 or metadata.context_lens[0] != 0:
            raise ValueError("an offloaded cache stores layers computed elsewhere for one whole prompt at a time")
        m = k.shape[0]
        write = self.write_slots(layer, metadata, 0, 0, m)  # (m, Hkv)
        self.store(layer, write, k, v, torch.arange(m, dtype=torch.int32, device=self.device))

    def observe_input(
        self, layer: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata
    ) -> None:
        if not isinstance(metadata, OffloadAttentionMetadata):
            return
        step = self._step_of(metadata)
        nxt = layer + 1
        rehearsed = self.speculation is not None and nxt in self.speculation.rehearsed_layers
        if rehearsed:
            step.partial_queries[nxt] = self.speculation.partial_query(nxt, x, rope)  # (N, Hkv, G, r)
        if not step.decodes:
            return
        if layer == 0 and self.first_fetch_at_own_input and not self.speculates(0):
            step.pending[0] = self._fetch_blocks(0, step)
        if nxt < self.num_layers and not self.speculates(nxt):
            step.pending[nxt] = self._fetch_blocks(nxt, step)
        elif rehearsed:
            step.pending[nxt] = self._fetch_selected(nxt, step)

    def speculates(self, layer: int) -> bool:
        """Whether InfiniGen selects ``layer``'s rows (every layer but a full-attention layer 0; a window layer
        among its window's rows)."""
        return self.speculation is not None and layer in self.speculation.speculated_layers

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        step = self._step_of(metadata)
        starts = row_starts(metadata.query_lens)
        if self.speculates(layer) and layer in self.speculation.own_query_layers:  # selects from its own query
            step.partial_queries[layer] = self.speculation.partial_from_query(layer, q)
            if step.decodes:
                step.pending[layer] = self._fetch_selected(layer, step)
        if len(step.decodes) == len(metadata.query_lens):
            return self._decode(layer, q, k, v, metadata, step)
        out = torch.empty_like(q)  # (N, H, D)
        if step.decodes:
            rows = step.rows
            out.index_copy_(0, rows, self._decode(layer, q[rows], k[rows], v[rows], metadata, step))
        batched = set(step.decodes)
        for i, n in enumerate(metadata.query_lens):
            if i not in batched:
                rows = slice(starts[i], starts[i] + n)
                out[rows] = self.chunks.attend(layer, q[rows], k[rows], v[rows], metadata, i, rows, step)
        return out

    # ----- decode: batched, fetched ahead -----

    def _decode(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: OffloadAttentionMetadata,
        step: OffloadStep,
    ) -> torch.Tensor:  # fmt: skip
        """One new row per decode sequence: q (B, H, D), k/v (B, Hkv, D) -> (B, H, D)."""
        fetch = step.pending.pop(layer)
        keys, values = self.transfers.landed(fetch)  # (N, T, Hkv, D)
        # The step's own key/value is on the device already: it takes the spare row each fetch left.
        keys[fetch.blocks, fetch.own], values[fetch.blocks, fetch.own] = k, v
        # The fetched rows are blocks of the paged kernel: no copy, only each sequence's range is read.
        tables = fetch.blocks.to(torch.int32)[:, None]
        out, _ = paged_decode(
            q, keys, values, tables, fetch.starts, (fetch.own + 1).to(torch.int32), softcap=self.softcap
        )
        # The decode rows' keys/values (B, Hkv, D) to the tier: at their own slot, or over a victim's.
        slots = step.write_slots
        if slots is None:  # some pool is full: victims differ per layer
            slots = torch.cat([self.write_slots(layer, meta, i, meta.context_lens[i]) for i in step.decodes])
        self.store(layer, slots, k, v, step.tokens)  # slots (B, Hkv)
        return out

    def _fetch_blocks(self, layer: int, step: OffloadStep) -> Fetch:
        """Every cached row the decode sequences see in ``layer`` (their window's, in a window layer), as
        whole blocks (the fetch-everything baseline)."""
        view = step.views[self.window(layer)]
        self.count(layer, view.visible, step.cached)
        return self.transfers.fetch_blocks(layer, view.block_index, view.candidates.starts, view.own)

    def _fetch_selected(self, layer: int, step: OffloadStep) -> Fetch:
        """The rows layer ``layer``'s rehearsal selects for each decode sequence (InfiniGen)."""
        partial_q = step.partial_queries[layer].index_select(0, step.rows)  # (B, Hkv, G, r)
        view = step.views[self.window(layer)]  # a window layer selects among its window's rows
        if self.transfers.pages:  # the direct-I/O disk tier: whole blocks, by their predicted attention mass
            chosen = self.speculation.select_decode_blocks(layer, partial_q, view.candidates)
            fetch, rows = self.transfers.fetch_pages(layer, view.block_index, chosen, view.candidates.starts, view.own)
            self.count(layer, rows, step.cached)
            return fetch
        selection, slots = self.speculation.select_decode(layer, partial_q, view.candidates, step.tokens)
        self.count(layer, int(selection.counts.sum()), step.cached)
        return self.transfers.fetch_selected(layer, slots, selection.counts)

    # ----- the pool and the tier -----

    def capacity(self, meta: OffloadAttentionMetadata, i: int) -> int:
        """Slots sequence i may hold in the tier (all it may reach, unless InfiniGen limits the pool)."""
        if self.speculation is not None:
            return self.speculation.capacity(meta.full_lengths[i])
        return meta.full_lengths[i]

    def write_slots(self, layer: int, meta: OffloadAttentionMetadata, i: int, token: int, m: int = 1) -> torch.Tensor:
        """(m, Hkv) slots where tokens token.. of sequence i go in ``layer``: their own while the pool has
        room, else (one row at a time) each head's victim."""
        cap = self.capacity(meta, i)
        if token + m <= cap:
            return self.slots(meta.block_tables[i], token + m, token)[:, None].expand(m, self.num_kv_heads)
        if m != 1:
            raise ValueError(f"rows past the KV pool's capacity ({cap}) are stored one at a time, got {m}")
        return self.speculation.victims(layer, self.slots(meta.block_tables[i], cap))  # (1, Hkv)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: torch.Tensor) -> None:
        """Rows k/v (R, Hkv, D) to ``slots`` (R, Hkv) of the tier, with their partial keys and counters."""
        heads = torch.arange(self.num_kv_heads, device=slots.device)[None, :]
        flat = (slots * self.num_kv_heads + heads).view(-1)  # (R * Hkv,)
        if self.speculation is not None:
            self.speculation.stored(layer, slots, heads, flat, k, tokens)
        self.transfers.store_rows(layer, flat, k, v)

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def count(self, layer: int, fetched: int, cached: int) -> None:
        self.stats.fetched_rows[layer] += fetched
        self.stats.cached_rows[layer] += cached

    def slots(self, table: tuple[int, ...], end: int, begin: int = 0) -> torch.Tensor:
        """(end - begin,) slot ids of a sequence's rows begin..end-1."""
        return slot_ids(table, begin, end, self.block_size, self.device)


def offload_block_bytes(
    policy: KVPolicy, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int
) -> int:
    """Slower-tier bytes of one block of ``block_size`` tokens in every layer under ``policy``."""
    per_slot = sum(spec.row_bytes for spec in policy.row_codec(num_kv_heads, head_dim, dtype).specs().values())
    return per_slot * num_layers * block_size
