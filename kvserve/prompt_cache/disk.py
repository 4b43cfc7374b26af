"""Prompt Cache modules on disk (``prompt_cache_dir``): a restarted engine loads a module's KV instead of encoding it.

One safetensors file per module: its keys and values, (L, n, Hkv, D) each, and a header naming what they were
computed from: the module (a digest of its key, tokens, positions and context), the model's fingerprint (its weight
files, dtype, weights mode, numerics switches, device) and the KV layout (layers, KV heads, head dim, KV dtype),
and a sha256 of the tensors. The file's name hashes the module and the fingerprint, so engines of different models
can share a folder without meeting each other's files. A file is used only when its header names this module and
this engine, its tensors have the shapes and dtype expected and its checksum matches them; anything else (corrupt,
truncated, another model's or dtype's) is a miss: the module is encoded again and the file replaced. Stored per
token, not per block, so the block size is no part of the fingerprint.

A write goes to a temporary file in the folder, is fsynced, then renamed onto the name (``os.replace``): a crash
leaves the previous version (or none) and a temporary file that is never read. Writes run on a thread of their own
after an encoding finishes, so the engine's steps do not wait for the disk. A failed write (ENOSPC, EIO, a read-only
folder) is logged once per kind of error and the module stays served from memory; a failed read is a miss.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import safetensors.torch
import torch

from kvserve.attention.kv_quant import KVQuant
from kvserve.log import get_logger
from kvserve.models.dtype import DTYPE_NAMES
from kvserve.platform.faults import fault_point

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.models.loader import LoadedModel
    from kvserve.prompt_cache.cached_module import CachedModule

FORMAT = "kvserve-prompt-cache-module/1"
SUFFIX = ".module.safetensors"
STALE_TEMP_SECONDS = 3600  # a write takes seconds: a temporary file this old is a crashed writer's
_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".json")


@dataclass
class DiskStats:
    loads: int = 0  # modules loaded instead of encoded
    writes: int = 0  # module files written
    write_errors: int = 0  # writes that failed (the module stays in memory)
    read_errors: int = 0  # reads that failed (the module is encoded)
    rejected: int = 0  # files found but not used: corrupt, truncated, another model's


def model_fingerprint(loaded: LoadedModel, config: EngineConfig) -> dict[str, object]:
    """What a module's keys and values depend on besides its tokens: the weights (each file's name, size and
    modification time), how they run, and the KV cache's layout and dtype."""
    path = Path(loaded.path).resolve()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
    cfg = loaded.config
    # A quantized cache's module is its byte rows (codes and scales), as the cache holds them.
    row = KVQuant(config.kv_quant, cfg.head_dim).row_bytes if config.kv_quant is not None else cfg.head_dim
    kv_dtype = "uint8" if config.kv_quant is not None else DTYPE_NAMES[config.kv_dtype(loaded.dtype)]
    return {
        "model": str(path),
        "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files],
        "dtype": DTYPE_NAMES[loaded.dtype],
        "weights": loaded.weights,
        "batch_invariant": loaded.batch_invariant,
        "int8_activations": loaded.int8_activations,
        "device": torch.device(config.device).type,
        "kv": {
            "layers": cfg.num_layers,
            "kv_heads": cfg.num_kv_heads,
            "head_dim": row,
            "dtype": kv_dtype,
            **({"rows": config.kv_quant} if config.kv_quant is not None else {}),
        },
    }


