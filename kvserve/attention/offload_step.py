"""An offloaded cache's step: its decode batch planned once for every layer, and what changes while the layers
run (fetches in flight, partial queries). ``OffloadedKVCache.build_metadata`` makes one beside the step's
(immutable) metadata; the layers read and fill it in."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvserve.attention.offload_fetch import Fetch
from kvserve.attention.step_layout import pad_tables, row_starts
from kvserve.policies.infinigen import PagedCandidates


@dataclass(frozen=True)
class DecodeBlocks:
    """The blocks a decode batch reads in layers of one window size (None: the whole context): sequence b sees
    rows ``starts[b] .. own[b] - 1`` of its W * block_size, and its new row goes in at ``own[b]``."""

    block_index: torch.Tensor  # (Bd, W) long block ids covering each sequence's visible rows and the next one
    candidates: PagedCandidates  # the same blocks as an int32 table, and the cached rows each sequence sees
    own: torch.Tensor  # (Bd,) long
    visible: int  # cached rows the sequences see, together


@dataclass
class OffloadStep:
    decodes: list[int]  # sequences (metadata order) decoding one token, batched
    views: dict[int | None, DecodeBlocks]  # window size (None: global layers) -> what its layers fetch
    cached: int  # rows the decode sequences hold, together
    rows: torch.Tensor  # (Bd,) long: the decode sequences' rows in the step's tokens
    tokens: torch.Tensor  # (Bd,) int32: their new tokens' indices in their sequences
    write_slots: torch.Tensor | None  # (Bd, Hkv) long: where the new rows go, unless a full pool evicts
    pending: dict[int, Fetch] = field(default_factory=dict)  # layer -> its fetch
    partial_queries: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (N, Hkv, G, r)


def plan_step(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[tuple[int, ...]],
    capacity: Callable[[int], int],
    windows: Sequence[int | None],
    block_size: int,
    num_kv_heads: int,
    device: torch.device,
) -> OffloadStep:
    """The step's decode batch (the blocks its rows are in), planned once for every layer. ``capacity(i)``: the
    slots sequence i may hold; ``windows``: the window sizes of the model's layers (None: global)."""
    # One new row over a cache: batched and fetched ahead. A one-token prompt has nothing to fetch.
    decodes = [i for i, n in enumerate(query_lens) if n == 1 and context_lens[i] > 0]
    held = [min(context_lens[i], capacity(i)) for i in decodes]
    bs = block_size
    starts = row_starts(query_lens)
    tokens = [context_lens[i] for i in decodes]
    evicting = any(t >= capacity(i) for i, t in zip(decodes, tokens, strict=True))
    write = None
    if not evicting:  # each new row at its own slot, in every layer
        own_slots = [block_tables[i][t // bs] * bs + t % bs for i, t in zip(decodes, tokens, strict=True)]
        write = torch.tensor(own_slots, dtype=torch.long, device=device)[:, None].expand(-1, num_kv_heads)
    views = {w: _decode_blocks(block_tables, decodes, held, w, bs, device) for w in set(windows)}
    return OffloadStep(
        decodes, views, sum(held), torch.tensor([starts[i] for i in decodes], dtype=torch.long, device=device),
        torch.tensor(tokens, dtype=torch.int32, device=device), write,
    )  # fmt: skip


def _decode_blocks(
    block_tables: Sequence[tuple[int, ...]],
    decodes: list[int],
    held: list[int],
    window: int | None,
    bs: int,
    device: torch.device,
) -> DecodeBlocks:
    """Per decode sequence, the whole blocks from its window's first row (0 without a window) up to and
    including its next row: its own key/value goes there once fetched."""
    firsts = [max(0, h + 1 - window) if window else 0 for h in held]  # first visible row
    lows = [f // bs for f in firsts]  # first block read
    width = max((h // bs - low + 1 for h, low in zip(held, lows, strict=True)), default=1)
    tables = [block_tables[i][low : h // bs + 1] for i, h, low in zip(decodes, held, lows, strict=True)]
    blocks = pad_tables(tables, width)  # (Bd, W)
    base = torch.tensor(lows, dtype=torch.long) * bs  # (Bd,) row of the first block read
    own = torch.tensor(held, dtype=torch.long) - base
    starts = torch.tensor(firsts, dtype=torch.long) - base
    blocks = blocks.to(device)
    candidates = PagedCandidates(blocks, bs, starts.to(torch.int32).to(device), own.to(torch.int32).to(device))
    visible = sum(h - f for h, f in zip(held, firsts, strict=True))
    return DecodeBlocks(blocks.long(), candidates, own.to(device), visible)
