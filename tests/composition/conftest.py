"""A tiny random Llama (GQA, head dim 64 for INT4's groups) saved to a folder that worker processes can load,
and the helpers every composition test shares."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.core.outputs import RequestOutput
from kvserve.models import LoadedModel, load_model
from kvserve.policies.skewing import SKEWING_DIR_ENV
from kvserve.sampling.sampling_params import SamplingParams
from tests.tiny_models import TinySpec, write_tiny_model

SPEC = TinySpec(num_heads=4, num_kv_heads=2, num_layers=4, head_dim=64, max_position_embeddings=512, seed=23)
BLOCK = 4
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

SCHEMA = """<schema name="shop">
  the cat sat on the mat and then it
  <module name="doc">one two three four five six seven eight nine ten eleven twelve</module>
  <module name="notes">red green blue yellow and a long list of other colours</module>
</schema>"""
PML = '<prompt schema="shop"><doc/><notes/> so what comes next in the list</prompt>'


@pytest.fixture(scope="session", autouse=True)
def skewing_dir(tmp_path_factory):
    """InfiniGen's skewing is computed into a temporary folder, never the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SKEWING_DIR_ENV, str(tmp_path_factory.mktemp("skewing")))
        yield


@pytest.fixture(scope="session")
def folder(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("composition") / "model", SPEC)


@pytest.fixture(scope="session")
def loaded(folder) -> LoadedModel:
    return load_model(folder, torch.float32)


def make_engine(loaded: LoadedModel, **options) -> LLMEngine:
    options = {"dtype": "float32", "kv_cache_memory": "4MiB", "swap_space": 2**20, "block_size": BLOCK, **options}
    return LLMEngine(EngineConfig(model=str(loaded.path), **options), loaded=loaded)


def run(engine: LLMEngine, prompts: list, params: SamplingParams = GREEDY) -> list[RequestOutput]:
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [done[i] for i in ids]


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]
