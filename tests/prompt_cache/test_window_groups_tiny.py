"""Prompt Cache over sliding-window KV groups, on a tiny random Gemma 3 checkpoint (float32, window 8, blocks of 4).

Modules hold blocks in every KV group and keep them all; an importing prompt shares them in each group and its
window groups give back, by position, the blocks no query still to come sees. Lossless against the same engine
with every layer in one group (``kv_window_groups=False``, the reference the window tests compare against): the
same tokens for prompts importing modules longer than a window in different orders and subsets, with an
argument inside a module, concurrent requests and n > 1 sharing a module. Window groups really give blocks back,
module blocks a prompt no longer sees stay with the module, and every block is free once the modules go.
"""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.core.kv_plan import plan_kv
from tests.test_sliding_window_tiny import SPECS, WINDOW, _first_logprobs
from tests.tiny_models import (  # noqa: F401 - torch_single_thread: autouse fixture
    assert_greedy_equal_up_to_ties,
    torch_single_thread,
    write_tiny_model,
)

BLOCK = 4
WORDS = {name: " ".join(f"{name[0]}{i}" for i in range(n)) for name, n in (("one", 20), ("two", 30), ("three", 14))}
# Modules several windows long; ``two`` has an argument inside it, which sees the module around it by position.
SCHEMA = (
    '<schema name="s">a b c d<module name="one"> {one}</module>'
    '<module name="two"> {two} for <param name="who" len="8"/> and {one}</module>'
    '<module name="three"> {three}</module></schema>'
).format(**WORDS)
PROMPTS = [
    '<prompt schema="s"><one/> and so</prompt>',
    '<prompt schema="s"><two who="the cat"/><three/> then what</prompt>',
    '<prompt schema="s"><three/><one/><two who="a dog"/> next</prompt>',
    '<prompt schema="s"><two who="me"/></prompt>',
]
GREEDY = SamplingParams(max_tokens=4 * WINDOW, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("gemma3"), SPECS["gemma3"])


def make_llm(folder, groups: bool, **options) -> LLM:
    options = {
        "dtype": "float32", "block_size": BLOCK, "max_num_batched_tokens": 16, "kv_cache_memory": "2MiB",
        "swap_space": 0, **options,
    }  # fmt: skip
    llm = LLM(str(folder), kv_window_groups=groups, **options)
    llm.engine.register_schema(SCHEMA)
    return llm


def tokens(llm: LLM, prompts: list, params: SamplingParams = GREEDY) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in llm.generate(prompts, params, use_tqdm=False)]


def test_modules_share_blocks_in_every_group(folder):
    llm = make_llm(folder, groups=True)
    kv, store = llm.engine.kv, llm.engine.prompt_cache.store
    assert len(kv.groups) == 6 and sum(g.sliding_window is not None for g in kv.groups) == 5
    two = store.modules[("s", "two")]
    assert two.num_tokens > 3 * WINDOW
    # The module keeps every block in every group, window groups included: importers read it from their positions.
    assert all(kv.num_slots(two.seq_id, g) == two.num_tokens for g in range(6))
    assert len(kv.held_blocks(two.seq_id)) == 6 * kv.blocks_for(two.num_tokens)
    prepared = llm.engine.prompt_cache.prepare(PROMPTS[1])
    shared, tails = prepared.cached.group_shared, prepared.cached.group_tails
    assert len(shared) == 6 and shared[0] == prepared.cached.shared_blocks and len(set(map(len, shared))) == 1
    assert len({b for blocks in shared for b in blocks}) == 6 * len(shared[0])  # each group's own blocks
    assert all(len(t) == len(prepared.cached.tail_slots) for t in tails)
    llm.engine.prompt_cache.release(prepared.modules)


def test_prompts_over_window_groups_give_the_tokens_of_one_group(folder):
    """Each prompt alone, then all at once (sharing modules), greedy for several windows past the prompt."""
    got, want = make_llm(folder, groups=True), make_llm(folder, groups=False)
    assert len(got.engine.kv.groups) == 6 and len(want.engine.kv.groups) == 1
    alone = [tokens(got, [p])[0] for p in PROMPTS]
    assert alone == [tokens(want, [p])[0] for p in PROMPTS]
    assert tokens(got, PROMPTS) == tokens(want, PROMPTS) == alone
    # Not only the argmax: every step's two best logprobs (a window layer reading a wrong key moves them).
    params = SamplingParams(max_tokens=2 * WINDOW, temperature=0, ignore_eos=True, logprobs=2)
    pairs = zip(
        got.generate(PROMPTS, params, use_tqdm=False), want.generate(PROMPTS, params, use_tqdm=False), strict=True
    )
    for a, b in pairs:
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert step_a.keys() == step_b.keys()
            assert all(step_a[t] == pytest.approx(step_b[t], abs=1e-5) for t in step_a)
    # The same prompts again: prefix hits past the modules, in every group.
    hits = got.engine.kv_usage().prefix_hit_tokens
    assert tokens(got, PROMPTS) == alone and got.engine.kv_usage().prefix_hit_tokens > hits


