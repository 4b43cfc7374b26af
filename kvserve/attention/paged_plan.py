"""A paged cache's plan of a step: which sequences decode (batched, read in place by ``paged_decode``) and which
prefill (one causal attention each), and where positioned sequences (Prompt Cache prompts, whose positions are not
their slot indices) read in a sliding-window layer. ``PagedKVCache`` makes one per step, beside its metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvserve.attention.decode import paged_decode
from kvserve.attention.kv_quant import KVQuant, widen
from kvserve.attention.row_invariant import RowPlan
from kvserve.attention.softcap import sdpa
from kvserve.attention.step_layout import row_starts

if TYPE_CHECKING:
    from kvserve.attention.paged_metadata import PagedAttentionMetadata


@dataclass(frozen=True)
class Prefill:
    """A sequence of the step with more than one new token, or with new tokens after a context."""

    index: int  # position of the sequence in the metadata's lists
    start: int  # first of its rows in the step's flattened tokens
    query_len: int
    context_len: int


@dataclass(frozen=True)
class DecodeView:
    """Where the step's decode rows read their keys in one KV group, for one window size (``paged_decode``)."""

    tables: torch.Tensor  # (Bd, W) int32: each decode row's block table
    starts: torch.Tensor  # (Bd,) int32: its first visible position (after the window's start)
    ends: torch.Tensor  # (Bd,) int32: its sequence length


@dataclass(frozen=True)
class PositionedRead:
    """What one sequence whose positions are not its slot indices reads in a sliding-window layer: the slots within
    the window of its earliest query, and which of them each query sees (``attend_positioned``)."""

    rows: slice  # its queries' rows in the step
    slots: torch.Tensor  # (K,) long cache slots
    mask: torch.Tensor  # (T, K) bool


@dataclass(frozen=True)
class PositionedDecodes:
    """The positioned sequences decoding one token, in a sliding-window layer: each row reads the slots whose
    position is within the window of its own, every slot taken as a block of one token (``paged_decode``)."""

    rows: torch.Tensor  # (Bp,) long: their queries' rows in the step
    tables: torch.Tensor  # (Bp, K) int32: the slots each reads, ascending, padded
    ends: torch.Tensor  # (Bp,) int32: how many of them


@dataclass
class StepPlan:
    """How a step splits into batched decodes and per-sequence prefills; built once, used by every layer. The
    cache makes it beside the step's (immutable) metadata, and its layers fill in what they derive on first use."""

    decode_only: bool  # every sequence decodes one token: rows are already in sequence order
    decode_rows: torch.Tensor  # (Bd,) long rows of the decode tokens in the step (empty if none)
    decodes: tuple[int, ...]  # indices of the decode sequences in the metadata's lists
    prefills: tuple[Prefill, ...]
    prefill_tables: tuple[tuple[torch.Tensor, ...], ...]  # per group, per prefill: (blocks,) long
    # (group, window) -> the decode view, made on first use (a step may hold several windows per group)
    decode_views: dict[tuple[int, int | None], DecodeView] = field(default_factory=dict)
    # (group, window) -> the batch-invariant mode's attention calls (row_invariant.py), made on first use
    row_plans: dict[tuple[int, int | None], RowPlan] = field(default_factory=dict)
    # (group, window) -> the positioned sequences' reads (``attend_positioned``), made on first use
    positioned: dict[tuple[int, int], tuple[tuple[PositionedRead, ...], PositionedDecodes | None]] = field(
        default_factory=dict
    )


def make_plan(meta: PagedAttentionMetadata) -> StepPlan:
    device = meta.slot_mappings[0].device
    starts = row_starts(meta.query_lens)
    decodes = tuple(i for i, (q, c) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)) if q == 1)
    prefills = tuple(
        Prefill(i, starts[i], q, c)
        for i, (q, c) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True))
        if q > 1
    )
    prefill_tables = tuple(
        tuple(t[p.index, : math.ceil(meta.seq_lens[p.index] / meta.block_size)].long() for p in prefills)
        for t in meta.block_tables
    )
    return StepPlan(
        decode_only=not prefills,
        decode_rows=torch.tensor([starts[i] for i in decodes], dtype=torch.long, device=device),
        decodes=decodes,
        prefills=prefills,
        prefill_tables=prefill_tables,
    )


