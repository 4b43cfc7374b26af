"""The offloaded cache's transfers: rows of one layer fetched from its tier to the device, and rows stored back.

Every copy goes through the ``TransferQueue`` in order (a fetch queued after a store reads what was stored), lands
in the ``StagingBuffers`` (two per array, alternating by layer, so layer i + 1's fetch overlaps layer i's
attention), and passes the policy's row codec (``kv/row_codec.py``: as it is, or INT4 codes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.kv.row_codec import PlainRows
from kvserve.kv.tiers import StagingBuffers, TierStore, Transfer, TransferQueue, gather_rows, scatter_rows


@dataclass
class Fetch:
    """Rows of one layer on their way to the device, for the step's decode sequences, as (N, T, Hkv, D) keys
    and values: whole blocks, sequence b's in block b's T rows, or the rows InfiniGen selects (each KV head its
    own), every sequence's one after the other in one block. Sequence b attends to rows ``starts[b] .. own[b]``
    of its block ``blocks[b]``, its new row going in at ``own[b]``."""

    transfer: Transfer
    buffers: dict[str, torch.Tensor]  # the staging buffers it lands in
    shape: tuple[int, ...]  # (N, T, Hkv, D): of the keys/values they hold
    blocks: torch.Tensor  # (B,) long
    starts: torch.Tensor  # (B,) int32
    own: torch.Tensor  # (B,) long


class TierTransfers:
    """Fetches and stores between ``store`` (the tier) and ``device``, queued on ``queue``, in ``codec``'s rows."""

    pages = False  # InfiniGen selects rows (``DirectTransfers`` reads blocks)

    def __init__(self, store: TierStore, queue: TransferQueue, codec: PlainRows, device: torch.device) -> None:
        self.store, self.queue, self.codec, self.device = store, queue, codec, device
        self.names = tuple(store.rows)
        self.staging = StagingBuffers(store.rows, device)
        self.num_kv_heads, self.head_dim = codec.num_kv_heads, codec.head_dim
        self.row_bytes = store.slot_bytes(1)  # one slot in one layer (every head, every array)

    def fetch_blocks(self, layer: int, block_index: torch.Tensor, starts: torch.Tensor, own: torch.Tensor) -> Fetch:
        """Whole blocks ``block_index`` (B, W) of ``layer``: sequence b's W blocks become block b of the fetch."""
        blocks = block_index.view(-1)
        num_rows = blocks.numel() * self.store.block_size
        batch = block_index.shape[0]
        out = {name: self.staging.get(name, layer, num_rows) for name in self.names}

        def copy() -> None:
            for name, buffer in out.items():
                gather_rows(self.store.by_block(name, layer), blocks, buffer.view(blocks.numel(), -1))

        shape = (batch, num_rows // batch, self.num_kv_heads, self.head_dim)
        transfer = self.queue.fetch(copy, num_rows * self.row_bytes)
        sequence_blocks = torch.arange(batch, device=self.device)  # sequence b's rows are block b
        return Fetch(transfer, out, shape, sequence_blocks, starts, own)

    def fetch_selected(self, layer: int, slots: torch.Tensor, counts: torch.Tensor) -> Fetch:
        """The first ``counts[b]`` of ``slots`` (B, Hkv, K) per decode sequence and KV head, and a spare row for
        its own key/value: every sequence's rows one after the other, in one block."""
        batch = slots.shape[0]
        # One more row per (sequence, head), any row: the step's own key/value goes there once fetched.
        slots = F.pad(slots, (0, 1))
        counts = counts.to(slots.device)
        heads = torch.arange(self.num_kv_heads, device=slots.device)[None, :, None]
        # Rows of the tier's (slots * Hkv, D) view, ordered (row, Hkv): row j of a sequence holds each KV head's
        # j-th pick. Only its count of picks and the spare row: past its count a sequence's slots are
        # placeholders (K is the batch's largest count), so the sequences' rows go one after the other.
        keep = torch.arange(slots.shape[-1], device=slots.device)[None, :] <= counts[:, None]  # (B, K + 1)
        flat = (slots * self.num_kv_heads + heads).transpose(1, 2)[keep].reshape(-1)
        own = torch.cumsum(counts + 1, 0) - 1  # each sequence's spare row, after its picks
        starts = own - counts  # its first pick
        total = flat.numel() // self.num_kv_heads
        out = {name: self.staging.get(name, layer, total) for name in self.names}  # total x every head

        def copy() -> None:
            for name, buffer in out.items():
                gather_rows(self.store.by_head(name, layer), flat, buffer.view(flat.numel(), -1))

        nbytes = flat.numel() * self.row_bytes // self.num_kv_heads
        shape = (1, total, self.num_kv_heads, self.head_dim)  # one block: every sequence's rows
        blocks = torch.zeros(batch, dtype=torch.long, device=self.device)
        starts = starts.to(self.device, torch.int32)
        return Fetch(self.queue.fetch(copy, nbytes), out, shape, blocks, starts, own.to(self.device))

    def landed(self, fetch: Fetch) -> tuple[torch.Tensor, torch.Tensor]:
        """A fetch's keys and values (N, T, Hkv, D), once it has landed (INT4 codes dequantised on the device)."""
        fetch.transfer.wait()
        return self.codec.decode(fetch.buffers, fetch.shape)

    def fetch_rows(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head of ``slots`` (h,) in ``layer``, fetched and waited for: (h, Hkv, D) keys and values."""
        out = {name: self.staging.get(name, layer, slots.numel()) for name in self.names}

        def copy() -> None:
            for name, buffer in out.items():
                gather_rows(self.store.by_slot(name, layer), slots, buffer.view(slots.numel(), -1))

        self.queue.fetch(copy, slots.numel() * self.row_bytes).wait()
        return self.codec.decode(out, (slots.numel(), self.num_kv_heads, self.head_dim))

    def store_rows(self, layer: int, flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows k/v (R, Hkv, D) to the tier's (slot, KV head) rows ``flat`` (R * Hkv,), queued."""
        encoded = {name: rows.reshape(flat.numel(), -1).contiguous() for name, rows in self.codec.encode(k, v).items()}

        def copy() -> None:
            for name, rows in encoded.items():
                scatter_rows(self.store.by_head(name, layer), flat, rows)

        self.queue.store(copy, flat.numel() * self.row_bytes // self.num_kv_heads)

    def close(self) -> None:
        """Nothing of its own to release (the queue is the cache's)."""

    def drain(self) -> None:
        """Nothing in flight of its own (the cache drains the queue)."""
