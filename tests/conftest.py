"""Shared fixtures: the real default model (ours and Hugging Face's), loaded once per session."""

from __future__ import annotations

import pytest
import torch

from kvserve.models import LoadedModel, default_model_path, load_model


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    return load_model(dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers' own GGUF loader on the same file, dequantised to float32."""
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_default_tokenizer():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
