"""KV tiers below the device, and the transfers between them.

The *device* tier is where attention reads (GPU memory, or CPU memory on a CPU-only machine). An
offloading engine (``kv_offload``) keeps every sequence's full KV in a slower tier instead:

- ``host``: CPU memory, pinned when the device is CUDA so copies run asynchronously;
- ``disk``: a memory-mapped file (``torch.from_file``), for contexts beyond RAM (``kv_disk_io="mmap"``; with
  ``"direct"``, ``direct_tier.py``: a file read and written with O_DIRECT, so reads come from the device).
  The file is unlinked as soon as it is mapped, so it disappears with the process. Its space is reserved at creation
  (``posix_fallocate``): a full disk, or a missing, read-only or unwritable folder, is a ``KVTierError`` at
  start naming the folder and the bytes, never a fault later. A write to a mapped page cannot fail for
  space then; a disk's I/O error on a mapped page is a SIGBUS, which no handler in Python can catch (the
  process dies). mmap is kept over explicit ``preadv``/``pwritev`` (which would turn EIO into an OSError)
  because it is the faster path: one thread, SmolLM2's 30 layers, fetch-everything over 4 x 2,048 tokens,
  8.4 ms of gathers a step against 14.0 ms of preadv, and the step's stores 0.13 ms against 1.45 ms of pwritev.

A tier holds named per-slot arrays (K and V, or INT4 codes and their scales), each (layers, slots,
*row shape), indexed by the slots the KV manager hands out (block * block_size + offset).

``TransferQueue`` moves rows between tiers off the compute thread: a CUDA stream on CUDA, one worker
thread on CPU. The worker runs torch's copies with one OpenMP thread: a worker using the process's
thread count starts a second OpenMP team, whose idle spinning measured 4-6x slower small ops on the
compute thread (2 cores). When the compute threads already take every core the process may run on, no
core is left for the worker to overlap with: the copies run inline, on the compute threads (2 cores, 2
threads, SmolLM2 bfloat16 decode at 8,000 tokens x 8 sequences: fetch-everything 310 -> 255 ms a step,
InfiniGen 240 -> 203 ms; the worker's handoffs cost ~1.6 ms a layer). Copies are queued in order, so a
fetch submitted after a store sees what was stored. A ``Transfer`` is waited on before its destination is
read; a staging buffer is written again only after the attention that read it has returned (see
``StagingBuffers``). Bytes moved each way are counted. A copy that raises becomes a ``KVTierError``: a
fetch raises it at ``wait``; a store, which nobody waits for, at the queue's next ``check``.
"""

from __future__ import annotations

import errno
import math
import os
import queue
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.errors import KVTierError
from kvserve.platform.faults import fault_point

KV_OFFLOAD_MODES = ("none", "host", "disk")