def decode_view(meta: PagedAttentionMetadata, decodes: tuple[int, ...], group: int, window: int | None) -> DecodeView:
    """Each decode row's block table and visible range in ``group``: positions from its window's start (0
    without a window) to its length."""
    table = meta.block_tables[group]
    if len(decodes) != table.shape[0]:
        table = table.index_select(0, torch.tensor(decodes, dtype=torch.long, device=table.device))
    lens = [meta.seq_lens[i] for i in decodes]
    starts = [max(0, n - window) if window else 0 for n in lens]
    as_int = {"dtype": torch.int32, "device": table.device}
    return DecodeView(table.contiguous(), torch.tensor(starts, **as_int), torch.tensor(lens, **as_int))


def attend_positioned(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: PagedAttentionMetadata,
    plan: StepPlan,
    group: int,
    window: int | None,
    quant: KVQuant | None = None,
) -> torch.Tensor:
    """In a sliding-window layer, attention of the sequences whose positions are not their slot indices, into their
    rows of ``out``: a Prompt Cache prompt's slots hold module blocks in import order and skip the positions of
    modules it does not import, so a window counted in slots would show a query the wrong keys (the schema's BOS
    at slot ~n, far behind it by position). Each query sees the slots before it (the slot order, as everywhere)
    whose position is within ``window`` of its own. Decode rows go through the decode kernel, over those slots read
    in place; several rows of a sequence (a prompt chunk) are eager and masked: only such prompts pay it."""
    if window is None or not metadata.key_positions:
        return out
    plans, key = plan.positioned, (group, window)
    if key not in plans:  # the same for every window layer of the group in this step
        plans[key] = positioned_reads(metadata, group, window, q.device)
    reads, decodes = plans[key]
    if decodes is not None:
        by_slot = (-1, 1, *k_cache.shape[2:])  # every slot a block of one token
        starts = torch.zeros_like(decodes.ends)
        attended = paged_decode(
            q.index_select(0, decodes.rows), k_cache.view(by_slot), v_cache.view(by_slot), decodes.tables, starts,
            decodes.ends, softcap=metadata.softcap, quant=quant,
        )[0]  # fmt: skip
        out.index_copy_(0, decodes.rows, attended.to(out.dtype))
    for read in reads:
        keys = widen(slot_rows(k_cache.flatten(0, 1), read.slots), q.dtype, quant)  # (K, Hkv, D)
        values = widen(slot_rows(v_cache.flatten(0, 1), read.slots), q.dtype, quant)
        qh, kh, vh = q[read.rows].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
        attended = sdpa(qh, kh, vh, attn_mask=read.mask, softcap=metadata.softcap, enable_gqa=True)
        out[read.rows] = attended[0].transpose(0, 1).to(out.dtype)
    return out


def slot_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache[slots]`` of a (slots, Hkv, D) cache view, gathered as rows of Hkv * D: index_select is ~3x slower over
    a (.., 1, D) shape (one KV head)."""
    return cache.flatten(1).index_select(0, slots).view(-1, *cache.shape[1:])


def positioned_reads(
    metadata: PagedAttentionMetadata, group: int, window: int, device: torch.device
) -> tuple[tuple[PositionedRead, ...], PositionedDecodes | None]:
    reads, start, block_size = [], 0, metadata.block_size
    decode_rows, decode_slots = [], []
    for i, positions in enumerate(metadata.key_positions):
        q_len, ctx_len = metadata.query_lens[i], metadata.context_lens[i]
        rows = slice(start, start + q_len)
        start += q_len
        if positions is None:
            continue
        positions = positions.to(device)
        query_positions = positions[ctx_len:]  # (T,)
        # Only slots within the window of the step's earliest query: about a window's worth, not the context.
        seen = torch.nonzero(positions > query_positions.min() - window).squeeze(1)  # (K,) slot indices, ascending
        table = metadata.block_tables[group][i].to(device).long()
        slots = table[seen // block_size] * block_size + seen % block_size
        if q_len == 1:  # a decode row sees every slot before it: exactly those within its window
            decode_rows.append(rows.start)
            decode_slots.append(slots)
            continue
        rows_at = torch.arange(ctx_len, ctx_len + q_len, device=device)
        mask = (seen[None, :] <= rows_at[:, None]) & (query_positions[:, None] - positions[seen][None, :] < window)
        reads.append(PositionedRead(rows, slots, mask))
    decodes = None
    if decode_rows:
        ends = torch.tensor([len(s) for s in decode_slots], dtype=torch.int32, device=device)
        tables = torch.nn.utils.rnn.pad_sequence(decode_slots, batch_first=True).to(torch.int32)
        decodes = PositionedDecodes(torch.tensor(decode_rows, dtype=torch.long, device=device), tables, ends)
    return tuple(reads), decodes
