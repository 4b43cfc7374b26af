"""A sliding-window model's KV split between tiers: the global layers' in the offload tier, the window layers' on
the device.

A window layer's KV is bounded by its window (Gemma 3: 512 positions a sequence), so it stays in a small paged
cache on the device, in KV groups that give back what the window no longer sees; only the global layers, whose KV
grows with the context, live in the slower tier and are fetched per decode step. Gemma 3 270M keeps 3 of its 18
layers' KV in the tier, and a decode step fetches those 3 layers' rows instead of 18 layers' windows and globals.

The KV manager keeps the two in separate block pools (``KVGroupSpec(pool=1)`` for the window groups), with block
ids unique across them: the tier's ids first (0 .. num_tier_blocks-1), then the device's. Each step's block tables
are split by group, and the device's ids shifted to its own pool, before each cache builds its metadata:

- ``offloaded``: an ``OffloadedKVCache`` over the global layers only (numbered 0.. in the order of the model's layers),
  fetching everything (``full``), 4-bit rows (``int4``) or the rows InfiniGen selects (its rehearsal and alphas of
  the global layers only, ``Rehearsal.of_layers``). Each global layer's fetch is queued at the input of the model's
  layer before it, as the tier's previous layer's input (InfiniGen rehearses it from there, as in the whole
  model), so it overlaps that layer's compute.
- ``device``: a ``PagedKVCache`` over the window layers, whose groups are the device pool's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvserve.attention.backend import AttentionBackend, AttentionMetadata, UnsupportedKVOperation
from kvserve.attention.offload_metadata import OffloadAttentionMetadata
from kvserve.attention.offloaded import OffloadedKVCache, OffloadStats
from kvserve.attention.paged import PagedKVCache
from kvserve.attention.paged_metadata import PagedAttentionMetadata
from kvserve.core.step import StepReport

if TYPE_CHECKING:
    from kvserve.core.step import SchedulerOutput


@dataclass(frozen=True)
class SplitAttentionMetadata(AttentionMetadata):
    """The step's metadata for each part: the device cache's (window layers) and the tier cache's (global layers)."""

    device: PagedAttentionMetadata | None = None
    tier: OffloadAttentionMetadata | None = None


