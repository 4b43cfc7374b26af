"""Pairs of techniques on the real default model (float32, where exactness can be asserted)."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.eval.data import AUSTEN

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.real_model
def test_real_model_parallel_prefill_with_h2o_continues_like_one_process(default_model, shared_real_loads) -> None:
    """KV-Runahead x H2O: the ranks' votes added up choose the same heavy hitters as one process."""
    ids = default_model.tokenizer.encode(AUSTEN.read_text()[:4000])[:600]
    options = {"dtype": "float32", "kv_policy": "h2o", "kv_budget": 0.5}
    with LLM(**options) as single:
        expected = single.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(prefill_parallel=2, prefill_partition="even", **options) as parallel:
        got = parallel.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert parallel.engine.parallel_prefill.last_route.processes == 2
    assert got == expected


@pytest.mark.real_model
def test_real_model_pyramid_in_the_disk_tier_equals_it_on_the_device(default_model, shared_real_loads) -> None:
    """PyramidInfer x offload: the compressed per-layer KV in a memory-mapped file gives the device's tokens."""
    ids = default_model.tokenizer.encode(AUSTEN.read_text()[:2000])[:300]
    options = {"dtype": "float32", "kv_policy": "pyramid", "kv_budget": 0.5}
    with LLM(**options) as on_device:
        expected = on_device.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(kv_offload="disk", **options) as offloaded:
        got = offloaded.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert offloaded.engine.runner.cache.bytes_moved()["fetched"] > 0
    assert got == expected


@pytest.mark.real_model
def test_real_model_prompt_cache_stores_modules_compressed_by_pyramid(default_model, shared_real_loads) -> None:
    """Prompt Cache x PyramidInfer: a document module encoded under PyramidInfer takes less memory than under the
    full cache, and a prompt importing it answers with well-formed text."""
    doc = AUSTEN.read_text()[:1500].replace("<", " ").replace(">", " ").replace("&", "and")
    schema = f'<schema name="book"><module name="doc">{doc}</module></schema>'
    prompt = '<prompt schema="book"><doc/> Who is the story about?</prompt>'
    other = prompt.replace("Who is the story about?", "Where does the story take place?")
    params = SamplingParams(max_tokens=16, temperature=0)
    memory = {}
    for policy in ("full", "pyramid"):
        with LLM(dtype="float32", kv_policy=policy, kv_budget=0.5 if policy == "pyramid" else None) as llm:
            llm.register_schema(schema)
            memory[policy] = llm.engine.prompt_cache.store.memory_bytes()
            outs = llm.generate([prompt, other], params, use_tqdm=False)
        assert all(out.num_cached_tokens > 300 and out.outputs[0].text.strip() for out in outs)
        assert outs[0].outputs[0].text != outs[1].outputs[0].text  # the answer follows the question after the module
    assert memory["pyramid"] < 0.8 * memory["full"]
