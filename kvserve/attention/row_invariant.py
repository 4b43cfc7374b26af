"""Attention whose result for a query row does not depend on the rest of the step (batch-invariant mode).

The fast paths in ``paged.py`` batch a step's decodes into one call padded to the longest context, and run a
prefill chunk as one causal call (two when it follows cached tokens). The kernel blocks its work by those
shapes, so the order in which a row's sums are taken follows the padded length, the chunk's size and where
the chunk starts: things the other sequences, the token budget and the prefix cache decide. In bfloat16 the
last bits then differ, and a greedy sequence can take another token.

Here a query row attends in a call whose shape follows from its own position alone: its keys run from the
first block its window reaches to the end of the block that holds it (``L`` keys, a whole number of blocks),
keys after it masked; one batch entry per row, holding the G query heads of each KV head. Batch entries are
computed independently, so rows with the same ``L`` share one call, and a row gets the same bits as a decode,
inside any prefill chunk, or beside any other rows. Masked keys add exact zeros (their values are finite: the
cache is zero-initialised).

Cost: one call per distinct ``L`` of a step (a prefill chunk of T tokens: T / block_size calls per layer;
a decode step: about one per sequence), up to a block of masked keys per row, and the small-query kernel
where a chunk's rows would share one blocked call. A sequence's keys are gathered once per layer and its
calls read views of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.attention.softcap import sdpa


@dataclass(frozen=True)
class RowCall:
    """The step's query rows whose keys have the same length ``L``: one attention call."""

    rows: torch.Tensor  # (R,) long: the rows' indices in the step
    mask: torch.Tensor  # (R, 1, 1, L) bool, True = attend
    run: int  # rows of one sequence: the index of the run (``RowPlan.runs``) whose first L keys they read; else -1
    blocks: torch.Tensor | None = None  # run -1: (R * L / block_size,) long, each row's own blocks


@dataclass(frozen=True)
class RowPlan:
    """A step's attention calls in one KV group for one window size; built once, used by every such layer."""

    runs: tuple[torch.Tensor, ...]  # (blocks,) long: the blocks a sequence's rows read, gathered once per layer
    calls: tuple[RowCall, ...]


@dataclass(frozen=True)
class _Row:
    row: int  # index in the step
    seq: int  # index of its sequence in the metadata's lists
    first: int  # first block its window reaches
    position: int  # its position in the cache


def plan_row_calls(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_table: torch.Tensor,
    block_size: int,
    window: int | None,
) -> RowPlan:
    """Group the step's rows by key length. ``block_table`` (num_seqs, max_blocks): one KV group's tables."""
    by_length: dict[int, list[_Row]] = {}
    row = 0
    for seq, (q_len, ctx_len) in enumerate(zip(query_lens, context_lens, strict=True)):
        for position in range(ctx_len, ctx_len + q_len):
            first = max(0, position - window + 1) // block_size if window else 0
            length = (position // block_size + 1 - first) * block_size
            by_length.setdefault(length, []).append(_Row(row, seq, first, position))
            row += 1
    # A run per (sequence, first block) read by one call's rows, as long as its longest call needs.
    run_blocks: dict[tuple[int, int], int] = {}
    for length, rows in by_length.items():
        runs = {(r.seq, r.first) for r in rows}
        if len(runs) == 1:
            key = runs.pop()
            run_blocks[key] = max(run_blocks.get(key, 0), length // block_size)
    run_index = {key: i for i, key in enumerate(run_blocks)}
    runs = tuple(block_table[seq, first : first + n].long() for (seq, first), n in run_blocks.items())
    calls = tuple(_call(rows, length, block_table, block_size, window, run_index) for length, rows in by_length.items())
    return RowPlan(runs, calls)


def _call(
    rows: list[_Row],
    length: int,
    table: torch.Tensor,
    block_size: int,
    window: int | None,
    run_index: dict[tuple[int, int], int],
) -> RowCall:
    device = table.device
    starts = torch.tensor([r.first * block_size for r in rows], device=device)
    positions = torch.tensor([r.position for r in rows], device=device)
    keys = starts[:, None] + torch.arange(length, device=device)  # (R, L) cache positions
    mask = keys <= positions[:, None]
    if window is not None:
        mask &= keys > (positions - window)[:, None]
    index = torch.tensor([r.row for r in rows], dtype=torch.long, device=device)
    mask = mask.view(len(rows), 1, 1, length)
    runs = {(r.seq, r.first) for r in rows}
    if len(runs) == 1:
        return RowCall(index, mask, run_index[runs.pop()])
    num_blocks = length // block_size
    blocks = torch.cat([table[r.seq, r.first : r.first + num_blocks] for r in rows]).long()
    return RowCall(index, mask, -1, blocks)


def attend_row_calls(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: RowPlan, softcap: float = 0.0
) -> torch.Tensor:
    """q (N, H, D) over one layer's cache k_cache, v_cache (num_blocks, block_size, Hkv, D) -> (N, H, D); logits
    soft-capped by ``softcap`` (0: none)."""
    num_heads, head_dim = q.shape[1:]
    hkv = k_cache.shape[2]
    out = torch.empty_like(q)
    gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # run -> its keys and values (S, Hkv, D)
    for call in plan.calls:
        r, length = call.rows.numel(), call.mask.shape[-1]
        if call.run >= 0:
            if call.run not in gathered:
                blocks = plan.runs[call.run]
                gathered[call.run] = (k_cache[blocks].flatten(0, 1), v_cache[blocks].flatten(0, 1))
            # (R, Hkv, L, D) views of the run's first L keys: every row reads the one copy.
            keys, values = (t[:length].transpose(0, 1).expand(r, -1, -1, -1) for t in gathered[call.run])
        else:
            keys = k_cache.index_select(0, call.blocks).view(r, length, hkv, head_dim).transpose(1, 2)
            values = v_cache.index_select(0, call.blocks).view(r, length, hkv, head_dim).transpose(1, 2)
        # Query head h reads KV head h // G: fold the G heads of a group into the entry's query rows.
        qg = q.index_select(0, call.rows).view(r, hkv, num_heads // hkv, head_dim)  # (R, Hkv, G, D)
        attended = sdpa(qg, keys, values, attn_mask=call.mask, softcap=softcap)  # (R, Hkv, G, D)
        out.index_copy_(0, call.rows, attended.reshape(r, num_heads, head_dim))
    return out
