"""Guided decoding (structured output) over a tiny random checkpoint: whatever a random model prefers, every
output matches its JSON schema, regex, choice list or JSON object; unconstrained rows in the same batch get
exactly their own tokens; n > 1 and preemption by recompute keep each sequence's grammar state."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.core.outputs import RequestOutput
from kvserve.kv.sizing import kv_block_bytes
from kvserve.models import LoadedModel, load_model
from kvserve.sampling.sampling_params import SamplingParams
from kvserve.structured import GuidedDecodingParams
from tests.tiny_models import TinySpec, torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixture

PROMPTS = ["the cat sat on the mat", "hello world", "one two three four five six seven"]
SCHEMA = {
    "type": "object",
    "properties": {
        # (xgrammar 0.2.8 lets raw control characters into strings with a maxLength, which JSON forbids)
        "name": {"type": "string", "pattern": "[A-Za-z ]{1,8}"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "[a-z]{1,3}"}, "maxItems": 2},
    },
    "required": ["name", "age", "member", "colour", "tags"],
    "additionalProperties": False,
}
BLOCK = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("guided"), TinySpec(seed=11))


@pytest.fixture(scope="module")
def loaded(folder) -> LoadedModel:
    return load_model(folder)


def make_engine(folder, loaded, num_blocks: int = 256, **options) -> LLMEngine:
    cfg = loaded.config
    size = kv_block_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, BLOCK)  # float32
    config = EngineConfig(
        model=str(folder), dtype="float32", block_size=BLOCK, kv_cache_memory=num_blocks * size + size - 1,
        swap_space=0, **options,
    )  # fmt: skip
    return LLMEngine(config, loaded)


@pytest.fixture(scope="module")
def engine(folder, loaded) -> LLMEngine:
    return make_engine(folder, loaded)


def run(engine: LLMEngine, requests: list[tuple[str, SamplingParams]]) -> list[RequestOutput]:
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        done.update((out.request_id, out) for out in engine.step() if out.finished)
    return [done[i] for i in ids]


def guided(seed: int, max_tokens: int = 80, n: int = 1, **kind) -> SamplingParams:
    return SamplingParams(seed=seed, max_tokens=max_tokens, n=n, guided_decoding=GuidedDecodingParams(**kind))


def texts(outputs: list[RequestOutput]) -> list[str]:
    return [c.text for out in outputs for c in out.outputs]


def test_json_schema_outputs_parse_and_validate(engine):
    outputs = run(engine, [(p, guided(seed, json=SCHEMA)) for seed, p in enumerate(PROMPTS)])
    for out in outputs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_choice_regex_and_json_object(engine):
    choices = ["yes", "no", "maybe later"]
    for text in texts(run(engine, [(p, guided(seed, choice=choices)) for seed, p in enumerate(PROMPTS)])):
        assert text in choices
    pattern = r"[a-c]{2,6}-\d{2}"
    for text in texts(run(engine, [(p, guided(seed, regex=pattern)) for seed, p in enumerate(PROMPTS)])):
        assert re.fullmatch(pattern, text), text
    for out in run(engine, [(p, guided(seed, max_tokens=200, json_object=True)) for seed, p in enumerate(PROMPTS)]):
        if out.outputs[0].finish_reason == "stop":  # a random model may nest until max_tokens
            assert isinstance(json.loads(out.outputs[0].text), dict)
        else:
            assert out.outputs[0].text.lstrip().startswith("{")


def test_unconstrained_rows_in_a_mixed_batch_get_their_own_tokens(engine):
    plain = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), SamplingParams(seed=3, max_tokens=12)]
    alone = [run(engine, [(PROMPTS[i], plain[i])])[0].outputs[0].token_ids for i in range(2)]
    mixed = run(
        engine,
        [(PROMPTS[0], plain[0]), (PROMPTS[2], guided(1, json=SCHEMA)), (PROMPTS[1], plain[1]),
         (PROMPTS[1], guided(2, regex=r"[a-c]{2,6}-\d{2}"))],
    )  # fmt: skip
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMA)


def test_each_of_n_samples_has_its_own_matcher(engine):
    (out,) = run(engine, [(PROMPTS[0], guided(5, n=3, json=SCHEMA))])
    assert len(out.outputs) == 3 and len({c.text for c in out.outputs}) > 1
    for completion in out.outputs:
        jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_recompute_preemption_keeps_the_grammar_state(folder, loaded):
    """The matcher lives on the sequence and has accepted exactly its output tokens, which recompute keeps."""
    requests = [(p, guided(seed, json=SCHEMA)) for seed, p in enumerate(PROMPTS)]
    roomy = run(make_engine(folder, loaded), requests)
    tight = make_engine(folder, loaded, num_blocks=24, preemption_mode="recompute")
    squeezed = run(tight, [(p, guided(seed, json=SCHEMA)) for seed, p in enumerate(PROMPTS)])
    assert tight.scheduler.num_preemptions > 0
    assert texts(squeezed) == texts(roomy)
    for text in texts(squeezed):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_compiled_constraint_is_cached_and_logprobs_stay_the_models(engine):
    params = SamplingParams(
        temperature=0, max_tokens=5, logprobs=1, guided_decoding=GuidedDecodingParams(choice=["no"])
    )
    free = run(engine, [(PROMPTS[0], SamplingParams(temperature=0, max_tokens=1, logprobs=1))])[0].outputs[0]
    (out,) = run(engine, [(PROMPTS[0], params)])
    first = out.outputs[0].token_ids[0]
    assert engine.compile_grammar(params.guided_decoding) is engine.compile_grammar(params.guided_decoding)
    if first != free.token_ids[0]:  # the grammar forced another token: its logprob is still the model's own
        assert out.outputs[0].logprobs[0][first] < free.logprobs[0][free.token_ids[0]]


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda: GuidedDecodingParams(), "exactly one of json, regex, choice, grammar, json_object; got none"),
        (lambda: GuidedDecodingParams(regex="a", choice=["a"]), r"got \['regex', 'choice'\]"),
        (lambda: GuidedDecodingParams(json="{not json"), "json is not a valid JSON schema: Failed to parse JSON"),
        (lambda: GuidedDecodingParams(json={"type": 5}), "json is not a valid JSON schema"),
        (lambda: GuidedDecodingParams(regex="(ab"), "regex is not a valid regular expression: .*parenthesis"),
        (lambda: GuidedDecodingParams(grammar="root ::= item"), 'grammar is not a valid EBNF grammar: .*"item"'),
        (lambda: GuidedDecodingParams(choice=[]), "choice must be a non-empty list"),
        (lambda: SamplingParams(guided_decoding={"json": {}}), "guided_decoding must be a GuidedDecodingParams"),
        (
            lambda: SamplingParams(
                n=2, use_beam_search=True, temperature=0, guided_decoding=GuidedDecodingParams(choice=["a"])
            ),
            "guided_decoding applies to sampled sequences, not to beam search",
        ),
    ],
)
def test_bad_constraints_are_refused_naming_them(engine, build, words):
    with pytest.raises(ValueError, match=words):
        build()
    assert run(engine, [(PROMPTS[1], guided(0, choice=["ok"]))])[0].outputs[0].text == "ok"  # still serving


def test_the_grammar_wins_where_min_tokens_or_allowed_tokens_leave_nothing(engine):
    """Once ``"ok"`` is complete only EOS is allowed, which min_tokens bans: the sequence still ends there."""
    params = SamplingParams(
        temperature=0, max_tokens=10, min_tokens=5, guided_decoding=GuidedDecodingParams(choice=["ok"])
    )
    (out,) = run(engine, [(PROMPTS[0], params)])
    assert out.outputs[0].text == "ok" and out.outputs[0].finish_reason == "stop"
    allowed = SamplingParams(max_tokens=10, allowed_token_ids=[0], guided_decoding=GuidedDecodingParams(choice=["no"]))
    assert run(engine, [(PROMPTS[1], allowed)])[0].outputs[0].text == "no"
