"""Cache isolation in the engine (``kvserve/core/isolation.py``), on a tiny random checkpoint.

A prompt gets prefix-cache hits only from prompts of the same ``cache_salt`` and namespace (the unsalted
global one sharing as before), and its output does not depend on the salt; schemas of one namespace are
unknown to another, and another namespace's copy of a schema shares no module block with it. Bad salts are
ValueErrors naming ``cache_salt``, and the engine keeps serving.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.core.isolation import MAX_CACHE_SALT_CHARS, namespace_of, qualified_name
from kvserve.core.outputs import RequestOutput
from kvserve.entrypoints.llm import LLM
from kvserve.models import LoadedModel, load_model
from kvserve.prompt_cache.pml import PMLError
from kvserve.sampling.sampling_params import SamplingParams
from tests.tiny_models import TinySpec, torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixture

BLOCK = 4
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PROMPT = list(range(5, 45))  # ten full blocks
SCHEMA = """<schema name="s">the cat sat on the mat and then it
  <module name="doc">one two three four five six seven eight nine ten eleven twelve</module>
</schema>"""
OTHER_SCHEMA = '<schema name="s">a different schema <module name="doc">with the same name</module></schema>'
PML = '<prompt schema="s"><doc/> and so on and so forth, what next</prompt>'
NS_A, NS_B = namespace_of("key-a"), namespace_of("key-b")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> LoadedModel:
    folder: Path = write_tiny_model(tmp_path_factory.mktemp("isolation"), TinySpec(num_heads=4, num_kv_heads=2))
    return load_model(folder)


def make_engine(loaded: LoadedModel) -> LLMEngine:
    options = dict(dtype="float32", kv_cache_memory=2**20, swap_space=0, block_size=BLOCK)
    return LLMEngine(EngineConfig(model=str(loaded.path), **options), loaded=loaded)


def run(engine: LLMEngine, prompt, **isolation) -> RequestOutput:
    request_id = engine.add_request(prompt, GREEDY, **isolation)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == request_id:
                done = out
    return done


def test_a_salted_prompt_gets_no_hit_from_another_salt_and_hits_its_own(loaded):
    engine = make_engine(loaded)
    plain = run(engine, PROMPT)
    assert plain.num_cached_tokens == 0
    salted_a = run(engine, PROMPT, cache_salt="alice")
    salted_b = run(engine, PROMPT, cache_salt="bob")
    assert salted_a.num_cached_tokens == 0 and salted_b.num_cached_tokens == 0  # nor from the unsalted one
    again_a = run(engine, PROMPT, cache_salt="alice")
    assert again_a.num_cached_tokens == len(PROMPT) - BLOCK  # every full block but the one the last token is in
    assert run(engine, PROMPT).num_cached_tokens == len(PROMPT) - BLOCK  # unsalted prompts share as before
    answers = [out.outputs[0].token_ids for out in (salted_a, salted_b, again_a)]
    assert answers == [plain.outputs[0].token_ids] * 3  # the salt changes what is shared, never the answer


def test_namespaces_salt_plain_prompts_apart(loaded):
    engine = make_engine(loaded)
    assert run(engine, PROMPT, namespace=NS_A).num_cached_tokens == 0
    assert run(engine, PROMPT, namespace=NS_B).num_cached_tokens == 0
    assert run(engine, PROMPT).num_cached_tokens == 0
    assert run(engine, PROMPT, namespace=NS_A, cache_salt="x").num_cached_tokens == 0
    assert run(engine, PROMPT, namespace=NS_B, cache_salt="x").num_cached_tokens == 0
    assert run(engine, PROMPT, namespace=NS_A).num_cached_tokens == len(PROMPT) - BLOCK


@pytest.mark.parametrize(
    ("salt", "message"),
    [
        ("", "cache_salt must not be empty"),
        (7, "cache_salt must be a string, got int"),
        ("x" * (MAX_CACHE_SALT_CHARS + 1), f"at most {MAX_CACHE_SALT_CHARS} are allowed"),
    ],
)
def test_a_bad_salt_is_a_value_error_and_the_engine_keeps_serving(loaded, salt, message):
    engine = make_engine(loaded)
    with pytest.raises(ValueError, match=message):
        engine.add_request(PROMPT, GREEDY, cache_salt=salt)
    assert not engine.has_unfinished_requests()
    assert run(engine, PROMPT, cache_salt="x" * MAX_CACHE_SALT_CHARS).outputs[0].finish_reason == "length"


def test_a_salted_prompt_cache_prompt_is_refused(loaded):
    engine = make_engine(loaded)
    engine.register_schema(SCHEMA)
    with pytest.raises(ValueError, match="cache_salt does not apply to a Prompt Cache prompt"):
        engine.add_request(PML, GREEDY, cache_salt="alice")
    assert run(engine, PML).outputs[0].finish_reason == "length"


def test_a_schema_is_unknown_outside_its_namespace(loaded):
    engine = make_engine(loaded)
    engine.register_schema(SCHEMA, NS_A)
    cache = engine.prompt_cache
    assert cache.names(NS_A) == ["s"] and cache.names(NS_B) == [] and cache.names() == []
    for namespace in (NS_B, ""):
        with pytest.raises(KeyError) as missing:
            cache.info("s", namespace)
        assert missing.value.args[0] == "no schema named 's' is registered"  # as for a name nobody registered
        with pytest.raises(KeyError):
            cache.remove("s", namespace)
        with pytest.raises(PMLError, match="unknown schema 's'"):
            engine.add_request(PML, GREEDY, namespace=namespace)
    engine.register_schema(OTHER_SCHEMA, NS_B)  # B's own "s", A's untouched
    assert cache.info("s", NS_A).modules["doc"]["tokens"] != cache.info("s", NS_B).modules["doc"]["tokens"]
    cache.remove("s", NS_B)
    assert run(engine, PML, namespace=NS_A).outputs[0].finish_reason == "length"
    assert sorted(key for key in cache.store.modules) == [(qualified_name(NS_A, "s"), ""), (f"{NS_A}:s", "doc")]


def test_another_namespace_s_copy_of_a_schema_shares_no_module_block(loaded):
    engine = make_engine(loaded)

    def hit_tokens(register) -> int:
        before = engine.kv.usage().prefix_hit_tokens
        register()
        engine.encode_modules()
        return engine.kv.usage().prefix_hit_tokens - before

    assert hit_tokens(lambda: engine.register_schema(SCHEMA, NS_A)) == 0
    engine.prompt_cache.remove("s", NS_A)  # its freed blocks stay findable by hash
    assert hit_tokens(lambda: engine.register_schema(SCHEMA, NS_A)) > 0  # so the check below can fail
    assert hit_tokens(lambda: engine.register_schema(SCHEMA, NS_B)) == 0
    assert hit_tokens(lambda: engine.register_schema(SCHEMA)) == 0
    first_a = run(engine, PML, namespace=NS_A)
    first_b = run(engine, PML, namespace=NS_B)
    again_a = run(engine, PML, namespace=NS_A)
    assert first_b.num_cached_tokens == first_a.num_cached_tokens  # the modules only: no block of A's prompt
    assert again_a.num_cached_tokens > first_a.num_cached_tokens
    assert first_a.outputs[0].token_ids == first_b.outputs[0].token_ids


def test_llm_generate_takes_a_cache_salt_in_the_prompt_dict(loaded):
    llm = LLM.from_engine(make_engine(loaded))
    first, other, same = llm.generate(
        [{"prompt_token_ids": PROMPT, "cache_salt": "a"}, {"prompt_token_ids": PROMPT, "cache_salt": "b"}], GREEDY,
        use_tqdm=False,
    ) + llm.generate({"prompt_token_ids": PROMPT, "cache_salt": "a"}, GREEDY, use_tqdm=False)  # fmt: skip
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert same.num_cached_tokens == len(PROMPT) - BLOCK
    with pytest.raises(ValueError, match="prompt 1: cache_salt must not be empty"):
        llm.generate([{"prompt": "a"}, {"prompt": "b", "cache_salt": ""}], GREEDY, use_tqdm=False)
