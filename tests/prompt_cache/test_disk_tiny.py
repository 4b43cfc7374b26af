"""Prompt Cache modules on disk (``prompt_cache_dir``), on a tiny random checkpoint (float32).

A fresh engine over the folder loads the modules an earlier one encoded (no encoding runs) and answers with the
same tokens; a corrupt, truncated, other model's or other dtype's file is encoded again and never used; a crashed
write's temporary file is ignored; ENOSPC and EIO on writes, EIO on reads and a read-only folder (real, or
injected where the tests run as root) leave the module served from memory or encoded, and the engine serving.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.models import LoadedModel, load_model
from kvserve.platform.faults import faults
from kvserve.prompt_cache import disk
from kvserve.prompt_cache.disk import ModuleFiles
from tests.prompt_cache.test_engine_tiny import GREEDY, MULTI, SCHEMA, SPEC, make_engine, run
from tests.tiny_models import torch_single_thread, write_tiny_model  # noqa: F401

NUM_MODULES = 5  # SCHEMA's own text, doc, hello, greet, inner
OTHER = '<schema name="other"><module name="m">seven eight nine ten</module></schema>'


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> LoadedModel:
    return load_model(write_tiny_model(tmp_path_factory.mktemp("disk"), SPEC))


@pytest.fixture(scope="module")
def encoded(loaded, tmp_path_factory) -> tuple[Path, list[int]]:
    """A folder an engine wrote SCHEMA's modules to, and that engine's greedy tokens for MULTI."""
    folder = tmp_path_factory.mktemp("modules")
    engine = make_engine(loaded, prompt_cache_dir=str(folder))
    engine.register_schema(SCHEMA)
    (out,) = run(engine, [MULTI])
    engine.close()
    assert engine.prompt_cache.store.files.stats.writes == NUM_MODULES
    return folder, out.outputs[0].token_ids


@pytest.fixture
def folder(encoded, tmp_path) -> Path:
    """A copy of the encoded folder for one test to damage."""
    return Path(shutil.copytree(encoded[0], tmp_path / "modules"))


@pytest.fixture
def warnings_logged():
    """The kvserve logger's warnings during the test."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("kvserve")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def module_files(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"*{disk.SUFFIX}"))


def answer(engine: LLMEngine) -> list[int]:
    engine.register_schema(SCHEMA)
    (out,) = run(engine, [MULTI])
    return out.outputs[0].token_ids


@pytest.mark.parametrize(("tier", "encode"), [("device", "eager"), ("host", "eager"), ("device", "lazy")])
def test_a_fresh_engine_loads_the_modules_and_answers_the_same(loaded, encoded, folder, tier, encode):
    engine = make_engine(loaded, prompt_cache_dir=str(folder), prompt_cache_tier=tier, prompt_cache_encode=encode)
    assert answer(engine) == encoded[1]
    store = engine.prompt_cache.store
    assert store.stats.encoded_modules == 0 and store.stats.encoded_tokens == 0
    assert store.files.stats.loads == (NUM_MODULES if encode == "eager" else NUM_MODULES - 1)  # lazy: not hello
    engine.close()
    assert store.files.stats.writes == 0  # loaded modules are not written again


def test_an_evicted_module_is_loaded_again_not_encoded(loaded, folder):
    engine = make_engine(loaded, prompt_cache_dir=str(folder))
    answer(engine)
    engine.prompt_cache.store.remove(("shop", "doc"))  # as an eviction does
    run(engine, [MULTI])
    assert engine.prompt_cache.store.stats.encoded_modules == 0
    assert engine.prompt_cache.store.files.stats.loads == NUM_MODULES + 1


def _flip_a_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x5A
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _rewrite_fingerprint(path: Path, change) -> None:
    """The same module's tensors under a header from another engine (the name kept: as if copied over)."""
    import safetensors.torch

    data = path.read_bytes()
    meta = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    fingerprint = json.loads(meta["fingerprint"])
    tensors = safetensors.torch.load(data)
    tensors = change(fingerprint, tensors)
    other = ModuleFiles(path.parent, fingerprint)
    meta = {**meta, "fingerprint": other.fingerprint, "sha256": disk.checksum(tensors["k"], tensors["v"])}
    path.write_bytes(safetensors.torch.save(tensors, metadata=meta))


def _other_model(fingerprint, tensors):
    fingerprint["files"][0][1] += 1  # another size of a weights file
    return tensors


def _other_dtype(fingerprint, tensors):
    fingerprint["dtype"] = fingerprint["kv"]["dtype"] = "bfloat16"
    return {name: t.to(dtype=__import__("torch").bfloat16) for name, t in tensors.items()}


