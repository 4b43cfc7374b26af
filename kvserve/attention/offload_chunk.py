"""Several rows of one sequence in an offloaded cache (a prompt, a chunk, a scored continuation), one sequence
at a time: their cached rows are fetched whole and waited for. A prompt's rows attend to everything before them;
under InfiniGen each row of a *scored* chunk attends only to the rows its own rehearsal selects among the rows
before it, plus itself (what decoding them one by one would read). A row past a KV pool's capacity is computed
on its own: it selects, attends, and its keys/values overwrite the victim's slot (per KV head)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvserve.attention.paged import attend_prefill
from kvserve.attention.softcap import sdpa

if TYPE_CHECKING:
    from kvserve.attention.offload_metadata import OffloadAttentionMetadata, OffloadPool
    from kvserve.attention.offload_step import OffloadStep

_SELECT_ROWS = 256  # rows of a chunk speculated at once


class OffloadChunks:
    """The chunk path of ``cache`` (see the module doc)."""

    def __init__(self, cache: OffloadPool) -> None:
        self.cache = cache

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: OffloadAttentionMetadata, i: int,
        rows: slice, step: OffloadStep,
    ) -> torch.Tensor:  # fmt: skip
        """m rows of sequence i: q (m, H, D), k/v (m, Hkv, D) -> (m, H, D)."""
        cache = self.cache
        m = q.shape[0]
        context = meta.context_lens[i]
        bulk = max(0, min(m, cache.capacity(meta, i) - context))  # rows that still find a free slot of their own
        selective = cache.speculates(layer)
        if not selective and meta.scored_from:  # speculation counts its own picks (_select_rows)
            self.count_reads(layer, meta, i, context + min(meta.scored_from[i], m), context + m)
        first_scored = min(meta.scored_from[i], bulk) if meta.scored_from and selective else 0
        out = torch.empty_like(q)
        if first_scored:  # prompt rows: attend to everything before them, in one piece
            out[:first_scored] = self._rows(layer, q[:first_scored], k[:first_scored], v[:first_scored],
                                            meta, i, rows.start, context, False, step)  # fmt: skip
        # Selecting rows go in pieces: the (rows, H, keys) speculation stays small, and a piece reads the rows
        # before it from the tier like any cached row.
        piece = _SELECT_ROWS if selective else max(bulk, 1)
        for a in range(first_scored, bulk, piece):
            b = min(a + piece, bulk)
            out[a:b] = self._rows(layer, q[a:b], k[a:b], v[a:b], meta, i, rows.start + a, context + a, selective, step)
        for j in range(bulk, m):  # a full pool: each row selects, attends and replaces a victim in turn
            out[j : j + 1] = self._rows(
                layer, q[j : j + 1], k[j : j + 1], v[j : j + 1], meta, i, rows.start + j, context + j, selective, step
            )
        return out

    def _rows(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: OffloadAttentionMetadata, i: int,
        first_row: int, token: int, select: bool, step: OffloadStep,
    ) -> torch.Tensor:  # fmt: skip
        """Rows of sequence i that all fit the pool (or one row that evicts), the first being row ``first_row``
        of the step and token ``token`` of its sequence: attend (each only to the rows InfiniGen selects for
        it, if ``select``), then store."""
        cache = self.cache
        m = q.shape[0]
        held, window = min(token, cache.capacity(meta, i)), cache.window(layer)
        first = max(0, token + 1 - window) if window else 0  # the first row the chunk's first row sees
        allowed = None
        if held > first:
            slots = cache.slots(meta.block_tables[i], held, first)  # (h,) the pool's slots
            keys, values = cache.transfers.fetch_rows(layer, slots)  # (h, Hkv, D)
            keys, values = torch.cat((keys, k)), torch.cat((values, v))
            if select:
                allowed = self._select(layer, slots, k, step, first_row, m, token)
        else:  # nothing cached to select among: the rows read the chunk's rows before them, as counted unselected
            keys, values = k, v
            if select:
                self.count_reads(layer, meta, i, token, token + m)
        out = _attend(q, keys, values, max(0, held - first), allowed, window, cache.softcap)
        write = cache.write_slots(layer, meta, i, token, m)  # (m, Hkv)
        tokens = torch.arange(token, token + m, dtype=torch.int32, device=cache.device)
        cache.store(layer, write, k, v, tokens)
        return out

    def _select(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, step: OffloadStep, first_row: int, m: int, token: int
    ) -> torch.Tensor:
        """Which of the h cached rows and m new rows each of the m rows may read: (m, Hkv, h + m) bool."""
        cache = self.cache
        held = slots.numel()
        partial_q = step.partial_queries[layer][first_row : first_row + m]  # (m, Hkv, G, r)
        window = cache.window(layer)
        allowed = cache.speculation.rows_allowed(layer, slots, k, partial_q, token, window)  # (m, Hkv, h + m)
        # Per row: rows selected among the h + j before it (every KV head), against all of them (a window layer's
        # h cached rows are its first row's window: against every row before each, as count_reads counts).
        before = held * m if window is None else token * m
        selected = (int(allowed.sum()) - m * cache.num_kv_heads) // cache.num_kv_heads
        cache.count(layer, selected, before + m * (m - 1) // 2)
        return allowed

    def count_reads(self, layer: int, meta: OffloadAttentionMetadata, i: int, begin: int, end: int) -> None:
        """Scored rows begin..end-1 of sequence i read every row before them that the pool holds, or their window's."""
        if end <= begin:
            return
        before = torch.arange(begin, end)  # rows before each
        reads = before.clamp(max=self.cache.capacity(meta, i))
        window = self.cache.window(layer)
        if window:
            reads = reads.clamp(max=window - 1)
        self.cache.count(layer, int(reads.sum()), int(before.sum()))


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    held: int,
    allowed: torch.Tensor | None,
    window: int | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q (m, H, D) at positions held.. over keys/values (held + m, Hkv, D), each row over the last ``window`` of
    them (None: all); ``allowed`` (m, Hkv, held + m) instead says what each row reads (InfiniGen's selection, made
    within the window); logits soft-capped by ``softcap`` (0: none). -> (m, H, D)."""
    if allowed is None:
        return attend_prefill(q, keys, values, held, window, softcap)
    m, num_heads, head_dim = q.shape
    hkv = keys.shape[1]
    qg = q.transpose(0, 1).reshape(hkv, num_heads // hkv, m, head_dim)  # (Hkv, G, m, D)
    mask = allowed.permute(1, 0, 2)[:, None]  # (Hkv, 1, m, h + m)
    out = sdpa(qg, keys.transpose(0, 1)[:, None], values.transpose(0, 1)[:, None], attn_mask=mask, softcap=softcap)
    return out.reshape(num_heads, m, head_dim).transpose(0, 1)
