"""Prompt Cache in the paged engine, on a tiny random checkpoint (float32).

Exactness: a prompt over a schema of one module equals the same tokens computed without the cache; a
prompt over several modules equals Hugging Face transformers run on the same tokens with the same
position ids and Prompt Cache's attention mask (each module sees itself and its context, the schema's
text before any module; new tokens see everything before them). Bookkeeping: module blocks are shared
by concurrent requests (reference counts), tails are copied, pins keep modules alive, eviction returns
blocks, the host tier copies in on use, and prefix caching reaches past the modules.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.core.outputs import RequestOutput
from kvserve.models import LoadedModel, load_model
from kvserve.prompt_cache.pml import PMLError
from kvserve.prompt_cache.store import ModuleRoomError
from kvserve.sampling.sampling_params import SamplingParams
from tests.prompt_cache.reference import plain_reference, prompt_cache_reference
from tests.tiny_models import TinySpec, load_hf_model, torch_single_thread, write_tiny_model  # noqa: F401

SPEC = TinySpec(num_heads=4, num_kv_heads=2, seed=7)
BLOCK = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

SCHEMA = """<schema name="shop">
  the cat sat on the mat and then it
  <module name="doc">one two three four five six seven eight nine</module>
  <union>
    <module name="hello">hello world</module>
    <module name="greet">good day to <param name="who" len="6"/> and all <module name="inner">a b c d</module></module>
  </union>
