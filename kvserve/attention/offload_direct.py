"""The offloaded cache's transfers over the direct-I/O disk tier (``kv/direct_tier.py``): whole blocks (pages).

The same calls as ``offload_fetch.TierTransfers``, but every read is of whole blocks, as the device reads them:
fetch-everything reads each decode sequence's blocks; InfiniGen reads the blocks (pages) it predicts hold the
attention (``fetch_pages``, chosen by ``InfiniGen.select_decode_blocks``), never single rows, which would each
cost a 4 KiB random read. Reads land in page-aligned staging buffers, two per array alternating by layer (layer
i + 1's reads are in flight on the tier's pool while layer i attends), and are waited for before attention.
"""

from __future__ import annotations

import torch

from kvserve.attention.offload_fetch import Fetch, TierTransfers
from kvserve.kv.direct_tier import DISK_IO_MODES, DirectTier, staging_rows
from kvserve.kv.row_codec import PlainRows
from kvserve.kv.tiers import RowSpec, TierStore, TransferQueue


def make_transfers(
    tier_kind: str, disk_io: str, num_layers: int, num_blocks: int, block_size: int, rows: dict[str, RowSpec],
    path: str | None, queue: TransferQueue, codec: PlainRows, device: torch.device,
) -> tuple[TierStore | DirectTier, TierTransfers | DirectTransfers]:  # fmt: skip
    """The tier an offloaded cache keeps its KV in and the transfers that read and write it."""
    if disk_io not in DISK_IO_MODES:
        raise ValueError(f"kv_disk_io must be one of {list(DISK_IO_MODES)}, got {disk_io!r}")
    if disk_io == "direct":
        if tier_kind != "disk":
            raise ValueError(f"kv_disk_io='direct' is how the disk tier is read; kv_offload is {tier_kind!r}")
        tier = DirectTier(num_layers, num_blocks, block_size, rows, path)
        return tier, DirectTransfers(tier, queue, codec, device)
    store = TierStore(tier_kind, num_layers, num_blocks, block_size, rows, device.type == "cuda", path)
    return store, TierTransfers(store, queue, codec, device)


class DirectStaging:
    """Page-aligned host buffers that reads land in, two per array, alternating by layer; they grow on demand."""

    def __init__(self, tier: DirectTier) -> None:
        self.tier = tier
        self._buffers: dict[tuple[str, int], tuple[torch.Tensor, memoryview]] = {}

    def get(self, layer: int, num_rows: int) -> tuple[dict[str, torch.Tensor], dict[str, memoryview]]:
        tensors, views = {}, {}
        for name, spec in self.tier.rows.items():
            key = (name, layer % 2)
            buffer = self._buffers.get(key)
            if buffer is None or buffer[0].shape[0] < num_rows:
                size = max(num_rows, 2 * buffer[0].shape[0] if buffer is not None else num_rows)
                buffer = self._buffers[key] = staging_rows(size, spec)
            tensors[name], views[name] = buffer[0][:num_rows], buffer[1]
        return tensors, views


