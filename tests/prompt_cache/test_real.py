"""Prompt Cache on the real default model (SmolLM2-135M-Instruct, float32).

A document imported as the schema's only module and a question as new text give the same greedy
tokens as the plain prompt computed from scratch; a system prompt, a document and a parameterised
module in one prompt give transformers' next-token distribution under the Prompt Cache mask; the
offline ``LLM`` API registers a schema and answers with the module tokens served from the cache; and selective
recompute moves a multi-module prompt towards the plain prompt, in float32 and in bfloat16.
"""

from __future__ import annotations

import math

import pytest

import kvserve.entrypoints.llm
from kvserve import LLM, SamplingParams
from kvserve.attention.flash_prefill import flash_prefill_available
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.eval.data import AUSTEN
from tests.prompt_cache.reference import plain_reference, prompt_cache_reference

pytestmark = pytest.mark.real_model

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def passage() -> str:
    text = AUSTEN.read_text(encoding="utf-8")
    start = text.index("Emma Woodhouse, handsome, clever, and rich")
    return text[start : start + 1500].replace("&", "and").replace("<", "(")


def engine(default_model, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="float32", kv_cache_memory="64MiB", swap_space=0, **options), default_model)


def finish(engine: LLMEngine, prompt) -> object:
    engine.add_request(prompt, GREEDY)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()  # the steps encoding its modules report nothing
    return outputs[-1]


def test_document_module_with_a_question_equals_the_plain_prompt(default_model, passage):
    cached_engine = engine(default_model)
    cached_engine.register_schema(f'<schema name="book"><module name="doc">{passage}</module></schema>')
    cached = finish(cached_engine, '<prompt schema="book"><doc/> Question: who is Emma? Answer:</prompt>')
    plain = finish(engine(default_model, enable_prefix_caching=False), cached.prompt_token_ids)
    assert cached.num_cached_tokens > 250 and plain.num_cached_tokens == 0
    assert cached.outputs[0].token_ids == plain.outputs[0].token_ids


def test_system_document_and_parameter_match_transformers(default_model, hf_default_model, passage):
    e = engine(default_model)
    e.register_schema(
        f"""<schema name="qa"><system>You answer questions about novels.</system>
        <user><module name="doc">{passage[:800]}</module>
        <module name="ask">Answer in <param name="style" len="6"/> words.</module></user></schema>"""
    )
    prompt = '<prompt schema="qa"><doc/><ask style="very few"/><user>Who is Emma?</user></prompt>'
    reference = prompt_cache_reference(e, hf_default_model, prompt)
    e.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    outputs = []
    while e.has_unfinished_requests():
        outputs += e.step()  # the steps encoding the modules report nothing
    (out,) = outputs
    assert out.outputs[0].token_ids[0] == int(reference.argmax())
    for token, logprob in out.outputs[0].logprobs[0].items():
        assert logprob == pytest.approx(float(reference[token]), abs=2e-3)


def test_offline_api_registers_a_schema_and_reuses_its_modules(default_model, passage, monkeypatch):
    monkeypatch.setattr(kvserve.entrypoints.llm, "LLMEngine", lambda config: LLMEngine(config, default_model))
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", swap_space=0)
    info = llm.register_schema(
        f'<schema name="book"><system>Be brief.</system><module name="doc">{passage}</module></schema>'
    )
    assert info["modules"]["doc"]["cached"] and info["modules"]["doc"]["tokens"] > 250
    outs = llm.generate(
        [f'<prompt schema="book"><doc/><user>{q}</user></prompt>' for q in ("Who is Emma?", "Where does she live?")],
        SamplingParams(max_tokens=12, temperature=0),
        use_tqdm=False,
    )
    for out in outs:
        assert out.num_cached_tokens >= info["modules"]["doc"]["tokens"] and out.outputs[0].text.strip()


def recompute_distances(hf_default_model, passage, dtype: str) -> dict[float, float]:
    """L1 distance of the first-token distribution to transformers' plain prompt, without and with recompute."""
    parts = [passage[i * 400 : (i + 1) * 400] for i in range(3)]
    modules = "".join(f'<module name="p{i}">{part}</module>' for i, part in enumerate(parts))
    schema = f'<schema name="parts"><system>Be brief.</system><user>{modules}</user></schema>'
    prompt = '<prompt schema="parts"><p0/><p1/><p2/><user>Who is Emma?</user></prompt>'
    first = SamplingParams(max_tokens=1, temperature=0, logprobs=20)
    distances = {}
    for share in (0.0, 0.3):
        llm = LLM(dtype=dtype, kv_cache_memory="64MiB", swap_space=0, prompt_cache_recompute=share)
        llm.register_schema(schema)
        reference = plain_reference(llm.engine, hf_default_model, prompt).exp()
        (out,) = llm.generate([prompt], first, use_tqdm=False)
        probs = {t: math.exp(lp) for t, lp in out.outputs[0].logprobs[0].items()}
        distances[share] = sum(abs(p - float(reference[t])) for t, p in probs.items())
    return distances


def test_selective_recompute_moves_a_multi_module_prompt_towards_the_plain_prompt(
    default_model, hf_default_model, passage, monkeypatch
):
    monkeypatch.setattr(kvserve.entrypoints.llm, "LLMEngine", lambda config: LLMEngine(config, default_model))
    distances = recompute_distances(hf_default_model, passage, "float32")
    assert distances[0.3] < distances[0.0]


@pytest.mark.skipif(not flash_prefill_available(), reason="bfloat16 prefill kernel: AVX512-BF16 without AMX only")
def test_selective_recompute_in_bfloat16_through_the_prefill_kernel(hf_default_model, passage, shared_real_loads):
    """bfloat16 recompute attends through kvserve's prefill kernel by position: it still moves the prompt towards
    the plain one (distances against transformers' float32 prompt)."""
    distances = recompute_distances(hf_default_model, passage, "bfloat16")
    assert distances[0.3] < distances[0.0]