</schema>"""
MULTI = '<prompt schema="shop"><doc/><greet who="the cat"><inner/></greet> so what next</prompt>'


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("pc"), SPEC)


@pytest.fixture(scope="module")
def loaded(folder) -> LoadedModel:
    return load_model(folder)


def make_engine(loaded: LoadedModel, **options) -> LLMEngine:
    options = {"dtype": "float32", "kv_cache_memory": 2**20, "swap_space": 2**18, "block_size": BLOCK, **options}
    return LLMEngine(EngineConfig(model=str(loaded.path), **options), loaded=loaded)


def encode(engine: LLMEngine) -> None:
    """Run the steps that encode the modules queued so far (the scheduler runs them like any prefill)."""
    while engine.scheduler.encoding:
        assert engine.step() == []  # an encoding reports nothing to any client


def run(engine: LLMEngine, prompts: list, params: SamplingParams = GREEDY) -> list[RequestOutput]:
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def test_single_module_prompt_equals_the_uncached_tokens(loaded):
    engine = make_engine(loaded)
    engine.register_schema('<schema name="s">the cat sat on the mat and then it ran off to the</schema>')
    (cached,) = run(engine, ['<prompt schema="s"> red door and so</prompt>'])
    assert cached.num_cached_tokens == len(cached.prompt_token_ids) - len(
        engine.tokenizer.encode(" red door and so", False)
    )
    (plain,) = run(make_engine(loaded, enable_prefix_caching=False), [cached.prompt_token_ids])
    assert plain.num_cached_tokens == 0
    assert cached.outputs[0].token_ids == plain.outputs[0].token_ids


def test_multi_module_prompt_matches_transformers_with_the_prompt_cache_mask(loaded, folder):
    engine = make_engine(loaded)
    engine.register_schema(SCHEMA)
    reference = prompt_cache_reference(engine, load_hf_model(folder), MULTI)
    (out,) = run(engine, [MULTI], SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    (first,) = out.outputs[0].logprobs
    assert out.outputs[0].token_ids[0] == int(reference.argmax())
    for token, logprob in first.items():
        assert logprob == pytest.approx(float(reference[token]), abs=1e-4)


def test_layout_puts_new_text_after_the_schema_and_arguments_at_their_param(loaded):
    engine = make_engine(loaded)
    info = engine.register_schema(SCHEMA)
    modules = info["modules"]
    prepared = engine.prompt_cache.prepare(MULTI)
    engine.prompt_cache.release(prepared.modules)
    uncached = prepared.positions[-prepared.num_uncached :]
    who = modules["greet"]["start"] + len(engine.tokenizer.encode("good day to ", False))
    num_arg = len(engine.tokenizer.encode("the cat", False))
    assert uncached[:num_arg] == list(range(who, who + num_arg))
    assert uncached[num_arg:] == list(
        range(info["num_positions"], info["num_positions"] + prepared.num_uncached - num_arg)
    )
    assert sorted(m.key[1] for m in prepared.modules) == ["", "doc", "greet", "inner"]


def test_concurrent_requests_share_module_blocks_and_copy_tails(loaded):
    engine = make_engine(loaded)
    engine.register_schema(SCHEMA)
    encode(engine)
    doc = engine.prompt_cache.store.modules[("shop", "doc")]
    doc_blocks = engine.kv.block_table(doc.seq_id)
    assert doc.num_tokens > BLOCK and doc.num_tokens % BLOCK  # full blocks to share and a tail to copy
    a = engine.add_request('<prompt schema="shop"><doc/> first question</prompt>', GREEDY)
    b = engine.add_request('<prompt schema="shop"><doc/><hello/> second one</prompt>', GREEDY)
    out = engine.scheduler.schedule()
    tables = {s.request_id: s.block_tables[0] for s in out.scheduled}
    root_full = engine.prompt_cache.store.modules[("shop", "")].num_tokens // BLOCK
    num_full = doc.num_tokens // BLOCK
    for request_id in (a, b):
        assert list(tables[request_id][root_full : root_full + num_full]) == doc_blocks[:num_full]
    for block in doc_blocks[:num_full]:
        assert engine.kv.pool.blocks[block].ref_count == 3  # the module sequence and both requests
    tail_sources = {src for src, _ in out.slots_to_copy}
    assert doc_blocks[-1] * BLOCK in tail_sources  # the doc's partial last block is copied, not shared
    engine.runner.execute(out)  # finish the step by hand, then drain
    engine.abort_request(a)
    engine.abort_request(b)
    for block in doc_blocks[:num_full]:
        assert engine.kv.pool.blocks[block].ref_count == 1


def test_outputs_are_the_same_from_device_tier_host_tier_lazy_and_with_prefix_hits(loaded):
    prompts = [MULTI, '<prompt schema="shop"><doc/><hello/> tell me</prompt>']
    device = make_engine(loaded)
    device.register_schema(SCHEMA)
    expected = [o.outputs[0].token_ids for o in run(device, prompts)]
    again = run(device, prompts)  # the same prompts again: prefix hits past the modules
    assert [o.outputs[0].token_ids for o in again] == expected
    assert again[0].num_cached_tokens > len(again[0].prompt_token_ids) - 8
    for options in ({"prompt_cache_tier": "host"}, {"prompt_cache_encode": "lazy"}):
        engine = make_engine(loaded, **options)
        engine.register_schema(SCHEMA)
        assert [o.outputs[0].token_ids for o in run(engine, prompts)] == expected, options


def test_pml_and_plain_requests_share_batches_and_keep_their_solo_outputs(loaded):
    prompts = [MULTI, "the cat sat on the mat", '<prompt schema="shop"><doc/> tell me</prompt>', "hello world"]
    engine = make_engine(loaded, max_num_batched_tokens=16)  # chunked prefills interleave with decodes
    engine.register_schema(SCHEMA)
    solo = [run(engine, [p])[0].outputs[0].token_ids for p in prompts]
    steps = []
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps.append(len(outputs))
        done |= {o.request_id: o for o in outputs if o.finished}
    assert max(steps) > 1  # requests ran side by side
    assert [done[i].outputs[0].token_ids for i in ids] == solo


def test_lazy_encoding_waits_for_first_use(loaded):
    engine = make_engine(loaded, prompt_cache_encode="lazy")
    info = engine.register_schema(SCHEMA)
    assert not any(m["cached"] for m in info["modules"].values())
    assert engine.prompt_cache.store.stats.encoded_modules == 0
    run(engine, ['<prompt schema="shop"><doc/> hi</prompt>'])
    assert engine.prompt_cache.store.stats.encoded_modules == 2  # the schema's own text and doc
    assert engine.prompt_cache.info("shop").modules["doc"]["cached"]


def test_host_tier_keeps_no_device_blocks_between_requests(loaded):
    engine = make_engine(loaded, prompt_cache_tier="host")
    free = engine.kv.pool.num_free
    engine.register_schema(SCHEMA)
    assert engine.kv.pool.num_free < free  # encoding: the modules' device blocks, until they are copied out
    encode(engine)
    assert engine.kv.pool.num_free == free
    store = engine.prompt_cache.store
    assert store.memory_bytes() == sum(m.num_tokens for m in store.modules.values()) * store.token_bytes
    run(engine, [MULTI])
    assert engine.kv.pool.num_free == free and store.stats.host_copies == 4


def test_lru_eviction_under_the_memory_budget_frees_blocks(loaded):
    engine = make_engine(loaded, prompt_cache_memory=1)  # one byte: only the newest module stays stored
    free = engine.kv.pool.num_free
    engine.register_schema(SCHEMA)
    store = engine.prompt_cache.store
    encode(engine)  # a module being encoded is not evicted: the budget holds again once they are done
    assert list(store.modules) == [("shop", "inner")] and store.stats.evictions == 4  # of 5 modules
    (out,) = run(engine, [MULTI])  # evicted modules are encoded again on use
    assert len(out.outputs[0].token_ids) == 8
    engine.prompt_cache.remove("shop")
    assert engine.kv.pool.num_free == free and not store.modules


def first_logprobs(engine: LLMEngine, prompt: str) -> dict[int, float]:
    (out,) = run(engine, [prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    (first,) = out.outputs[0].logprobs
    return first


def test_a_module_after_the_schema_prefix_is_the_plain_prompt_and_without_its_context_is_not(loaded, folder):
    """With its context (the schema's text before any module) a module right after it holds the states the plain
    prompt computes: the PML prompt's next-token distribution is the plain prefill's. Encoded alone (Prompt
    Cache's rule, ``prompt_cache_context="none"``) it is not, but it is the confined mask's."""
    schema = '<schema name="s">the cat sat on the mat and<module name="doc"> then it ran off to the</module></schema>'
    prompt = '<prompt schema="s"><doc/> red door and so</prompt>'
    hf = load_hf_model(folder)
    results = {}
    for context in ("prefix", "none"):
        engine = make_engine(loaded, prompt_cache_context=context)
        engine.register_schema(schema)
        module = engine.prompt_cache.store.modules[("s", "doc")]
        assert len(module.context_ids) == (len(engine.prompt_cache.store.modules[("s", "")].token_ids)
                                           if context == "prefix" else 0)  # fmt: skip
        plain, confined = plain_reference(engine, hf, prompt), prompt_cache_reference(engine, hf, prompt)
        first = first_logprobs(engine, prompt)
        results[context] = max(abs(logprob - float(plain[t])) for t, logprob in first.items())
        for token, logprob in first.items():
            assert logprob == pytest.approx(float(confined[token]), abs=1e-4)
    assert results["prefix"] < 1e-4 < results["none"]


def test_context_encodings_wait_for_room_and_give_their_scratch_blocks_back(loaded):
    """A module encoded after its context runs in a scratch sequence the scheduler admits when the pool has room:
    registering waits for a request holding most of the pool, and every scratch block is back afterwards."""
    engine = make_engine(loaded, kv_cache_memory=make_engine(loaded).kv_block_bytes * 40)
    running = engine.add_request(list(range(5, 65)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()  # 60 prompt tokens: 15 blocks held, 16 with the next token's
    engine.register_schema(SCHEMA)  # the modules' own blocks (20) fit; 'doc' after its context needs 12 more
    store = engine.prompt_cache.store
    doc = store.modules[("shop", "doc")]
    assert doc.context_ids and engine.kv.blocks_for(doc.num_tokens + len(doc.context_ids)) > engine.kv.pool.num_free
    engine.step()
    assert not doc.encoded and doc.encode_seq_id not in engine.kv  # waiting for blocks, not holding any
    while engine.has_unfinished_requests():
        engine.step()
    assert running not in engine.requests and all(m.encoded for m in store.modules.values())
    assert all(m.encode_seq_id is None for m in store.modules.values())
    held = sum(len(engine.kv.held_blocks(m.seq_id)) for m in store.modules.values())
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks - held  # no scratch sequence is left
    (out,) = run(engine, [MULTI])
    assert len(out.outputs[0].token_ids) == 8


def test_a_module_larger_than_the_free_pool_is_refused_and_the_schema_not_kept(loaded):
    engine = make_engine(loaded, kv_cache_memory=make_engine(loaded).kv_block_bytes * 8)  # 32 token slots
    long_module = " ".join(["the cat sat on the mat"] * 12)
    with pytest.raises(ModuleRoomError, match="no room to load module 'big'"):
        engine.register_schema(f'<schema name="s"><module name="big">{long_module}</module></schema>')
    assert engine.prompt_cache.names() == [] and engine.kv.pool.num_free == 8
    (out,) = run(engine, ["hello world"])
    assert len(out.outputs[0].token_ids) == 8


def test_device_tier_takes_at_most_half_the_kv_pool(loaded):
    engine = make_engine(loaded)  # 1 MiB of KV, prompt_cache_memory 512MiB by default
    assert engine.prompt_cache.store.budget_bytes == engine.kv.pool.num_blocks * engine.kv_block_bytes // 2
    assert make_engine(loaded, prompt_cache_tier="host").prompt_cache.store.budget_bytes == 512 * 2**20


def test_pins_keep_a_removed_module_until_its_request_ends(loaded):
    engine = make_engine(loaded)
    engine.register_schema(SCHEMA)
    free = engine.kv.pool.num_free
    request_id = engine.add_request('<prompt schema="shop"><doc/> question</prompt>', GREEDY)
    engine.step()
    engine.prompt_cache.remove("shop")
    with pytest.raises(PMLError, match="unknown schema 'shop'"):
        engine.add_request('<prompt schema="shop"><doc/> question</prompt>', GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert request_id not in engine.requests
    assert engine.kv.pool.num_free > free  # the request's blocks and the modules' are back


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_prompts_reuse_the_modules_and_keep_their_outputs(loaded, mode):
    prompts = [f'<prompt schema="shop"><doc/> question number {i} is here</prompt>' for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    roomy = make_engine(loaded)
    roomy.register_schema(SCHEMA)
    expected = [o.outputs[0].token_ids for o in run(roomy, prompts, params)]
    tight = make_engine(loaded, kv_cache_memory=roomy.kv_block_bytes * 48, preemption_mode=mode)
    tight.register_schema(SCHEMA)
    outs = run(tight, prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ('<prompt schema="nope"> hi</prompt>', "unknown schema 'nope'"),
        ('<prompt schema="shop"><greet who="a very long argument that will not fit"/> hi</prompt>', "reserves len=6"),
        ('<prompt schema="shop"><doc/></prompt>', "no new text"),
        ('<prompt schema="shop"><hello/><greet who="x"/> hi</prompt>', "members of one <union>"),
        ('<prompt schema="shop"><doc> hi</prompt>', "line 1: malformed XML"),
    ],
    ids=["unknown-schema", "argument-too-long", "no-new-text", "union", "malformed"],
)
def test_bad_pml_prompts_are_refused_and_the_engine_keeps_serving(loaded, prompt, match):
    engine = make_engine(loaded)
    engine.register_schema(SCHEMA)
    free = engine.kv.pool.num_free
    with pytest.raises(PMLError, match=match):
        engine.add_request(prompt, GREEDY)
    assert engine.kv.pool.num_free == free  # nothing stays pinned
    (out,) = run(engine, ['<prompt schema="shop"><doc/> fine</prompt>'])
    assert len(out.outputs[0].token_ids) == 8


def test_schema_over_the_context_and_a_compressing_engine_with_host_modules_are_refused(loaded):
    engine = make_engine(loaded, max_model_len=16)
    with pytest.raises(PMLError, match="spans .* positions; the context is 16"):
        engine.register_schema(SCHEMA)
    with pytest.raises(ValueError, match="use prompt_cache_tier='device'"):
        make_engine(loaded, kv_policy="h2o", prompt_cache_tier="host").register_schema(SCHEMA)
    engine = make_engine(loaded)
    engine.register_schema(SCHEMA)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.add_request(MULTI, SamplingParams(prompt_logprobs=1))
    with pytest.raises(PMLError, match="different schema named 'shop'"):
        engine.register_schema(SCHEMA.replace("hello world", "hi world"))
    assert engine.register_schema(SCHEMA)["name"] == "shop"  # the same text again is fine


def test_a_module_encodes_in_chunks_while_running_requests_keep_decoding(loaded):
    """Module encoding is scheduled work: a long module is prefilled chunk by chunk within the step's token
    budget, and a request already decoding gets a token in every one of those steps."""
    engine = make_engine(loaded, max_num_batched_tokens=16)
    running = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    engine.step()
    long_module = " ".join(["the cat sat on the mat"] * 12)
    engine.register_schema(f'<schema name="s"><module name="big">{long_module}</module></schema>')
    module = engine.prompt_cache.store.modules[("s", "big")]
    assert module.num_tokens > 3 * 16 and not module.encoded
    produced, steps = [], 0
    while not module.encoded:
        (out,) = engine.step()  # only the running request reports; the encoding reports nothing
        produced.append(len(out.outputs[0].token_ids))
        steps += 1
    assert steps >= module.num_tokens // 16  # chunked within the token budget
    assert produced == list(range(produced[0], produced[0] + steps))  # one token every step
    store = engine.prompt_cache.store  # the module after its context, and the schema's own opening (the BOS)
    assert module.context_ids and len(module.context_ids) == store.modules[("s", "")].num_tokens
    encoded = sum(m.num_tokens + len(m.context_ids) for key, m in store.modules.items() if key[0] == "s")
    assert store.stats.encoded_tokens == encoded
    engine.abort_request(running)


@pytest.mark.parametrize("adds_bos", [False, True], ids=["template-bos", "tokenizer-and-template-bos"])
def test_role_tags_open_the_sequence_once_as_the_chat_template_does(loaded, adds_bos):
    """The tiny template writes ``{{ bos_token }}`` before the first turn; a GGUF tokenizer (Gemma 3's) may add a BOS
    too. Either way the schema opens with one BOS and its tokens are the plain chat prompt's: ``<system>`` brings
    no second one."""
    tokenizer = dataclasses.replace(loaded.tokenizer, add_bos_token=adds_bos)
    engine = make_engine(dataclasses.replace(loaded, tokenizer=tokenizer))
    engine.register_schema('<schema name="chat"><system>be brief</system><module name="doc">the cat</module></schema>')
    prepared = engine.prompt_cache.prepare('<prompt schema="chat"><doc/><user>and then?</user></prompt>')
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "and then?"}]
    system = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=False)
    user = tokenizer.apply_chat_template(messages, add_generation_prompt=True)[len(system) :]  # PML opens the reply
    pieces = [system, "the cat", user]  # the schema's text, the module, the prompt's text: each encoded alone
    assert prepared.token_ids == [t for piece in pieces for t in tokenizer.encode(piece, add_special_tokens=False)]
    assert prepared.token_ids.count(tokenizer.bos_token_id) == 1
    engine.prompt_cache.release(prepared.modules)


def test_an_unknown_module_context_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"prompt_cache_context must be one of \('prefix', 'none'\), got 'all'"):
        EngineConfig(model="unused", prompt_cache_context="all")
