"""``LLM.generate`` with vLLM's prompt dicts (``{"prompt": ...}``, ``{"prompt_token_ids": [...]}``), single or in
a list, on a tiny checkpoint and on the default model; bad dicts are ValueErrors naming the keys."""

from __future__ import annotations

import pytest

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.entrypoints.llm import LLM
from kvserve.sampling.sampling_params import SamplingParams
from tests.tiny_models import TinySpec, torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixture

GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("prompts"), TinySpec(seed=3))
    with LLM(str(folder), dtype="float32", kv_cache_memory="1MiB", swap_space=0) as llm:
        yield llm


def _tokens(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def test_prompt_dicts_give_what_text_and_token_ids_give(tiny_llm):
    text, other = "the cat sat on the mat", "hello world"
    ids = tiny_llm.get_tokenizer().encode(other)
    plain = _tokens(tiny_llm.generate([text, ids], GREEDY, use_tqdm=False))
    single_text = tiny_llm.generate({"prompt": text}, GREEDY, use_tqdm=False)
    single_ids = tiny_llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    mixed = tiny_llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert _tokens(single_text) + _tokens(single_ids) == plain
    assert _tokens(mixed) == plain
    assert mixed[1].prompt_token_ids == ids


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ({}, "prompt 0 has neither of ['prompt', 'prompt_token_ids']"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "prompt 0 has both of ['prompt', 'prompt_token_ids']"),
        ({"prompt": "a", "multi_modal_data": {}, "x": 1}, "prompt 0 has unknown keys ['multi_modal_data', 'x']"),
        ({"text": "a"}, "prompt 0 has unknown keys ['text']"),
        ({"prompt": 5}, "prompt 0: 'prompt' must be text, got int"),
        ({"prompt_token_ids": "abc"}, "prompt 0: token ids must be a list of integers, got str"),
        ({"prompt_token_ids": [1, "2"]}, "prompt 0: token ids must be integers, got ['2']"),
    ],
)
def test_a_bad_prompt_dict_is_a_value_error_naming_it(tiny_llm, prompt, message):
    with pytest.raises(ValueError) as info:
        tiny_llm.generate(prompt, GREEDY, use_tqdm=False)
    assert message in str(info.value)
    with pytest.raises(ValueError) as info:  # in a list, the message names which prompt
        tiny_llm.generate([{"prompt": "a"}, prompt], GREEDY, use_tqdm=False)
    assert message.replace("prompt 0", "prompt 1") in str(info.value)


@pytest.mark.real_model
def test_prompt_dicts_on_the_default_model(default_model):
    config = EngineConfig(dtype="float32", kv_cache_memory="32MiB", swap_space=0)
    llm = LLM.from_engine(LLMEngine(config, default_model))
    text = "The capital of France is"
    ids = default_model.tokenizer.encode(text)
    by_text = llm.generate(text, GREEDY, use_tqdm=False)[0]
    by_dicts = llm.generate([{"prompt_token_ids": ids}, {"prompt": text}], GREEDY, use_tqdm=False)
    assert [out.outputs[0].text for out in by_dicts] == [by_text.outputs[0].text] * 2
    assert "Paris" in by_text.outputs[0].text
    llm.close()
