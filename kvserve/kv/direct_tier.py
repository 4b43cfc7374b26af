"""The disk tier read and written with direct I/O (``kv_offload="disk"``, ``kv_disk_io="direct"``).

The mmap disk tier (``tiers.py``) is read through the page cache: a file that fits in RAM is never read from the
device again. This one opens its file with ``O_DIRECT``, so every read of a block that is not in the write buffer
below comes from the device, as a cold tier would.

Layout: one extent per (layer, block), layer-major (block b of layer l at ``(l * num_blocks + b) * extent``), that
holds the block's rows of every named array one after the other (K then V), padded to a page (4,096 bytes). One
extent is one read; a block's K and V are never read apart, and consecutive blocks of a layer are consecutive in
the file, so a run of them is one ``preadv`` (each array's rows scattered straight into its staging buffer).
Buffers are anonymous ``mmap`` memory (page-aligned), seen by torch through ``torch.frombuffer``.

Reads run on a small thread pool (``preadv`` releases the GIL), several in flight, and are waited for before the
attention that reads them; no PyPI io_uring binding is used (the one listed, ``liburing``, wraps a native
library through Zig; a pool of preadv keeps the queue depth with the standard library alone).

Writes are whole extents (``pwritev``), on the compute thread. A block written in part (a decode step's new row,
a prompt's last rows) stays in a write buffer in memory (``_tails``) until its last row is written, then goes to
the file whole; a read of a buffered block copies it from there. Rows are appended in order, so a store that
starts at a block's first row starts the block afresh; a store into the middle of a block that is not buffered
(or a slot copied into one) reads the block first (read-modify-write). The buffer holds at most
``max_buffered_bytes``: past it the oldest buffered blocks are written out as they are.

A filesystem without ``O_DIRECT`` (tmpfs) is a ``KVTierError`` at start naming the folder; an I/O error is a
``KVTierError`` naming it too, raised at the read's ``wait`` or by the store.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from kvserve.errors import KVTierError
from kvserve.kv.tiers import RowSpec, _describe, _reserve
from kvserve.platform.faults import fault_point

DISK_IO_MODES = ("mmap", "direct")  # kv_disk_io: how the disk tier is read (mmap: tiers.py)
PAGE = mmap.PAGESIZE
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
RUN_BLOCKS = 64  # a run's blocks in one preadv at most: long runs split across the pool's threads


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class AlignedBuffer:
    """``nbytes`` of page-aligned anonymous memory, as a memoryview (for preadv/pwritev) and a uint8 tensor."""

    def __init__(self, nbytes: int) -> None:
        self._map = mmap.mmap(-1, round_up(max(nbytes, 1), PAGE))
        self.view = memoryview(self._map)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.nbytes = len(self._map)


class DirectRead:
    """Reads in flight on the pool; ``wait`` returns once every one has landed (or raises its ``KVTierError``), and
    adds the seconds it blocked to ``stats["wait_s"]`` (the time the device, not compute, held the step up)."""

    def __init__(self, futures: list[Future], stats: dict[str, float]) -> None:
        self._futures, self._stats = futures, stats

    def wait(self) -> None:
        start = time.perf_counter()
        try:
            for future in self._futures:
                future.result()
        finally:
            self._stats["wait_s"] += time.perf_counter() - start
        self._futures = []


class DirectTier:
    """Blocks of ``num_layers`` layers in a file opened with O_DIRECT in ``path`` (see the module doc)."""

    kind = "disk"

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        rows: dict[str, RowSpec],
        path: str | os.PathLike | None = None,
        threads: int = 8,
        max_buffered_bytes: int = 64 << 20,
    ) -> None:
        self.num_layers, self.num_blocks, self.block_size, self.rows = num_layers, num_blocks, block_size, rows
        self.folder = Path(path) if path is not None else Path(tempfile.gettempdir())
        self.part_bytes = {name: spec.row_bytes * block_size for name, spec in rows.items()}
        self.row_bytes = {name: spec.row_bytes for name, spec in rows.items()}
        offsets, at = {}, 0
        for name, nbytes in self.part_bytes.items():
            offsets[name], at = at, at + nbytes
        self.part_offsets = offsets
        self.extent = round_up(at, PAGE)
        self.pad = self.extent - at
        self.nbytes = self.extent * num_layers * num_blocks
        self.fd = self._open()
        self.align = self._alignment()
        for name, nbytes in self.part_bytes.items():
            if nbytes % self.align:
                os.close(self.fd)
                raise ValueError(
                    f"kv_disk_io='direct' reads each array's block straight into its buffer, so a block of {name!r} "
                    f"({block_size} rows of {rows[name].row_bytes} bytes) must be a multiple of the device's "
                    f"direct-I/O alignment ({self.align} bytes): change block_size, or use kv_disk_io='mmap'"
                )
        self._scratch = AlignedBuffer(max(self.pad, PAGE))  # what a read's padding lands in
        self._threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvserve-direct-io")
        self._lock = threading.Lock()
        self._tails: OrderedDict[tuple[int, int], AlignedBuffer] = OrderedDict()  # the write buffer
        self._spare: list[AlignedBuffer] = []
        self._inflight: list[Future] = []
        self._max_tails = max(1, max_buffered_bytes // self.extent)
        self.stats = {"disk_read": 0, "buffer_read": 0, "disk_written": 0, "reads": 0, "wait_s": 0.0}
        self.moved = {"fetched": 0, "stored": 0}

    # ----- the file -----

    def _open(self) -> int:
        folder = self.folder
        if not folder.is_dir():
            raise ValueError(f"kv_offload_path {str(folder)!r} is not a directory")
        try:
            fd, file = tempfile.mkstemp(prefix="kvserve-kv-direct-", suffix=".bin", dir=folder)
        except OSError as exc:  # read-only file system, no write permission
            raise KVTierError(f"the disk tier cannot create its file in {str(folder)!r}: {_describe(exc)}") from None
        try:
            os.close(fd)
            try:
                fd = os.open(file, os.O_RDWR | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise KVTierError(
                        f"the disk tier cannot open its file in {str(folder)!r}: {_describe(exc)}"
                    ) from None
                raise KVTierError(
                    f"the file system of {str(folder)!r} (kv_offload_path) does not support direct I/O (O_DIRECT; "
                    "tmpfs does not): give kv_offload_path a folder on a disk, or use kv_disk_io='mmap'"
                ) from None
            try:
                _reserve(fd, self.nbytes, folder)
            except BaseException:
                os.close(fd)
                raise
        finally:
            os.unlink(file)  # the open descriptor keeps the blocks; the name goes now so nothing is left behind
        return fd

    def _alignment(self) -> int:
        """The direct-I/O alignment of buffer addresses and lengths: 512 bytes if a read so aligned works, else a
        page."""
        probe = AlignedBuffer(2 * PAGE)
        try:
            os.preadv(self.fd, [probe.view[512:1024]], 0)
            return 512
        except OSError:
            return PAGE

    def _offset(self, layer: int, block: int) -> int:
        return (layer * self.num_blocks + block) * self.extent

    def _error(self, exc: OSError, what: str) -> KVTierError:
        return KVTierError(f"the disk tier's direct {what} in {str(self.folder)!r} failed: {_describe(exc)}")

    # ----- reads -----

    def read(
        self, layer: int, pairs: Sequence[tuple[int, int]], dest: dict[str, memoryview], whole: bool = False
    ) -> DirectRead:
        """Start reading block ``b`` of ``layer`` into block slot ``d`` of each array's ``dest`` (bytes of
        ``d * block_size`` rows on) for each pair (b, d); buffered blocks are copied at once. ``whole``: ``dest``
        is {"extent": bytes} and slot d receives the block's whole extent."""
        try:
            fault_point("kv-disk")
        except OSError as exc:
            raise self._error(exc, "read") from None
        if whole:
            parts, pad = [("extent", 0, self.extent)], 0
        else:
            parts, pad = [(n, self.part_offsets[n], self.part_bytes[n]) for n in dest], self.pad
        runs: list[list[tuple[int, int]]] = []
        buffered = 0
        for block, slot in pairs:
            tail = self._tails.get((layer, block))
            if tail is not None:
                for name, start, nbytes in parts:
                    dest[name][slot * nbytes : (slot + 1) * nbytes] = tail.view[start : start + nbytes]
                buffered += self.extent
                continue
            run = runs[-1] if runs else None
            if run and run[-1][0] + 1 == block and run[-1][1] + 1 == slot and len(run) < RUN_BLOCKS:
                run.append((block, slot))
            else:
                runs.append([(block, slot)])
        # A few runs per pool task, four tasks per thread: several reads in flight, few handoffs.
        per_task = max(1, -(-len(runs) // (4 * self._threads)))
        tasks = [runs[i : i + per_task] for i in range(0, len(runs), per_task)]
        with self._lock:
            self.stats["buffer_read"] += buffered
            self.stats["disk_read"] += sum(len(r) for r in runs) * self.extent
            self.stats["reads"] += len(runs)
        futures = [self._pool.submit(self._read_runs, layer, t, dest, parts, pad) for t in tasks]
        self._inflight = [f for f in self._inflight if not f.done()] + futures
        return DirectRead(futures, self.stats)

    def drain(self) -> None:
        """Wait for every read in flight, whatever it raised (a failed step's reads are given up)."""
        for future in self._inflight:
            future.exception()
        self._inflight = []

    def _read_runs(
        self, layer: int, runs: list[list[tuple[int, int]]], dest: dict[str, memoryview],
        parts: list[tuple[str, int, int]], pad: int,
    ) -> None:  # fmt: skip
        for run in runs:
            buffers = []
            for _, slot in run:
                buffers += [dest[name][slot * nbytes : (slot + 1) * nbytes] for name, _, nbytes in parts]
                if pad:
                    buffers.append(self._scratch.view[:pad])
            want = len(run) * self.extent
            try:
                got = os.preadv(self.fd, buffers, self._offset(layer, run[0][0]))
            except OSError as exc:
                raise self._error(exc, "read") from None
            if got != want:
                raise KVTierError(f"the disk tier's direct read in {str(self.folder)!r} returned {got} of {want} bytes")

    def read_extents(self, layer: int, blocks: Sequence[int]) -> AlignedBuffer:
        """Whole extents of ``blocks`` in ``layer`` (buffered ones from the buffer), read and waited for."""
        out = AlignedBuffer(len(blocks) * self.extent)
        self.read(layer, [(b, i) for i, b in enumerate(blocks)], {"extent": out.view}, whole=True).wait()
        return out

    # ----- writes -----

    def write_rows(self, layer: int, slots: torch.Tensor, rows: dict[str, torch.Tensor]) -> None:
        """Rows (R, row bytes as uint8) of every array to ``slots`` (R,) of ``layer``: whole blocks to the file, the
        others into the write buffer (see the module doc)."""
        try:
            fault_point("kv-disk")
        except OSError as exc:
            raise self._error(exc, "write") from None
        bs = self.block_size
        slots = slots.to("cpu", torch.long)
        rows = {name: r.to("cpu").contiguous().view(torch.uint8).view(slots.numel(), -1) for name, r in rows.items()}
        blocks = slots // bs
        order = torch.argsort(blocks, stable=True)
        unique, counts = torch.unique_consecutive(blocks[order], return_counts=True)
        whole: list[tuple[int, torch.Tensor]] = []  # (block, its rows' indices in order of offset)
        at = 0
        for block, count in zip(unique.tolist(), counts.tolist(), strict=True):
            index = order[at : at + count]
            at += count
            offsets = slots[index] % bs
            if count == bs and (layer, block) not in self._tails and bool((offsets.sort().values ==
                                                                           torch.arange(bs)).all()):  # fmt: skip
                whole.append((block, index[offsets.argsort()]))
                continue
            tail = self._tail(layer, block, fresh=int(offsets.min()) == 0)
            for name, r in rows.items():
                start, rb = self.part_offsets[name], self.row_bytes[name]
                tail.tensor[start : start + bs * rb].view(bs, rb).index_copy_(0, offsets, r.index_select(0, index))
            if int(offsets.max()) == bs - 1:  # its last row: the block is complete
                self._flush(layer, block)
        if whole:
            self._write_whole(layer, whole, rows)
        while len(self._tails) > self._max_tails:
            self._flush(*next(iter(self._tails)))

    def _tail(self, layer: int, block: int, fresh: bool) -> AlignedBuffer:
        key = (layer, block)
        tail = self._tails.get(key)
        if tail is None:
            if fresh:
                tail = self._spare.pop() if self._spare else AlignedBuffer(self.extent)
            else:  # read-modify-write: the block's other rows are on the disk
                tail = self.read_extents(layer, [block])
            self._tails[key] = tail
        return tail

    def _flush(self, layer: int, block: int) -> None:
        tail = self._tails.pop((layer, block))
        self._pwrite(layer, block, [tail.view[: self.extent]])
        self._spare.append(tail)

    def _write_whole(self, layer: int, whole: list[tuple[int, torch.Tensor]], rows: dict[str, torch.Tensor]) -> None:
        """Complete blocks, packed into extents and written in runs of consecutive blocks."""
        buffer = AlignedBuffer(len(whole) * self.extent)
        extents = buffer.tensor[: len(whole) * self.extent].view(len(whole), self.extent)
        index = torch.stack([i for _, i in whole])  # (n, bs)
        for name, r in rows.items():
            start, nbytes = self.part_offsets[name], self.part_bytes[name]
            extents[:, start : start + nbytes].copy_(r[index.view(-1)].view(len(whole), nbytes))
        first = 0
        for i in range(1, len(whole) + 1):
            if i == len(whole) or whole[i][0] != whole[i - 1][0] + 1 or i - first >= RUN_BLOCKS:
                self._pwrite(layer, whole[first][0], [buffer.view[first * self.extent : i * self.extent]])
                first = i

    def _pwrite(self, layer: int, block: int, buffers: list[memoryview]) -> None:
        want = sum(len(b) for b in buffers)
        try:
            got = os.pwritev(self.fd, buffers, self._offset(layer, block))
        except OSError as exc:
            raise self._error(exc, "write") from None
        if got != want:
            raise KVTierError(f"the disk tier's direct write in {str(self.folder)!r} wrote {got} of {want} bytes")
        self.stats["disk_written"] += want

    def write_extents(self, layer: int, blocks: Sequence[int], extents: AlignedBuffer) -> None:
        """Whole extents to ``blocks`` of ``layer`` (what was buffered for them is dropped)."""
        for i, block in enumerate(blocks):
            tail = self._tails.pop((layer, block), None)
            if tail is not None:
                self._spare.append(tail)
            self._pwrite(layer, block, [extents.view[i * self.extent : (i + 1) * self.extent]])

    # ----- what the KV manager's forks and imports ask -----

    def copy_blocks(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Copy whole blocks (src, dst) in every layer (copy-on-write of a forked sequence)."""
        pairs = list(pairs)
        if not pairs:
            return
        for layer in range(self.num_layers):
            extents = self.read_extents(layer, [s for s, _ in pairs])
            self.write_extents(layer, [d for _, d in pairs], extents)

    def copy_slots(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Copy single token slots (src, dst) in every layer: read-modify-write of the destination blocks."""
        pairs = list(pairs)
        if not pairs:
            return
        bs = self.block_size
        src_blocks = sorted({s // bs for s, _ in pairs})
        dst_blocks = sorted({d // bs for _, d in pairs})
        for layer in range(self.num_layers):
            src, dst = self.read_extents(layer, src_blocks), self.read_extents(layer, dst_blocks)
            for s, d in pairs:
                a, b = src_blocks.index(s // bs) * self.extent, dst_blocks.index(d // bs) * self.extent
                for name, rb in self.row_bytes.items():
                    start = self.part_offsets[name]
                    at_src, at_dst = a + start + (s % bs) * rb, b + start + (d % bs) * rb
                    dst.view[at_dst : at_dst + rb] = src.view[at_src : at_src + rb]
            self.write_extents(layer, dst_blocks, dst)

    def block_bytes(self) -> int:
        """Bytes of one block in every layer (every array, as rows: padding not counted)."""
        return sum(self.part_bytes.values()) * self.num_layers

    def slot_bytes(self, num_layers: int = 1) -> int:
        return sum(self.row_bytes.values()) * num_layers

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def staging_rows(num_rows: int, spec: RowSpec) -> tuple[torch.Tensor, memoryview]:
    """A page-aligned (num_rows, *row) tensor of ``spec`` and its bytes."""
    buffer = AlignedBuffer(num_rows * spec.row_bytes)
    tensor = buffer.tensor[: num_rows * spec.row_bytes].view(spec.dtype).view(num_rows, *spec.shape)
    return tensor, buffer.view