def test_n_samples_and_concurrent_requests_share_a_module(folder):
    params = SamplingParams(max_tokens=3 * WINDOW, temperature=0.8, seed=5, n=2, ignore_eos=True)
    prompts = [PROMPTS[2], PROMPTS[1], "a b c d e f"]  # one plain prompt beside them
    got = tokens(make_llm(folder, groups=True), prompts, params)
    assert got == tokens(make_llm(folder, groups=False), prompts, params)
    assert all(len(samples) == 2 for samples in got)


def test_a_one_module_prompt_is_the_plain_prompt(folder):
    """A document module right after the schema's prefix, many windows long: the plain prompt's next-token
    distribution and greedy tokens, its window groups seeing the document by position (its slots hold the
    document's full blocks before the schema's own partial one)."""
    llm = make_llm(folder, groups=True)
    llm.engine.register_schema(f'<schema name="p">a b c d<module name="doc"> {WORDS["two"]}</module></schema>')
    prompt = '<prompt schema="p"><doc/> and so</prompt>'
    prepared = llm.engine.prompt_cache.prepare(prompt)
    llm.engine.prompt_cache.release(prepared.modules)
    order = sorted(range(len(prepared.positions)), key=lambda i: prepared.positions[i])
    assert [prepared.positions[i] for i in order] == list(range(len(order))) and len(order) > 3 * WINDOW
    assert order != list(range(len(order)))  # slot order is not position order
    plain = [prepared.token_ids[i] for i in order]
    cached = _first_logprobs(llm, prompt)
    reference = _first_logprobs(llm, plain)
    assert cached.keys() == reference.keys()
    for token, logprob in cached.items():
        assert logprob == pytest.approx(reference[token], abs=1e-4)
    params = SamplingParams(max_tokens=3 * WINDOW, temperature=0, ignore_eos=True, logprobs=2)
    (got,) = llm.generate([prompt], params, use_tqdm=False)
    (want,) = llm.generate([plain], params, use_tqdm=False)
    assert_greedy_equal_up_to_ties(got.outputs[0], want.outputs[0].token_ids)


def _decode_free_blocks(llm: LLM, prompt: str, max_tokens: int) -> tuple[int, int]:
    """Free device bytes at the last step of one long generation, and the module blocks its sequence holds then."""
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    free = held_modules = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq_id in [s for s in engine._seqs if s in engine.kv]:
            modules = {b for m in engine.prompt_cache.store.modules.values() for b in engine.kv.held_blocks(m.seq_id)}
            held_modules = len(modules.intersection(engine.kv.held_blocks(seq_id)))
            free = engine.kv.pool.num_free * engine.kv_block_bytes
    return free, held_modules


def test_window_groups_give_blocks_back_and_all_are_free_at_the_end(folder):
    """While a prompt importing two modules decodes many windows past them, its window groups hold about a window
    each: more of the pool is free than with one group. It lets go of the module blocks no query of it still
    sees (the modules keep them); every block is free once the schema is removed."""
    free, held = {}, {}
    for groups in (True, False):
        llm = make_llm(folder, groups=groups)
        free[groups], held[groups] = _decode_free_blocks(llm, PROMPTS[1], 8 * WINDOW)
        engine = llm.engine
        assert engine.kv.leaked_blocks() == 0 and engine.kv.num_request_sequences() == 0
        modules = sum(len(engine.kv.held_blocks(m.seq_id)) for m in engine.prompt_cache.store.modules.values())
        assert engine.kv.pool.num_free == engine.kv.pool.num_blocks - modules
        engine.prompt_cache.remove("s")
        assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    assert free[True] > free[False]
    # One group keeps its references to every module block it imports; with window groups only the global group
    # does by the end (its window groups let go of theirs, which the modules keep).
    assert held[False] > 0 and held[True] == held[False]


def test_refusals_name_what_window_groups_do_not_run(folder, tmp_path):
    llm = make_llm(folder, groups=True)
    loaded = llm.engine.loaded
    for options, match in [
        ({"prompt_cache_recompute": 0.5}, "prompt_cache_recompute"),
        ({"prompt_cache_tier": "host"}, "prompt_cache_tier='host'"),
        ({"prompt_cache_dir": str(tmp_path)}, "prompt_cache_dir"),
    ]:
        config = EngineConfig(model=str(folder), dtype="float32", block_size=BLOCK, **options)
        refusal = plan_kv(config, loaded.config, loaded.dtype).prompt_cache_refusal(config)
        assert refusal and match in refusal and "kv_window_groups=False" in refusal
        off = EngineConfig(model=str(folder), dtype="float32", block_size=BLOCK, kv_window_groups=False, **options)
        assert plan_kv(off, loaded.config, loaded.dtype).prompt_cache_refusal(off) is None
    with pytest.raises(ValueError, match="prompt_cache_recompute"):
        make_llm(folder, groups=True, prompt_cache_recompute=0.5)
