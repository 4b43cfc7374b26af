"""A paged cache's step metadata: per KV group a block table and a slot mapping (``paged.py`` holds the cache)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.attention.backend import AttentionMetadata
from kvserve.attention.step_layout import padded_table, token_positions

BlockTable = Sequence[int]


@dataclass(frozen=True)
class PagedAttentionMetadata(AttentionMetadata):
    """Attention metadata for a paged cache: per KV group a block table and a slot mapping.

    A KV group is a set of layers holding the same token slots and sharing one block table (a
    plain model has one group). ``layer_to_group[layer]`` names a layer's group; empty means every
    layer is in group 0. All groups hold the same token counts (``context_lens``).
    """

    slot_mappings: tuple[torch.Tensor, ...]  # per group: (N,) long, block_id * block_size + offset
    block_tables: tuple[torch.Tensor, ...]  # per group: (num_seqs, max_blocks) int32, padded with 0
    seq_lens: tuple[int, ...]  # context + query per sequence
    block_size: int
    layer_to_group: tuple[int, ...] = ()
    # Per sequence, the position of every slot up to its last query (CPU long), or None where positions are slot
    # indices: sliding windows then count positions (Prompt Cache prompts; see ``paged_plan.attend_positioned``).
    key_positions: tuple[torch.Tensor | None, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        num_seqs, num_groups = len(self.seq_ids), len(self.block_tables)
        if num_groups == 0 or len(self.slot_mappings) != num_groups:
            raise ValueError(
                f"need one block table and one slot mapping per KV group, got {num_groups} block tables "
                f"and {len(self.slot_mappings)} slot mappings"
            )
        if len(self.seq_lens) != num_seqs:
            raise ValueError(f"{len(self.seq_lens)} seq_lens for {num_seqs} sequences")
        for table, slots in zip(self.block_tables, self.slot_mappings, strict=True):
            if table.dim() != 2 or table.shape[0] != num_seqs:
                raise ValueError(f"a block table must be (num_seqs={num_seqs}, max_blocks), got {tuple(table.shape)}")
            if tuple(slots.shape) != (self.num_tokens,):
                raise ValueError(f"a slot mapping must be ({self.num_tokens},), got {tuple(slots.shape)}")
            longest = max(self.seq_lens, default=0)
            if table.shape[1] * self.block_size < longest:
                raise ValueError(
                    f"block tables hold {table.shape[1]} blocks of {self.block_size} tokens, "
                    f"a sequence needs {longest} tokens"
                )
        bad = [g for g in self.layer_to_group if not 0 <= g < num_groups]
        if bad:
            raise ValueError(f"layer_to_group names groups {bad}; there are {num_groups} groups")

    @classmethod
    def build(
        cls,
        seq_ids: Sequence[int],
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[BlockTable],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> PagedAttentionMetadata:
        """Metadata for a single-group cache from plain block tables (one list of block ids per sequence)."""
        return cls.build_grouped(seq_ids, query_lens, context_lens, [block_tables], block_size, device)

    @classmethod
    def build_grouped(
        cls,
        seq_ids: Sequence[int],
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        group_block_tables: Sequence[Sequence[BlockTable]],
        block_size: int,
        device: torch.device | str = "cpu",
        layer_to_group: Sequence[int] = (),
        layer_windows: Sequence[int | None] = (),
        key_positions: Sequence[torch.Tensor | None] = (),
        softcap: float = 0.0,
    ) -> PagedAttentionMetadata:
        """Metadata with one block table per KV group: ``group_block_tables[g][i]`` is sequence i's table in group g."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        query_lens, context_lens = tuple(query_lens), tuple(context_lens)
        seq_lens = tuple(c + q for c, q in zip(context_lens, query_lens, strict=True))
        token_seq, token_pos = token_positions(query_lens, context_lens)  # (N,), (N,) on CPU
        tables, slots = [], []
        for tables_of_group in group_block_tables:
            table = padded_table(tables_of_group, seq_lens, block_size)  # (S, max_blocks) int32
            block_ids = table[token_seq, token_pos // block_size].long()
            slots.append((block_ids * block_size + token_pos % block_size).to(device))
            tables.append(table.to(device))
        return cls(
            seq_ids=tuple(seq_ids),
            query_lens=query_lens,
            context_lens=context_lens,
            slot_mappings=tuple(slots),
            block_tables=tuple(tables),
            seq_lens=seq_lens,
            block_size=block_size,
            layer_to_group=tuple(layer_to_group),
            layer_windows=tuple(layer_windows),
            key_positions=tuple(key_positions) if any(p is not None for p in key_positions) else (),
            softcap=softcap,
        )

    @property
    def slot_mapping(self) -> torch.Tensor:
        """(N,) long slots of the step's tokens, for a single-group cache."""
        if len(self.slot_mappings) != 1:
            raise ValueError(f"the cache has {len(self.slot_mappings)} KV groups; use slot_mappings[group]")
        return self.slot_mappings[0]

    def group_of(self, layer: int) -> int:
        if not self.layer_to_group:
            return 0
        if not 0 <= layer < len(self.layer_to_group):
            raise ValueError(f"layer {layer} has no KV group; layer_to_group covers {len(self.layer_to_group)} layers")
        return self.layer_to_group[layer]
