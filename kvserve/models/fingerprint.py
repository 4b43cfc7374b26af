"""A model's identity for reports: the sha256 of its weight files, so results name exactly what ran."""

from __future__ import annotations

import hashlib
from pathlib import Path


def model_fingerprint(path: Path) -> dict[str, object]:
    """``{"path", "sha256", "bytes"}`` of a GGUF file, or of a folder's config, tokenizer and safetensors."""
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix == ".safetensors" or p.name in ("config.json", "tokenizer.json")
    )  # fmt: skip
    digest, size = hashlib.sha256(), 0
    for file in files:
        with file.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
                size += len(chunk)
    return {"path": str(path), "sha256": digest.hexdigest(), "bytes": size}