class DirectTransfers:
    """Reads and writes of whole blocks between ``tier`` and ``device``; ``queue`` only counts the bytes."""

    pages = True  # InfiniGen selects blocks, not rows, on this tier

    def __init__(self, tier: DirectTier, queue: TransferQueue, codec: PlainRows, device: torch.device) -> None:
        self.store, self.queue, self.codec, self.device = tier, queue, codec, device
        self.staging = DirectStaging(tier)
        self.num_kv_heads, self.head_dim = codec.num_kv_heads, codec.head_dim
        self.row_bytes = tier.slot_bytes(1)

    def _read(self, layer: int, pairs: list[tuple[int, int]], num_rows: int, shape: tuple[int, ...]) -> tuple:
        tensors, views = self.staging.get(layer, num_rows)
        read = self.store.read(layer, pairs, views)
        self.queue.count(fetched=len(pairs) * self.store.block_size * self.row_bytes)
        return read, tensors

    def fetch_blocks(self, layer: int, block_index: torch.Tensor, starts: torch.Tensor, own: torch.Tensor) -> Fetch:
        """Every block of ``block_index`` (B, W) up to each sequence's own row's: sequence b's W blocks become
        block b of the fetch (the fetch-everything baseline)."""
        batch, width = block_index.shape
        last = (own // self.store.block_size).tolist()  # past it a row of the table is padding
        table = block_index.tolist()
        pairs = [(table[b][w], b * width + w) for b in range(batch) for w in range(last[b] + 1)]
        num_rows = batch * width * self.store.block_size
        shape = (batch, width * self.store.block_size, self.num_kv_heads, self.head_dim)
        read, tensors = self._read(layer, pairs, num_rows, shape)
        blocks = torch.arange(batch, device=self.device)
        return Fetch(read, tensors, shape, blocks, starts.to(self.device, torch.int32), own.to(self.device))

    def fetch_pages(
        self, layer: int, block_index: torch.Tensor, chosen: torch.Tensor, starts: torch.Tensor, own: torch.Tensor
    ) -> tuple[Fetch, int]:
        """The ``chosen`` (B, W) blocks of ``block_index`` (B, W), each sequence's in table order, its own row's
        block (always chosen) last: sequence b's become block b of the fetch. Also returns the cached rows they
        hold."""
        bs = self.store.block_size
        batch = block_index.shape[0]
        picked = [row.nonzero().view(-1).tolist() for row in chosen.cpu()]
        width = max(len(p) for p in picked)
        table = block_index.tolist()
        pairs = [(table[b][w], b * width + j) for b in range(batch) for j, w in enumerate(picked[b])]
        shape = (batch, width * bs, self.num_kv_heads, self.head_dim)
        read, tensors = self._read(layer, pairs, batch * width * bs, shape)
        starts_l, own_l = starts.tolist(), own.tolist()
        # A sequence's first visible row is in its first block (a window's start): counted only if that block is read.
        firsts = [starts_l[b] if picked[b][0] == 0 else 0 for b in range(batch)]
        owns = [(len(picked[b]) - 1) * bs + own_l[b] % bs for b in range(batch)]
        rows = sum(o - f for o, f in zip(owns, firsts, strict=True))
        fetch = Fetch(
            read, tensors, shape, torch.arange(batch, device=self.device),
            torch.tensor(firsts, dtype=torch.int32, device=self.device),
            torch.tensor(owns, dtype=torch.long, device=self.device),
        )  # fmt: skip
        return fetch, rows

    def landed(self, fetch: Fetch) -> tuple[torch.Tensor, torch.Tensor]:
        """A fetch's keys and values (N, T, Hkv, D), once its reads have landed (copied to the device if it is not
        the CPU)."""
        fetch.transfer.wait()
        buffers = fetch.buffers
        if self.device.type != "cpu":
            buffers = {name: b.to(self.device) for name, b in buffers.items()}
        return self.codec.decode(buffers, fetch.shape)

    def fetch_rows(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head of ``slots`` (h,) in ``layer``, read as the blocks that hold them and waited for."""
        bs = self.store.block_size
        slots = slots.to("cpu", torch.long)
        blocks, inverse = torch.unique(slots // bs, return_inverse=True)
        pairs = [(b, i) for i, b in enumerate(blocks.tolist())]
        read, tensors = self._read(layer, pairs, blocks.numel() * bs, ())
        read.wait()
        index = inverse * bs + slots % bs
        rows = {name: t.index_select(0, index).to(self.device) for name, t in tensors.items()}
        return self.codec.decode(rows, (slots.numel(), self.num_kv_heads, self.head_dim))

    def store_rows(self, layer: int, flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows k/v (R, Hkv, D) to the tier's (slot, KV head) rows ``flat`` (R * Hkv,): one slot per row (this
        tier runs without a KV pool limit, so every head of a row goes to the same slot)."""
        slots = flat.view(-1, self.num_kv_heads)[:, 0] // self.num_kv_heads
        encoded = {name: rows.reshape(slots.numel(), -1) for name, rows in self.codec.encode(k, v).items()}
        self.store.write_rows(layer, slots, encoded)
        self.queue.count(stored=slots.numel() * self.row_bytes)

    def drain(self) -> None:
        """After a failed step: let its reads in flight land (their staging buffers are reused)."""
        self.store.drain()

    def close(self) -> None:
        self.store.close()