@pytest.mark.parametrize(
    "damage",
    [_flip_a_payload_byte, _truncate, lambda p: p.write_bytes(b""), lambda p: _rewrite_fingerprint(p, _other_model),
     lambda p: _rewrite_fingerprint(p, _other_dtype)],
    ids=["corrupt", "truncated", "empty", "other-model", "other-dtype"],
)  # fmt: skip
def test_a_damaged_or_foreign_file_is_encoded_again_and_replaced(loaded, encoded, folder, damage, warnings_logged):
    for path in module_files(folder):
        damage(path)
    engine = make_engine(loaded, prompt_cache_dir=str(folder))
    assert answer(engine) == encoded[1]
    store = engine.prompt_cache.store
    assert store.stats.encoded_modules == NUM_MODULES and store.files.stats.rejected == NUM_MODULES
    assert store.files.stats.loads == 0
    assert any("not using" in r.getMessage() for r in warnings_logged)
    engine.close()
    assert store.files.stats.writes == NUM_MODULES  # replaced with good files: the next engine loads them
    again = make_engine(loaded, prompt_cache_dir=str(folder))
    assert answer(again) == encoded[1] and again.prompt_cache.store.stats.encoded_modules == 0


def test_a_crashed_writes_temporary_file_is_ignored_and_old_ones_removed(loaded, encoded, folder):
    path = module_files(folder)[0]
    fresh = folder / f".{path.name}.999.dead.tmp"
    fresh.write_bytes(path.read_bytes()[:100])  # a write cut by a crash: the previous version is still there
    stale = folder / f".{path.name}.998.beef.tmp"
    stale.write_bytes(b"x")
    old = time.time() - 2 * disk.STALE_TEMP_SECONDS
    os.utime(stale, (old, old))
    engine = make_engine(loaded, prompt_cache_dir=str(folder))
    assert answer(engine) == encoded[1] and engine.prompt_cache.store.stats.encoded_modules == 0
    assert fresh.exists() and not stale.exists()  # a recent one may be a live writer's


