"""Guided decoding on the default model (SmolLM2-135M-Instruct): a JSON-schema request whose output parses and
validates, with the model's own tokenizer as xgrammar sees it (byte-level BPE, special tokens kept out)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.sampling.sampling_params import SamplingParams
from kvserve.structured import GuidedDecodingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "role": {"enum": ["engineer", "teacher", "doctor"]},
    },
    "required": ["name", "age", "languages", "role"],
}


@pytest.mark.real_model
def test_a_json_schema_request_on_the_default_model_validates(default_model):
    engine = LLMEngine(EngineConfig(dtype="float32", kv_cache_memory="32MiB", swap_space=0), default_model)
    prompt = "Describe Maria, a 34-year-old engineer who speaks Spanish and English, as JSON."
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    params = SamplingParams(temperature=0, max_tokens=80, guided_decoding=GuidedDecodingParams(json=SCHEMA))
    engine.add_request(ids, params)
    while engine.has_unfinished_requests():
        (out,) = engine.step()
    completion = out.outputs[0]
    assert completion.finish_reason == "stop"
    value = json.loads(completion.text)
    jsonschema.validate(value, SCHEMA)
    assert value["age"] == 34 and value["role"] == "engineer"  # the model still reads the prompt