@dataclass(frozen=True)
class RowSpec:
    """One per-slot array of a tier: each (layer, slot) holds a ``shape`` row of ``dtype``."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


class KVTier:
    """Per-slot arrays of every layer, ``arrays[name]`` (layers, slots, *shape), in host memory or a file."""

    def __init__(
        self,
        kind: str,
        num_layers: int,
        num_slots: int,
        rows: dict[str, RowSpec],
        pin_memory: bool = False,
        path: str | os.PathLike | None = None,
    ) -> None:
        if kind not in ("host", "disk"):
            raise ValueError(f"a KV tier is 'host' or 'disk', got {kind!r}")
        self.kind = kind
        self.num_layers, self.num_slots, self.rows = num_layers, num_slots, rows
        self.arrays: dict[str, torch.Tensor] = {}
        for name, spec in rows.items():
            shape = (num_layers, num_slots, *spec.shape)
            if kind == "host":
                self.arrays[name] = torch.zeros(shape, dtype=spec.dtype, pin_memory=pin_memory)
            else:
                self.arrays[name] = _mapped_file(path, name, shape, spec.dtype)

    @property
    def nbytes(self) -> int:
        return sum(spec.row_bytes for spec in self.rows.values()) * self.num_layers * self.num_slots

    def slot_bytes(self, num_layers: int = 1) -> int:
        """Bytes one slot holds in ``num_layers`` layers (every array)."""
        return sum(spec.row_bytes for spec in self.rows.values()) * num_layers

    def copy_blocks(self, pairs: list[tuple[int, int]], block_size: int) -> None:
        """Copy whole blocks (src, dst) in every layer (copy-on-write of a forked sequence)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
        for array in self.arrays.values():
            blocks = array.view(self.num_layers, -1, block_size, *array.shape[2:])
            blocks.index_copy_(1, dst, blocks.index_select(1, src))

    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Copy single token slots (src, dst) in every layer (a Prompt Cache module's tail into a request)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
        for array in self.arrays.values():
            array.index_copy_(1, dst, array.index_select(1, src))


class TierStore(KVTier):
    """A tier of blocks, ``num_blocks`` of ``block_size`` slots in every layer, as every cache that offloads holds
    its KV (``OffloadedKVCache``; ``CompressedKVCache`` with ``kv_offload``): its arrays seen by slot, by (slot,
    KV head) or by block, the copies of forked blocks and imported slots, and the bytes a cache reads and writes
    in it directly (transfers through a ``TransferQueue`` count theirs there)."""

    def __init__(
        self,
        kind: str,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        rows: dict[str, RowSpec],
        pin_memory: bool = False,
        path: str | os.PathLike | None = None,
    ) -> None:
        super().__init__(kind, num_layers, num_blocks * block_size, rows, pin_memory, path)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.moved = {"fetched": 0, "stored": 0}

    def block_bytes(self) -> int:
        """Bytes of one block in every layer (every array)."""
        return self.slot_bytes(self.num_layers) * self.block_size

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        super().copy_blocks(pairs, self.block_size)

    def blocks(self, name: str) -> torch.Tensor:
        """Array ``name`` as (layers, blocks, block_size, *row)."""
        array = self.arrays[name]
        return array.view(self.num_layers, self.num_blocks, self.block_size, *array.shape[2:])

    def by_slot(self, name: str, layer: int) -> torch.Tensor:
        """``layer``'s rows of array ``name``, one per slot: (slots, row values)."""
        return self.arrays[name][layer].view(self.num_slots, -1)

    def by_head(self, name: str, layer: int) -> torch.Tensor:
        """``layer``'s rows of array ``name``, one per (slot, KV head), slot-major: (slots * Hkv, head values)."""
        array = self.arrays[name][layer]
        return array.view(self.num_slots * array.shape[1], -1)

    def by_block(self, name: str, layer: int) -> torch.Tensor:
        """``layer``'s rows of array ``name``, one per block: (blocks, block_size * row values)."""
        array = self.arrays[name][layer]
        return array.view(self.num_blocks, self.block_size * math.prod(array.shape[1:]))


def _mapped_file(path: str | os.PathLike | None, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled tensor backed by a new file in ``path`` (the system's temp dir if None), its space reserved."""
    folder = Path(path) if path is not None else Path(tempfile.gettempdir())
    if not folder.is_dir():
        raise ValueError(f"kv_offload_path {str(folder)!r} is not a directory")
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    try:
        fd, file = tempfile.mkstemp(prefix=f"kvserve-kv-{name}-", suffix=".bin", dir=folder)
    except OSError as exc:  # read-only file system, no write permission
        raise KVTierError(f"the disk tier cannot create its file in {str(folder)!r}: {_describe(exc)}") from None
    try:
        _reserve(fd, nbytes, folder)
        tensor = torch.from_file(file, shared=True, size=math.prod(shape), dtype=dtype)
    finally:
        os.close(fd)
        os.unlink(file)  # the mapping keeps the pages; the name goes now so nothing is left behind
    return tensor.view(shape)


def _reserve(fd: int, nbytes: int, folder: Path) -> None:
    """Allocate the file's blocks now: a sparse file would run out of disk at a page fault (SIGBUS), mid-run."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        free = f"; {_free_bytes(folder):,} bytes are free there" if exc.errno == errno.ENOSPC else ""
        raise KVTierError(
            f"the disk tier needs {nbytes:,} bytes in {str(folder)!r} (kv_offload_path) and could not reserve them: "
            f"{_describe(exc)}{free}"
        ) from None


def _free_bytes(folder: Path) -> int:
    stats = os.statvfs(folder)
    return stats.f_bavail * stats.f_frsize


def _describe(exc: OSError) -> str:
    code = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno is not None else type(exc).__name__
    return f"{exc.strerror or exc} ({code})"


def gather_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """out[i] = src[index[i]] for 2-D src/out (rows of equal width) and a 1-D long index."""
    if src.device == out.device:
        torch.index_select(src, 0, index.to(src.device), out=out)
    else:  # host tier -> CUDA: gather on the host, then one copy (it returns once the gathered rows are staged)
        out.copy_(src.index_select(0, index.to(src.device)), non_blocking=True)


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """dst[index[i]] = rows[i] for 2-D dst/rows and a 1-D long index without repeats. ``dst`` is a host or disk
    tier: CUDA rows come down with a blocking copy, since the CPU's index_copy_ reads them at once (after an
    asynchronous one it would read the buffer before the rows land)."""
    dst.index_copy_(0, index.to(dst.device), rows.to(dst.device))


class Transfer:
    """A queued copy; ``wait`` blocks until its destination may be read and returns the copy's result."""

    def __init__(self, future: Future | None = None, event: torch.cuda.Event | None = None, result=None) -> None:  # noqa: ANN001
        self._future, self._event, self._result = future, event, result

    def wait(self):  # noqa: ANN201 - whatever the copy returned
        if self._future is not None:
            return self._future.result()
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        return self._result


@dataclass
class TransferStats:
    bytes_fetched: int = 0  # slower tier -> device
    bytes_stored: int = 0  # device -> slower tier
    fetches: int = 0
    stores: int = 0


class TransferQueue:
    """Runs copies between tiers in order, off the compute thread (see the module doc)."""

    def __init__(
        self, device: torch.device | str = "cpu", inline: bool | None = None, fault: str | None = None
    ) -> None:
        """``inline`` (CPU): run each copy at submission instead of on the worker; None: when the compute
        threads take every core the process may use. ``fault``: the ``kvserve.platform.faults`` point each copy
        passes."""
        self.device = torch.device(device)
        self.fault = fault
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._failure: BaseException | None = None  # the first store that failed since the last check
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._worker = None
        if inline is None:
            inline = torch.get_num_threads() >= len(os.sched_getaffinity(0))
        self.inline = self._stream is None and inline
        if self._stream is None and not self.inline:
            threads = torch.get_num_threads()
            ready = threading.Event()
            self._worker = threading.Thread(target=self._serve, args=(ready,), name="kvserve-transfer", daemon=True)
            self._worker.start()
            ready.wait()
            torch.set_num_threads(threads)  # the worker set the process-wide count to 1 for itself; restore ours

    def _serve(self, ready: threading.Event) -> None:
        torch.get_num_threads()  # settle this thread's OpenMP setting first, so the next call sticks to it
        torch.set_num_threads(1)
        ready.set()
        while (job := self._jobs.get()) is not None:
            _run(*job)

    def fetch(self, copy: Callable[[], object], nbytes: int) -> Transfer:
        """Queue ``copy`` (slower tier -> device) of ``nbytes``."""
        with self._lock:
            self.stats.bytes_fetched += nbytes
            self.stats.fetches += 1
        return self._submit(self._at_fault_point(copy))

    def store(self, copy: Callable[[], object], nbytes: int) -> Transfer:
        """Queue ``copy`` (device -> slower tier) of ``nbytes``."""
        with self._lock:
            self.stats.bytes_stored += nbytes
            self.stats.stores += 1
        return self._submit(self._noting_failure(self._at_fault_point(copy)))

    def count(self, fetched: int = 0, stored: int = 0) -> None:
        """Count bytes a tier moved without this queue (the direct-I/O disk tier's own reads and writes)."""
        with self._lock:
            self.stats.bytes_fetched += fetched
            self.stats.fetches += bool(fetched)
            self.stats.bytes_stored += stored
            self.stats.stores += bool(stored)

    def _at_fault_point(self, copy: Callable[[], object]) -> Callable[[], object]:
        if self.fault is None:
            return copy
        point = self.fault

        def run() -> object:
            fault_point(point)
            return copy()

        return run

    def _noting_failure(self, copy: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            try:
                return copy()
            except BaseException as error:
                with self._lock:
                    self._failure = self._failure or error
                raise

        return run

    def check(self) -> None:
        """Raise the first store that failed since the last check, as a ``KVTierError`` (and forget it)."""
        with self._lock:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise _tier_error(failure)

    def drain(self) -> None:
        """After a failed step: let every queued copy finish, and forget the failures (the step is given up)."""
        self._submit(lambda: None).wait()
        if self._stream is not None:
            self._stream.synchronize()
        with self._lock:
            self._failure = None

    def _submit(self, copy: Callable[[], object]) -> Transfer:
        if self._stream is None:
            future: Future = Future()
            if self.inline:
                _run(copy, future)
            else:
                self._jobs.put((copy, future))
            return Transfer(future=future)
        self._stream.wait_stream(torch.cuda.current_stream())  # inputs the compute stream produced
        with torch.cuda.stream(self._stream):
            try:
                result = copy()
            except Exception as error:
                raise _tier_error(error) from error
            event = torch.cuda.Event()
            event.record(self._stream)
        return Transfer(event=event, result=result)

    def synchronize(self) -> None:
        """Wait for every queued copy."""
        self._submit(lambda: None).wait()
        if self._stream is not None:
            self._stream.synchronize()

    def close(self) -> None:
        if self._worker is not None and self._worker.is_alive():
            self._jobs.put(None)
            self._worker.join()


def _run(copy: Callable[[], object], future: Future) -> None:
    """Run a queued copy; its result or error goes to whoever waits on the transfer."""
    try:
        with torch.inference_mode():
            future.set_result(copy())
    except Exception as error:  # handed to whoever waits on the transfer
        future.set_exception(_tier_error(error))
    except BaseException as error:  # noqa: BLE001 - likewise
        future.set_exception(error)


def _tier_error(error: BaseException) -> KVTierError:
    if isinstance(error, KVTierError):
        return error
    wrapped = KVTierError(f"a KV tier transfer failed: {error!r}")
    wrapped.__cause__ = error
    return wrapped


class StagingBuffers:
    """Device buffers that fetched rows land in, two per array, alternating by layer.

    The fetch for layer i + 1 is queued while layer i still reads its own buffer, so consecutive layers
    must not share one. A buffer grows (is replaced) when a step needs more rows than it holds.
    """

    def __init__(self, rows: dict[str, RowSpec], device: torch.device | str) -> None:
        self.rows, self.device = rows, torch.device(device)
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}

    def get(self, name: str, layer: int, num_rows: int) -> torch.Tensor:
        """(num_rows, *row shape) view of layer parity ``layer % 2``'s buffer for ``name``."""
        key = (name, layer % 2)
        spec = self.rows[name]
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape[0] < num_rows:
            size = max(num_rows, 2 * buffer.shape[0] if buffer is not None else num_rows)
            buffer = torch.empty((size, *spec.shape), dtype=spec.dtype, device=self.device)
            self._buffers[key] = buffer
        return buffer[:num_rows]