class _FailingFile:
    """A file whose writes stop half way with ``error`` (a disk filling up, an I/O error)."""

    def __init__(self, f, error: int) -> None:
        self.f, self.error = f, error

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()

    def write(self, data: bytes) -> int:
        self.f.write(data[: len(data) // 2])
        raise OSError(self.error, os.strerror(self.error))

    def __getattr__(self, name):
        return getattr(self.f, name)


def _inject(monkeypatch, error: int, on: str) -> None:
    """Make the module writer's (``on="write"``, ``"replace"``) or reader's (``"read"``) file calls fail."""
    real_open = open

    def failing_open(path, mode="r", *args, **kwargs):
        is_module_temp = str(path).endswith(".tmp") and ".probe." not in str(path)
        if on == "read" and "r" in mode:
            raise OSError(error, os.strerror(error), str(path))
        if on == "write" and "w" in mode and is_module_temp:
            return _FailingFile(real_open(path, mode, *args, **kwargs), error)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(disk, "open", failing_open, raising=False)
    if on == "replace":

        def failing_replace(src, dst):
            raise OSError(error, os.strerror(error), str(dst))

        monkeypatch.setattr(disk.os, "replace", failing_replace)


@pytest.mark.parametrize(("error", "on"), [(errno.ENOSPC, "write"), (errno.EIO, "write"), (errno.EIO, "replace")])
def test_a_failed_write_is_logged_once_and_the_module_is_served_from_memory(
    loaded, encoded, tmp_path, monkeypatch, warnings_logged, error, on
):
    folder = tmp_path / "modules"
    _inject(monkeypatch, error, on)
    engine = make_engine(loaded, prompt_cache_dir=str(folder))
    assert answer(engine) == encoded[1]
    engine.prompt_cache.store.files.flush()
    assert answer(engine) == encoded[1]  # served from memory, encoded once
    assert engine.prompt_cache.store.stats.encoded_modules == NUM_MODULES
    assert engine.prompt_cache.store.files.stats.write_errors == NUM_MODULES
    assert list(folder.iterdir()) == []  # no module file, no temporary file left
    failures = [r for r in warnings_logged if errno.errorcode[error] in r.getMessage()]
    assert len(failures) == 1 and "stays in memory" in failures[0].getMessage()
    engine.close()


def test_a_failed_read_is_a_miss_and_the_module_is_encoded(loaded, encoded, folder, monkeypatch, warnings_logged):
    _inject(monkeypatch, errno.EIO, "read")
    engine = make_engine(loaded, prompt_cache_dir=str(folder))
    assert answer(engine) == encoded[1]
    store = engine.prompt_cache.store
    assert store.stats.encoded_modules == NUM_MODULES and store.files.stats.read_errors == NUM_MODULES
    assert len([r for r in warnings_logged if "EIO" in r.getMessage()]) == 1
    engine.close()


def test_a_read_only_folder_is_loaded_from_and_never_written(loaded, encoded, folder, monkeypatch, warnings_logged):
    if os.geteuid() == 0:  # root writes through a mode of 555: make the folder refuse writes instead
        real_open = open

        def read_only_open(path, mode="r", *args, **kwargs):
            if "w" in mode:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real_open(path, mode, *args, **kwargs)

        monkeypatch.setattr(disk, "open", read_only_open, raising=False)
    before = sorted(p.name for p in folder.iterdir())
    folder.chmod(0o555)
    try:
        engine = make_engine(loaded, prompt_cache_dir=str(folder))
        assert not engine.prompt_cache.store.files.writable
        assert any("takes no writes" in r.getMessage() for r in warnings_logged)
        assert answer(engine) == encoded[1] and engine.prompt_cache.store.stats.encoded_modules == 0
        engine.register_schema(OTHER)  # a new module: encoded, served from memory
        (out,) = run(engine, ['<prompt schema="other"><m/> and then</prompt>'])
        assert out.num_cached_tokens > 0 and engine.prompt_cache.store.stats.encoded_modules == 2
        engine.close()
    finally:
        folder.chmod(0o755)
    assert sorted(p.name for p in folder.iterdir()) == before


def test_a_folder_is_created_and_one_that_cannot_be_is_an_error_at_start(loaded, tmp_path):
    nested = tmp_path / "a" / "b"
    make_engine(loaded, prompt_cache_dir=str(nested)).close()
    assert nested.is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="prompt_cache_dir .*file/modules.* cannot be created"):
        make_engine(loaded, prompt_cache_dir=str(tmp_path / "file" / "modules"))


def test_configurations_whose_modules_cannot_be_saved_are_refused(tmp_path):
    with pytest.raises(ValueError, match="prompt_cache_dir .* kv_offload='none'"):
        EngineConfig(prompt_cache_dir=str(tmp_path), kv_offload="host")
    with pytest.raises(ValueError, match="prompt_cache_dir: a compressing kv_policy"):
        EngineConfig(prompt_cache_dir=str(tmp_path), kv_policy="snapkv")


def test_the_engine_keeps_serving_other_requests_while_writes_fail(loaded, encoded, tmp_path, monkeypatch):
    _inject(monkeypatch, errno.ENOSPC, "write")
    engine = make_engine(loaded, prompt_cache_dir=str(tmp_path / "modules"))
    engine.register_schema(SCHEMA)
    plain, cached = run(engine, ["the cat sat on the", MULTI])
    assert len(plain.outputs[0].token_ids) == GREEDY.max_tokens and cached.outputs[0].token_ids == encoded[1]
    engine.close()


def test_the_named_fault_points_fail_writes_and_reads_as_a_disk_would(loaded, encoded, folder, tmp_path):
    """KVSERVE_FAULTS's module-dir points (the chaos soak arms them): a write that fills the disk half-way leaves
    no file, a read that fails is a miss; both answer as the encoding engine did."""
    with faults({"module-dir-write": (1.0, errno.ENOSPC)}) as injected:
        engine = make_engine(loaded, prompt_cache_dir=str(tmp_path / "fresh"))
        assert answer(engine) == encoded[1]
        engine.close()
    assert injected["module-dir-write"] == NUM_MODULES and list((tmp_path / "fresh").iterdir()) == []
    with faults({"module-dir-read": 1.0}) as injected:
        engine = make_engine(loaded, prompt_cache_dir=str(folder))
        assert answer(engine) == encoded[1]
        store = engine.prompt_cache.store
        assert store.files.stats.read_errors == NUM_MODULES and store.stats.encoded_modules == NUM_MODULES
        engine.close()
    assert injected["module-dir-read"] == NUM_MODULES


def test_int8_modules_are_saved_as_their_rows_and_used_only_by_an_int8_engine(loaded, tmp_path):
    """An int8 cache's modules go to disk as their byte rows; a restarted int8 engine loads them and answers the
    same, and engines of another KV dtype (their own fingerprint) encode instead of reading them."""
    folder = tmp_path / "modules"
    first = make_engine(loaded, prompt_cache_dir=str(folder), kv_cache_dtype="int8")
    expected = answer(first)
    first.close()
    assert first.prompt_cache.store.files.stats.writes == NUM_MODULES
    restarted = make_engine(loaded, prompt_cache_dir=str(folder), kv_cache_dtype="int8")
    assert answer(restarted) == expected
    store = restarted.prompt_cache.store
    assert store.stats.encoded_modules == 0 and store.files.stats.loads == NUM_MODULES
    restarted.close()
    for other in ("int4", "auto"):
        engine = make_engine(loaded, prompt_cache_dir=str(folder), kv_cache_dtype=other)
        answer(engine)
        assert engine.prompt_cache.store.files.stats.loads == 0
        assert engine.prompt_cache.store.stats.encoded_modules == NUM_MODULES
        engine.close()
