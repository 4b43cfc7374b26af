"""Hugging Face model names (``HuggingFaceTB/SmolLM2-135M-Instruct``) found in the local Hugging Face cache.

Offline only: kvserve never downloads. The cache is ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub`` (as huggingface_hub places it); a model is ``models--ORG--NAME/snapshots/REV`` with
``REV`` read from ``refs/main``. huggingface_hub's own offline lookup runs when it is installed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvserve.errors import ModelLoadError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_repo_id(name: str) -> bool:
    """``org/name``, as Hugging Face spells a model (a relative path of two parts looks the same)."""
    return bool(_REPO_ID.match(name)) and ".." not in name


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps downloaded models, read from the environment at each call."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def cached_snapshot(repo_id: str, cache: Path) -> Path | None:
    """The snapshot folder of ``repo_id``'s main revision in ``cache``, or None when it is not there."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        return _snapshot_from_refs(repo_id, cache)
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError):  # not cached; ValueError: a name the hub would refuse
        return None


def _snapshot_from_refs(repo_id: str, cache: Path) -> Path | None:
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    try:
        revision = (repo / "refs" / "main").read_text().strip()
    except OSError:
        return None
    snapshot = repo / "snapshots" / revision
    return snapshot if snapshot.is_dir() else None


def model_in_snapshot(snapshot: Path, repo_id: str) -> Path:
    """The folder itself (config.json + safetensors) or its only .gguf file."""
    if (snapshot / "config.json").is_file():
        return snapshot
    ggufs = sorted(snapshot.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise ModelLoadError(f"{repo_id} holds {len(ggufs)} GGUF files ({names}): pass one as --model {snapshot}/FILE")
    raise ModelLoadError(f"{repo_id} in the Hugging Face cache ({snapshot}) has neither config.json nor a .gguf file")


def resolve_repo_id(repo_id: str) -> Path | None:
    """The model to load for a Hugging Face name, or None when the cache does not hold it."""
    snapshot = cached_snapshot(repo_id, hub_cache_dir())
    return None if snapshot is None else model_in_snapshot(snapshot, repo_id)


def not_found_error(name: str) -> ModelLoadError:
    cache = hub_cache_dir()
    return ModelLoadError(
        f"model {name!r} is neither a file or folder ({Path(name).expanduser().absolute()} does not exist) nor in "
        f"the Hugging Face cache ({cache / ('models--' + name.replace('/', '--'))}, set by HF_HUB_CACHE or HF_HOME); "
        f"kvserve does not download: fetch it with `hf download {name}` (huggingface_hub) and run again, "
        "or pass a local path"
    )
