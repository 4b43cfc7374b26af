"""The Prompt Cache examples in examples/prompt_cache: every schema parses, every listed prompt is valid
for its schema, and on the real model one prompt per schema runs with its modules' KV reused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve import SamplingParams
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.entrypoints.llm import LLM
from kvserve.prompt_cache.pml import check_prompt, parse_prompt, parse_schema

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "prompt_cache"
PROMPTS: dict[str, list[str]] = json.loads((EXAMPLES / "prompts.json").read_text(encoding="utf-8"))


def _schema_text(file_name: str) -> str:
    return (EXAMPLES / file_name).read_text(encoding="utf-8")


def test_every_example_schema_has_prompts():
    assert sorted(PROMPTS) == sorted(p.name for p in EXAMPLES.glob("*.xml"))
    assert all(PROMPTS.values())


@pytest.mark.parametrize("file_name", sorted(PROMPTS))
def test_example_schema_parses_and_its_prompts_check(file_name):
    schema = parse_schema(_schema_text(file_name))
    assert schema.modules()
    for prompt in PROMPTS[file_name]:
        parsed = parse_prompt(prompt)
        check_prompt(parsed, schema)
        assert parsed.schema == schema.name


@pytest.mark.real_model
def test_examples_run_on_the_default_model_reusing_module_kv(default_model):
    # Device-tier modules may take half the pool; the three schemas' ~1,400 module tokens need ~70 MiB in float32.
    engine = LLMEngine(EngineConfig(dtype="float32", kv_cache_memory="192MiB", swap_space=0), loaded=default_model)
    llm = LLM.from_engine(engine)
    for file_name in PROMPTS:
        info = llm.register_schema(_schema_text(file_name))
        assert all(module["cached"] for module in info["modules"].values() if module["tokens"])
    prompts = [listed[0] for listed in PROMPTS.values()]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert len(output.outputs[0].token_ids) == 4, prompt
        assert 0 < output.num_cached_tokens < len(output.prompt_token_ids), prompt
