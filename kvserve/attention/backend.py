"""The one contract between the runner and a KV cache: every cache kvserve runs implements it.

A step flows as::

    SchedulerOutput (plain data) -> cache.apply_moves(out)            swap / copy-on-write / module tails
                                 -> cache.build_metadata(out, rows)   the cache's own metadata format
                                 -> model.forward(...)                calls observe_input, forward, surviving_rows
                                 -> cache.report(metadata)            StepReport -> Scheduler.update

The runner never asks which kind of cache it holds, and the metadata stays what the builder made:
what a step learns (slots each layer kept, bytes moved) comes back as a ``StepReport``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvserve.core.step import StepReport
from kvserve.errors import KVTierError
from kvserve.platform.faults import fault_point

if TYPE_CHECKING:
    from kvserve.core.step import SchedulerOutput

# What a parallel prefill hands over per layer: (layer, keys (T, Hkv, D), values (T, Hkv, D), and the
# sequence's policy scores (T,) float32 when its policy votes (KVPolicy.votes), else None).
LayerKVSink = Callable[[int, torch.Tensor, torch.Tensor, "torch.Tensor | None"], None]


class UnsupportedKVOperation(NotImplementedError):
    """A cache was asked for an operation its kind cannot do (the message says why)."""


@dataclass(frozen=True)
class AttentionMetadata:
    """What one forward step holds, independent of how the cache is laid out.

    The step's tokens are flattened across sequences: sequence ``i`` contributes
    ``query_lens[i]`` new tokens, appended after the ``context_lens[i]`` tokens it already
    has in the cache. Backends that need more (block tables, slot mappings) subclass this.
    """

    seq_ids: tuple[int, ...]
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    # Per layer, how many positions a query sees (its own included; sliding-window layers), or None for
    # the whole context; () means every layer sees everything (``ModelConfig.layer_windows``).
    layer_windows: tuple[int | None, ...] = field(default=(), kw_only=True)
    # The attention-logit soft cap of every layer (Gemma 2: logits -> softcap * tanh(logits / softcap) before the
    # mask and softmax), 0.0 for none (``ModelConfig.attention_softcap``).
    softcap: float = field(default=0.0, kw_only=True)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def __post_init__(self) -> None:
        if not len(self.seq_ids) == len(self.query_lens) == len(self.context_lens):
            raise ValueError(
                f"metadata lists differ in length: {len(self.seq_ids)} seq_ids, "
                f"{len(self.query_lens)} query_lens, {len(self.context_lens)} context_lens"
            )


@dataclass(frozen=True)
class InPlaceDecode:
    """A decode-only step, for a caller that writes and attends each layer's KV itself (``models/decode_chain.py``):
    the cache's storage, where each layer's new keys go, what each row reads. Valid for the one step it was made
    for; the caller hands the result back through ``AttentionBackend.finish_in_place_decode``.

    One block table for every layer (the paged cache): slots (B,), tables (B, W), starts and ends (B,). Layers
    holding different slots (the compressed cache, a KV group per layer): slots (L, B), tables (L, B, W), starts
    and ends (L, B). ``want_weights``: the cache's policy scores slots by each layer's attention probabilities."""

    k_cache: torch.Tensor  # (rows, blocks, block_size, Hkv, D)
    v_cache: torch.Tensor
    layer_rows: tuple[int, ...]  # per layer, its row of the cache
    slots: torch.Tensor  # long: each sequence's new token's slot in a row
    tables: torch.Tensor  # int32; tables, starts and ends as ``attention.decode.paged_decode`` reads them
    starts: torch.Tensor
    ends: torch.Tensor
    want_weights: bool = False


class AttentionBackend(ABC):
    """Stores a layer's new keys/values and attends the step's queries over the sequence's cache.

    The minimum a backend implements is ``forward``; a backend the engine runs (a *KV cache*) also
    builds its metadata from a ``SchedulerOutput`` and moves blocks as the scheduler says. Operations a
    kind of cache cannot do raise ``UnsupportedKVOperation`` naming the reason.
    """

    # ----- a step -----

    def build_metadata(self, out: SchedulerOutput, rows_from: Mapping[int, int]) -> AttentionMetadata:
        """This cache's metadata for the step ``out`` schedules. ``rows_from``: sequences whose logits are
        needed for every row of their chunk from that row on (prompt logprobs); a cache that drops rows keeps
        them."""
        raise UnsupportedKVOperation(f"{type(self).__name__} is a reference backend; it does not run scheduled steps")

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Causal attention for the step's tokens.

        q (N, H, D), k and v (N, Hkv, D), already rotated; returns (N, H, D). N is
        ``metadata.num_tokens``; the keys/values are written to the cache before attending.
        """

    def observe_input(
        self, layer: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata
    ) -> None:
        """Sees ``layer``'s attention input x (N, hidden) and the step's rotary tables before the layer runs:
        those of layer + 1 (the layer InfiniGen's rehearsal predicts), the layer's own except where layers
        rotate differently (Gemma 3's window and global layers).

        A no-op by default; an offloading cache uses it to start fetching the next layer's KV (InfiniGen
        predicts what that layer will read from this input)."""
        return None

    def surviving_rows(self, layer: int, metadata: AttentionMetadata) -> torch.Tensor | None:
        """Rows of ``layer``'s input that go on to the next layer, (N',) long ascending, after its
        ``forward``; None (the default) means every row. A cache that drops tokens during prefill
        (PyramidInfer) drops them from the hidden states too, so deeper layers compute fewer rows."""
        return None

    def in_place_decode(self, metadata: AttentionMetadata) -> InPlaceDecode | None:
        """Where a step that only decodes reads and writes KV, when every layer does that with one kernel call
        (paged decode attention over block tables): the model may then run its layers as one call. None (the
        default) for any other step or cache: each layer goes through ``forward``."""
        return None

    def finish_in_place_decode(self, metadata: AttentionMetadata, weights: torch.Tensor | None) -> None:
        """After the layers of an ``in_place_decode`` step ran: ``weights`` (L, B, T) are each layer's attention
        probabilities when the step asked for them (``InPlaceDecode.want_weights``), else None. A cache that
        scores or compacts its slots does it here; nothing by default."""
        return None

    def store_layer(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata,
        scores: torch.Tensor | None = None,
    ) -> None:
        """Write keys/values (N, Hkv, D) of the step's tokens computed elsewhere (a parallel prefill); ``scores``
        (N,) float32 are the sequence policy's scores of them (``KVPolicy.votes``), None for a policy that
        does not score. A cache that keeps every token ignores them."""
        raise UnsupportedKVOperation(f"{type(self).__name__} does not take keys/values computed elsewhere")

    def report(self, metadata: AttentionMetadata) -> StepReport:
        """What the step just run learned, for the scheduler; nothing by default."""
        return StepReport(output_rows=metadata.query_lens)

    # ----- moves the scheduler asks for -----

    def apply_moves(self, out: SchedulerOutput) -> None:
        """Swap-outs first (the blocks they vacate may be handed out again in this very step), then swap-ins,
        copy-on-write blocks and Prompt Cache module tails."""
        try:
            if out.blocks_to_swap_out or out.blocks_to_swap_in:
                fault_point("swap")
            if out.blocks_to_swap_out:
                self.swap_out(out.blocks_to_swap_out)
            if out.blocks_to_swap_in:
                self.swap_in(out.blocks_to_swap_in)
        except UnsupportedKVOperation:
            raise
        except (OSError, RuntimeError) as exc:  # the host tier failed a copy: the engine recomputes those sequences
            raise KVTierError(f"swapping KV blocks to or from the host tier (swap_space) failed: {exc!r}") from exc
        if out.blocks_to_copy:
            self.copy_blocks(out.blocks_to_copy)
        if out.slots_to_copy:
            self.copy_slots(out.slots_to_copy)

    def recover(self) -> None:
        """After a step that raised ``KVTierError``: settle what the step left in flight (the engine recomputes
        the step's sequences). Nothing by default."""
        return None

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: each (src, dst) block's contents in every layer."""
        raise UnsupportedKVOperation(f"{type(self).__name__} cannot copy blocks")

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy single token slots (src, dst) in every layer (Prompt Cache module tails)."""
        raise UnsupportedKVOperation(f"{type(self).__name__} cannot copy slots")

    def swap_out(self, pairs: Sequence[tuple[int, int]], host_cache: AttentionBackend | None = None) -> None:
        """Copy (device block, host block) pairs to the host tier (preemption by swapping)."""
        raise UnsupportedKVOperation(f"{type(self).__name__} cannot swap blocks")

    def swap_in(self, pairs: Sequence[tuple[int, int]], host_cache: AttentionBackend | None = None) -> None:
        """Copy (host block, device block) pairs back from the host tier."""
        raise UnsupportedKVOperation(f"{type(self).__name__} cannot swap blocks")

    def read_slots(self, slots: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``slots`` in every layer, (L, n, Hkv, D) each (a module copied to the host tier)."""
        raise UnsupportedKVOperation(f"{type(self).__name__} cannot read slots")

    def write_slots(self, slots: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write (L, n, Hkv, D) keys and values into ``slots`` of every layer (a host-tier module copied in)."""
        raise UnsupportedKVOperation(f"{type(self).__name__} cannot write slots")

    def bytes_moved(self) -> dict[str, int]:
        """Bytes moved between tiers since the cache was made (``fetched``, ``stored``); {} for a cache that
        keeps everything where attention reads it."""
        return {}

    def set_rank_mean(self, mean: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Under tensor parallelism this cache holds only its rank's heads: ``mean`` turns a per-slot score averaged
        over them into the average over every head (``parallel/tensor_model.py``). A cache that does not rank
        slots by attention ignores it (the default)."""
        return None

    def close(self) -> None:
        """Release threads and files the cache holds (idempotent); nothing by default."""
        return None