class ModuleFiles:
    """The module files of one folder for one engine (``fingerprint``: ``model_fingerprint``)."""

    def __init__(self, folder: str | Path, fingerprint: dict[str, object]) -> None:
        self.folder = Path(folder).expanduser()
        self.fingerprint = json.dumps(fingerprint, sort_keys=True)
        kv = fingerprint["kv"]
        self.layout = (kv["layers"], kv["kv_heads"], kv["head_dim"])
        self.dtype = getattr(torch, kv["dtype"])
        self.stats = DiskStats()
        self._warned: set[tuple[str, int | None]] = set()
        self._lock = threading.Lock()
        self.writable = self._open_folder()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvserve-prompt-cache-dir") if self.writable else None
        self._pending: list[Future] = []

    def _open_folder(self) -> bool:
        """Create the folder if missing (an error if it cannot be); whether it takes writes. A folder that does not
        is a warning, not an error: modules encoded ahead of time on a read-only volume are still loaded."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"prompt_cache_dir {str(self.folder)!r} cannot be created: {exc.strerror}") from None
        if not self.folder.is_dir():
            raise ValueError(f"prompt_cache_dir {str(self.folder)!r} is not a folder")
        probe = self.folder / f".probe.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            with open(probe, "wb") as f:
                f.write(b"kvserve")
            os.unlink(probe)
        except OSError as exc:
            get_logger().warning(
                "prompt_cache_dir %s takes no writes (%s): modules found there are loaded, new ones are encoded "
                "and kept in memory only", self.folder, exc.strerror or exc,
            )  # fmt: skip
            return False
        self._remove_stale_temps()
        return True

    def _remove_stale_temps(self) -> None:
        """Temporary files that crashed writers left (never read; a live writer's are recent)."""
        now = time.time()
        for temp in self.folder.glob(".*.tmp"):
            try:
                if now - temp.stat().st_mtime > STALE_TEMP_SECONDS:
                    temp.unlink()
            except OSError:
                pass

    def path(self, module: CachedModule) -> Path:
        name = hashlib.sha256(f"{module_digest(module)}\n{self.fingerprint}".encode()).hexdigest()[:40]
        return self.folder / f"{name}{SUFFIX}"

    # ----- reading -----

    def load(self, module: CachedModule) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The module's (keys, values) from its file, or None: no file, a failed read, or a file not to use."""
        path = self.path(module)
        try:
            with open(path, "rb") as f:
                fault_point("module-dir-read", str(path))
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self.stats.read_errors += 1
            self._warn_once("read", exc, f"cannot read {path} ({exc.strerror or exc}): the module is encoded instead")
            return None
        try:
            kv = self._parse(data, module)
        except _Unusable as why:
            self.stats.rejected += 1
            get_logger().warning("prompt cache: not using %s: %s; the module is encoded again", path, why)
            return None
        self.stats.loads += 1
        return kv

    def _parse(self, data: bytes, module: CachedModule) -> tuple[torch.Tensor, torch.Tensor]:
        if len(data) < 8:
            raise _Unusable("truncated (no header)")
        size = int.from_bytes(data[:8], "little")
        if 8 + size > len(data):
            raise _Unusable("truncated (header cut)")
        try:
            meta = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
        except (ValueError, AttributeError):
            raise _Unusable("corrupt header") from None
        if meta.get("format") != FORMAT:
            raise _Unusable(f"not a {FORMAT} file")
        if meta.get("fingerprint") != self.fingerprint:
            raise _Unusable(f"written by another model or configuration ({_differences(meta, self.fingerprint)})")
        if meta.get("module") != module_digest(module):
            raise _Unusable("another module's file")
        try:
            tensors = safetensors.torch.load(data)
        except Exception as exc:  # safetensors' own error for a cut or garbled payload
            raise _Unusable(f"corrupt or truncated tensors ({exc})") from None
        k, v = tensors.get("k"), tensors.get("v")
        shape = (self.layout[0], module.num_tokens, *self.layout[1:])
        for t in (k, v):
            if t is None or tuple(t.shape) != shape or t.dtype != self.dtype:
                raise _Unusable(f"tensors are not {shape} {str(self.dtype).removeprefix('torch.')}")
        if checksum(k, v) != meta.get("sha256"):
            raise _Unusable("checksum mismatch (corrupt)")
        return k, v

    # ----- writing -----

    def save(self, module: CachedModule, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the module's (L, n, Hkv, D) keys and values (CPU tensors nothing else writes to) in the background."""
        if self._writer is None:
            return
        future = self._writer.submit(self._write, self.path(module), module_digest(module), k, v)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [future]

    def _write(self, path: Path, digest: str, k: torch.Tensor, v: torch.Tensor) -> None:
        temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            meta = {"format": FORMAT, "fingerprint": self.fingerprint, "module": digest, "sha256": checksum(k, v)}
            data = safetensors.torch.save({"k": k.contiguous(), "v": v.contiguous()}, metadata=meta)
            with open(temp, "wb") as f:
                f.write(data)
                fault_point("module-dir-write", str(temp))  # as a disk that fills up after the first bytes
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, path)
        except Exception as exc:  # OSError above all (ENOSPC, EIO, EROFS); nothing a write raises stops the engine
            self.stats.write_errors += 1
            exc = exc if isinstance(exc, OSError) else OSError(None, repr(exc))
            self._warn_once(
                "write", exc, f"cannot write {path} ({exc.strerror or exc}): the module stays in memory only and "
                "is encoded again after a restart",
            )  # fmt: skip
            try:
                os.unlink(temp)
            except OSError:
                pass
            return
        _sync_folder(self.folder)
        self.stats.writes += 1

    def flush(self) -> None:
        """Wait for the writes queued so far."""
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        """Finish the queued writes (a closed engine's modules are on disk); idempotent."""
        if self._writer is not None:
            self.flush()
            self._writer.shutdown(wait=True)
            self._writer = None

    def _warn_once(self, action: str, exc: OSError, message: str) -> None:
        """One log line per kind of failure (ENOSPC, EIO, ...): a full disk is not reported at every module."""
        kind = (action, exc.errno)
        if kind not in self._warned:
            self._warned.add(kind)
            name = errno.errorcode.get(exc.errno, "") if exc.errno else ""
            get_logger().warning("prompt cache: %s%s", f"{name}: " if name else "", message)


class _Unusable(Exception):
    """Why a module file is not used."""


def module_digest(module: CachedModule) -> str:
    """The module's identity: its key as the store has it, its tokens and positions, and its context."""
    ident = (module.key, module.token_ids, module.positions, module.context_ids, module.context_positions)
    return hashlib.sha256(repr(ident).encode()).hexdigest()


def checksum(k: torch.Tensor, v: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for t in (k, v):
        digest.update(t.contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


def _differences(meta: dict, fingerprint: str) -> str:
    """The fingerprint fields that differ, for the log line."""
    try:
        theirs, ours = json.loads(meta.get("fingerprint", "{}")), json.loads(fingerprint)
    except ValueError:
        return "unreadable fingerprint"
    fields = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    return "differs in " + ", ".join(fields) if fields else "fingerprint differs"


def _sync_folder(folder: Path) -> None:
    """Make the rename itself durable (best effort: not every platform opens folders)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