class SplitOffloadKVCache(AttentionBackend):
    """Global layers' KV in an offload tier, window layers' KV on the device (see the module doc)."""

    def __init__(
        self,
        offloaded: OffloadedKVCache,
        device: PagedKVCache,
        global_layers: Sequence[int],
        tier_groups: Sequence[int],
        device_groups: Sequence[int],
    ) -> None:
        """``global_layers``: the model's layers ``offloaded`` holds, in order (tier layer i is model layer
        ``global_layers[i]``); every other layer is ``device``'s. ``tier_groups`` / ``device_groups``: the KV
        manager's groups of each part, in the order each part numbers them (the tier has one)."""
        if len(tier_groups) != 1:
            raise ValueError(f"the tier part keeps one KV group of the global layers, got groups {list(tier_groups)}")
        if offloaded.num_layers != len(global_layers):
            raise ValueError(f"the tier cache holds {offloaded.num_layers} layers; {len(global_layers)} are global")
        self.offloaded, self.device = offloaded, device
        self.tier_groups, self.device_groups = tuple(tier_groups), tuple(device_groups)
        self.tier_layer = {layer: i for i, layer in enumerate(global_layers)}
        self.first_device_block = offloaded.num_blocks  # the device pool's ids follow the tier's
        # Where tier layer j's fetch (or InfiniGen's rehearsal of it) is queued: at the input of the model's layer
        # before it, as tier layer j - 1's input (the tier queues j's there); the first at model layer 0's own
        # input if it is global (it then reads its whole cache: the tier's layer 0 is not speculated).
        self.prefetch_at: dict[int, list[int]] = {}
        for j, layer in enumerate(global_layers):
            self.prefetch_at.setdefault(max(layer - 1, 0), []).append(j - 1)

    # ----- a step -----

    def build_metadata(self, out: SchedulerOutput, rows_from: Mapping[int, int]) -> SplitAttentionMetadata:
        shift = self.first_device_block
        tier_out = _with_tables(out, lambda tables: tuple(tables[g] for g in self.tier_groups))
        device_out = _with_tables(
            out, lambda tables: tuple(tuple(b - shift for b in tables[g]) for g in self.device_groups)
        )
        tier_meta = self.offloaded.build_metadata(tier_out, rows_from)
        device_meta = self.device.build_metadata(device_out, rows_from)
        return SplitAttentionMetadata(
            seq_ids=tier_meta.seq_ids, query_lens=tier_meta.query_lens, context_lens=tier_meta.context_lens,
            layer_windows=device_meta.layer_windows, softcap=device_meta.softcap, device=device_meta, tier=tier_meta,
        )  # fmt: skip

    def observe_input(
        self, layer: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata
    ) -> None:
        for tier_layer in self.prefetch_at.get(layer, ()):
            self.offloaded.observe_input(tier_layer, x, rope, self._split(metadata).tier)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        meta = self._split(metadata)
        tier_layer = self.tier_layer.get(layer)
        if tier_layer is not None:
            return self.offloaded.forward(tier_layer, q, k, v, meta.tier)
        return self.device.forward(layer, q, k, v, meta.device)

    def store_layer(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata,
        scores: torch.Tensor | None = None,
    ) -> None:
        """A parallel prefill's whole prompt of one layer: a global layer's to the tier, a window layer's to the
        device's window group (which holds the whole prompt for that step, as a one-process prefill's does)."""
        meta = self._split(metadata)
        tier_layer = self.tier_layer.get(layer)
        if tier_layer is not None:
            self.offloaded.store_layer(tier_layer, k, v, meta.tier, scores)
        else:
            self.device.store_layer(layer, k, v, meta.device, scores)

    def report(self, metadata: AttentionMetadata) -> StepReport:
        return self.offloaded.report(self._split(metadata).tier)

    @staticmethod
    def _split(metadata: AttentionMetadata) -> SplitAttentionMetadata:
        if not isinstance(metadata, SplitAttentionMetadata):
            raise TypeError(f"SplitOffloadKVCache needs SplitAttentionMetadata, got {type(metadata).__name__}")
        return metadata

    # ----- moves the scheduler asks for -----

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write (forked samples): each pair in the pool its ids belong to."""
        shift = self.first_device_block
        self.offloaded.copy_blocks([(s, d) for s, d in pairs if s < shift])
        self.device.copy_blocks([(s - shift, d - shift) for s, d in pairs if s >= shift])

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        raise UnsupportedKVOperation(
            "a cache split between the device and an offload tier does not take Prompt Cache module tails"
        )

    def swap_out(self, pairs: Sequence[tuple[int, int]], host_cache: object = None) -> None:
        raise UnsupportedKVOperation("an offloading engine preempts by recompute (its KV is already off the device)")

    swap_in = swap_out

    def recover(self) -> None:
        self.offloaded.recover()

    def bytes_moved(self) -> dict[str, int]:
        return self.offloaded.bytes_moved()

    def set_rank_mean(self, mean: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.offloaded.set_rank_mean(mean)

    def close(self) -> None:
        self.offloaded.close()

    @property
    def stats(self) -> OffloadStats:
        """The tier's fetch counts, per global layer (tier layer i is ``global_layers[i]``)."""
        return self.offloaded.stats


def _with_tables(out: SchedulerOutput, pick: Callable[[tuple[tuple[int, ...], ...]], tuple]) -> SchedulerOutput:
    """``out`` with each scheduled sequence's block tables narrowed (and renumbered) by ``pick``."""
    scheduled = tuple(dataclasses.replace(s, block_tables=pick(s.block_tables)) for s in out.scheduled)
    return dataclasses.replace(out, scheduled=scheduled)
