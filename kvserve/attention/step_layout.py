"""Where a step's tokens sit: row offsets, cache positions, block tables as tensors, slot ids, GQA decode.

Every KV cache splits a step the same way (flattened rows per sequence; one query row per decoding
sequence, batched; several rows per prefilling one), so these helpers are written once here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def row_starts(query_lens: Sequence[int]) -> list[int]:
    """First row of each sequence in the step's flattened tokens, and the total at the end (len + 1 entries)."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return starts


def token_positions(query_lens: Sequence[int], context_lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of the step's N tokens: its sequence's index and its cache position (both (N,) long)."""
    q = torch.tensor(tuple(query_lens), dtype=torch.long)
    ctx = torch.tensor(tuple(context_lens), dtype=torch.long)
    token_seq = torch.repeat_interleave(torch.arange(len(q)), q)  # (N,)
    starts = torch.cumsum(q, 0) - q  # first row of each sequence
    token_pos = torch.arange(int(q.sum())) - starts[token_seq] + ctx[token_seq]  # (N,)
    return token_seq, token_pos


def padded_table(tables: Sequence[Sequence[int]], seq_lens: Sequence[int], block_size: int) -> torch.Tensor:
    """Block tables as one (num_seqs, max_blocks) int32 tensor padded with block 0; each must cover its length."""
    if len(tables) != len(seq_lens):
        raise ValueError(f"{len(tables)} block tables for {len(seq_lens)} sequences")
    for i, (table, length) in enumerate(zip(tables, seq_lens, strict=True)):
        if len(table) * block_size < length:
            raise ValueError(
                f"sequence {i} needs {length} slots but its block table has {len(table)} blocks of {block_size} tokens"
            )
    return pad_tables(tables, max((len(t) for t in tables), default=0))


def pad_tables(tables: Sequence[Sequence[int]], width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The first ``width`` blocks of each table, padded with block 0: (num_seqs, width) int32."""
    rows = [list(t[:width]) + [0] * (width - min(len(t), width)) for t in tables]
    return torch.tensor(rows, dtype=torch.int32, device=device).view(len(tables), width)


def slot_ids(
    table: Sequence[int], begin: int, end: int, block_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """(end - begin,) long cache slots of a block table's positions begin..end-1."""
    first, last = begin // block_size, math.ceil(end / block_size)
    blocks = torch.tensor(table[first:last], dtype=torch.long, device=device)
    ids = (blocks[:, None] * block_size + torch.arange(block_size, device=device)).view(-1)
    return ids[begin - first * block_size : end - first * block_size]
