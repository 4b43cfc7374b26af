"""Prompt Cache with selective recompute (CacheBlend) on a tiny random checkpoint (float32).

Recomputing every imported token equals a plain prefill of the same tokens at the same positions (gaps from
unimported modules, a union and the schema's layout); recomputing none is today's Prompt Cache; the selection
takes the tokens whose KV deviates most; the module store's blocks are never written; bad shares are refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.attention import blend
from kvserve.attention.blend import kv_deviation, select_deviating
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.models import LoadedModel, load_model
from kvserve.prompt_cache.recompute import plan_recompute
from kvserve.sampling.sampling_params import SamplingParams
from tests.prompt_cache.reference import plain_reference, prompt_cache_reference
from tests.tiny_models import TinySpec, load_hf_model, torch_single_thread, write_tiny_model  # noqa: F401

SPEC = TinySpec(num_heads=4, num_kv_heads=2, seed=7)
BLOCK = 4
FIRST = SamplingParams(max_tokens=1, temperature=0, logprobs=5)

SCHEMA = """<schema name="blend">
  the cat sat on the mat and then it
  <module name="a">one two three four five six seven eight nine ten eleven</module>
  <module name="skip">this module is not imported by the prompt</module>
  <module name="b">red green blue yellow orange purple pink</module>
  <union>
    <module name="c">alpha beta gamma delta epsilon zeta eta theta</module>
    <module name="d">x y z</module>
  </union>
