"""Prompt Cache modules on disk with the real default model (SmolLM2-135M-Instruct, float32): a fresh engine over
the folder loads the document module instead of encoding it and gives the same greedy tokens as the engine that
encoded it."""

from __future__ import annotations

import pytest

from kvserve import SamplingParams
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.eval.data import AUSTEN

pytestmark = pytest.mark.real_model

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def answer(default_model, folder, passage: str) -> tuple[LLMEngine, list[int]]:
    config = EngineConfig(dtype="float32", kv_cache_memory="64MiB", swap_space=0, prompt_cache_dir=str(folder))
    engine = LLMEngine(config, default_model)
    engine.register_schema(
        f'<schema name="book"><system>Be brief.</system><module name="doc">{passage}</module></schema>'
    )
    engine.add_request('<prompt schema="book"><doc/><user>Who is Emma?</user></prompt>', GREEDY)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    engine.close()
    return engine, outputs[-1].outputs[0].token_ids


def test_a_restarted_engine_loads_the_module_and_answers_the_same(default_model, tmp_path):
    text = AUSTEN.read_text(encoding="utf-8")
    start = text.index("Emma Woodhouse, handsome, clever, and rich")
    passage = text[start : start + 1500].replace("&", "and").replace("<", "(")
    first, expected = answer(default_model, tmp_path, passage)
    assert first.prompt_cache.store.stats.encoded_tokens > 250 and first.prompt_cache.store.files.stats.writes == 2
    restarted, tokens = answer(default_model, tmp_path, passage)
    assert restarted.prompt_cache.store.stats.encoded_modules == 0
    assert restarted.prompt_cache.store.files.stats.loads == 2
    assert tokens == expected