</schema>"""
PROMPT = '<prompt schema="blend"><a/><b/><d/> so what comes next</prompt>'


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("blend"), SPEC)


@pytest.fixture(scope="module")
def loaded(folder) -> LoadedModel:
    return load_model(folder)


def make_engine(loaded: LoadedModel, share: float) -> LLMEngine:
    options = {"dtype": "float32", "kv_cache_memory": 2**20, "swap_space": 0, "block_size": BLOCK}
    config = EngineConfig(model=str(loaded.path), prompt_cache_recompute=share, **options)
    engine = LLMEngine(config, loaded=loaded)
    engine.register_schema(SCHEMA)
    return engine


def first_logprobs(engine: LLMEngine, prompt: str) -> dict[int, float]:
    engine.add_request(prompt, FIRST)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs[-1].outputs[0].logprobs[0]


def distance(logprobs: dict[int, float], reference: torch.Tensor) -> float:
    return max(abs(lp - float(reference[token])) for token, lp in logprobs.items())


@pytest.mark.parametrize("query_chunk", [128, 3])
def test_recomputing_every_imported_token_equals_a_plain_prefill(loaded, folder, query_chunk, monkeypatch):
    monkeypatch.setattr(blend, "QUERY_CHUNK", query_chunk)  # 3: queries in chunks over the keys they reach
    hf = load_hf_model(folder)
    engine = make_engine(loaded, 1.0)
    reference = plain_reference(engine, hf, PROMPT)
    prepared = engine.prompt_cache.prepare(PROMPT)
    engine.prompt_cache.release(prepared.modules)
    assert max(prepared.positions) + 1 > len(prepared.positions)  # gaps: fewer tokens than positions
    assert distance(first_logprobs(engine, PROMPT), reference) < 1e-4
    cached = first_logprobs(make_engine(loaded, 0.0), PROMPT)
    assert distance(cached, reference) > 1e-2  # without recompute the modules miss each other


def test_no_recompute_is_the_prompt_cache_of_today(loaded, folder):
    engine = make_engine(loaded, 0.0)
    prepared = engine.prompt_cache.prepare(PROMPT)
    engine.prompt_cache.release(prepared.modules)
    assert prepared.cached.recompute == () and prepared.cached.recompute_count == 0
    assert len(prepared.cached.shared_blocks) == sum(m.num_tokens // BLOCK for m in prepared.modules)
    reference = prompt_cache_reference(engine, load_hf_model(folder), PROMPT)
    assert distance(first_logprobs(engine, PROMPT), reference) < 1e-4


def test_plan_excludes_the_first_segment_and_keeps_its_blocks_shared():
    # Tokens in sequence order: module 0 at positions 0-5, module 1 at 8-11 (gap), module 0 again at 12-13.
    owners = [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0]
    positions = [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13]
    plan = plan_recompute(owners, positions, num_full_blocks=2, block_size=4, share=0.5)
    assert plan.candidates == (6, 7, 8, 9, 10, 11)  # module 0 before module 1's first position attends to itself
    assert plan.count == 3 and plan.num_shared == 1  # block 1 holds token 6: copied; block 0 stays shared
    assert plan_recompute(owners, positions, 2, 4, 1.0).count == 6
    assert plan_recompute([0, 0, 0], [0, 1, 2], 0, 4, 1.0).candidates == ()


def test_plan_leaves_a_module_right_after_the_prefix_it_was_encoded_behind_and_probes_by_window():
    # The schema's text (owner 0) at positions 0-3; modules 1 (4-9) and 2 (10-17), each encoded after 0-3.
    owners = [0] * 4 + [1] * 6 + [2] * 8
    positions = list(range(18))
    contexts = [(), (0, 1, 2, 3), (0, 1, 2, 3)]
    plan = plan_recompute(owners, positions, 0, 4, 0.25, contexts, probe_window=3)
    assert plan.candidates == tuple(range(10, 18))  # module 1 sees only the prefix it was encoded behind
    assert plan.count == 2
    assert plan.probe == (10, 11)  # a window [p - 2, p] that reaches module 1: p = 10, 11
    assert plan_recompute(owners, positions, 0, 4, 0.25, contexts).probe == plan.candidates  # no window
    assert plan_recompute(owners, positions, 0, 4, 0.25).candidates == tuple(range(4, 18))  # encoded alone


def test_selection_takes_the_largest_kv_deviation():
    k_cached = torch.zeros(5, 2, 3)
    v_cached = torch.ones(5, 2, 3)
    k = k_cached.clone()
    v = v_cached.clone()
    k[1, 0, 0] = 2.0  # 4
    v[3, 1, 2] = 4.0  # (4 - 1)^2 = 9
    k[4] = 0.5  # 6 * 0.25 = 1.5
    v[4, 0, 0] = 2.0  # + 1 = 2.5
    deviation = kv_deviation(k, v, k_cached, v_cached)
    assert deviation.tolist() == [0.0, 4.0, 0.0, 9.0, 2.5]
    assert select_deviating(deviation, 2).tolist() == [1, 3]  # ascending indices of the two largest
    assert select_deviating(deviation, 3).tolist() == [1, 3, 4]


def test_module_store_blocks_stay_as_encoded(loaded, folder):
    engine = make_engine(loaded, 0.5)
    store = engine.prompt_cache.store
    while engine.scheduler.encoding:  # the schema's modules, encoded as registered
        engine.step()
    modules = [m for m in store.modules.values() if m.seq_id is not None]
    slots = [s for m in modules for s in engine.kv.slots(m.seq_id, 0, m.num_tokens)]
    before = engine.runner.cache.read_slots(slots)
    recomputed = first_logprobs(engine, PROMPT)
    after = engine.runner.cache.read_slots(slots)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    engine.prompt_cache.recompute = 0.0  # the next request imports the modules as they are
    reference = prompt_cache_reference(engine, load_hf_model(folder), PROMPT)
    plain = first_logprobs(engine, PROMPT)
    assert distance(plain, reference) < 1e-4
    assert recomputed != plain


def test_recompute_job_is_plain_data_over_the_sequences_own_blocks(loaded):
    engine = make_engine(loaded, 0.5)
    while engine.scheduler.encoding:
        engine.step()
    engine.add_request(PROMPT, FIRST)
    out = engine.scheduler.schedule()
    (job,) = out.recomputes
    cached = engine.requests["0"].prompt_cache
    assert job.candidates == cached.recompute and job.count == -(-len(cached.recompute) // 2)
    shared = {b * BLOCK + j for b in cached.shared_blocks for j in range(BLOCK)}
    assert not shared.intersection(job.slots[i] for i in job.candidates)  # only the sequence's own slots change
    assert {dst for _, dst in out.slots_to_copy} >= {job.slots[i] for i in job.candidates}


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan"), True])
def test_a_share_outside_zero_to_one_is_refused(loaded, share):
    with pytest.raises(ValueError, match=r"prompt_cache_recompute must be a share in \[0, 1\].*got"):
        EngineConfig(model=str(loaded.path), prompt_cache_recompute=share)


@pytest.mark.parametrize(
    "option", [{"kv_policy": "pyramid"}, {"kv_offload": "host"}, {"prefill_parallel": 2}, {"tensor_parallel_size": 2}]
)
def test_recompute_with_a_cache_it_cannot_rewrite_is_refused(loaded, option):
    (name,) = option
    with pytest.raises(ValueError, match=f"prompt_cache_recompute=0.2 needs {name}="):
        EngineConfig(model=str(loaded.path), prompt_cache_recompute=0.2, **option)


def test_query_chunks_read_only_the_keys_their_last_query_reaches(monkeypatch):
    monkeypatch.setattr(blend, "QUERY_CHUNK", 2)
    positions = torch.tensor([0, 1, 2, 5, 6, 7, 9])  # gaps between modules
    assert blend._query_chunks(positions, torch.tensor([2, 6, 9])) == ((0, 2, 5), (2, 3, 7))
    unordered = torch.tensor([0, 5, 1, 6])  # modules out of schema order: one chunk over every key
    assert blend._query_chunks(unordered, torch.tensor([5, 6])) == ((0, 2, 4),)
