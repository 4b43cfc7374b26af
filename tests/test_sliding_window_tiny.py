"""Sliding-window models on tiny random checkpoints: Gemma 3 and a Mistral-style window over every layer,
against transformers on the same weights, and the engine's window KV groups against every layer full."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention import ContiguousKVCache
from kvserve.attention.blend import QUERY_CHUNK
from kvserve.entrypoints.generation import Generator
from kvserve.models import load_model
from tests.tiny_models import (  # noqa: F401 - torch_single_thread: autouse fixture
    TinySpec,
    assert_greedy_equal_up_to_ties,
    hf_logits,
    load_hf_model,
    torch_single_thread,
    write_tiny_model,
)

WINDOW = 8
# KV memory for the engine test: room for the longest sequence with every layer full, not for all four
# (Gemma: 6 KiB per full-layer block of 4 tokens, 43 blocks for all four; Mistral: 2 KiB, 43 blocks).
CACHE = {"gemma3": "150KiB", "mistral": "60KiB"}
SPECS = {
    # 6 layers, every sixth global: groups of one global layer and five one-layer window groups.
    "gemma3": TinySpec(
        arch="gemma3", num_heads=4, num_kv_heads=2, head_dim=16, num_layers=6, tie_word_embeddings=True,
        extra={"sliding_window": WINDOW, "query_pre_attn_scalar": 16, "hidden_activation": "gelu_pytorch_tanh"},
    ),
    "mistral": TinySpec(arch="mistral", num_heads=4, num_kv_heads=2, num_layers=2, extra={"sliding_window": WINDOW}),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(SPECS))
def tiny(request, tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp(request.param), SPECS[request.param])
    return folder, load_model(folder, dtype=torch.float32), load_hf_model(folder)


def test_config_reads_the_windows(tiny):
    folder, loaded, _ = tiny
    windows = loaded.config.layer_windows
    if loaded.config.architecture == "gemma3":
        assert windows == (WINDOW,) * 5 + (None,)
    else:
        assert windows == (WINDOW, WINDOW)


def test_all_position_logits_match_transformers(tiny):
    """Every position of a 40-token prompt (five windows long) equals transformers' logits."""
    _, loaded, hf = tiny
    ids = torch.randint(0, loaded.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    cfg = loaded.config
    cache = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, 64, torch.float32)
    from kvserve.attention import AttentionMetadata

    meta = AttentionMetadata((0,), (40,), (0,), layer_windows=cfg.layer_windows)
    with torch.no_grad():
        ours = loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(40), cache, meta))
    assert (ours - hf_logits(hf, ids)).abs().max().item() < 1e-4


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_engine_window_groups_match_full_layers_and_reference(tiny, preemption):
    """Concurrent greedy requests through window groups (chunked prefill, a cache small enough to preempt)
    give the tokens of every layer kept full and of the one-by-one contiguous reference."""
    folder, loaded, _ = tiny
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, loaded.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 19, 33, 12)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    outputs, preemptions, completions = {}, {}, {}
    cache = CACHE[loaded.config.architecture]
    for groups in (True, False):
        llm = LLM(str(folder), dtype="float32", block_size=4, max_num_batched_tokens=16, kv_cache_memory=cache,
                  swap_space="256KiB", preemption_mode=preemption, kv_window_groups=groups)  # fmt: skip
        completions[groups] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        outputs[groups] = [c.token_ids for c in completions[groups]]
        preemptions[groups] = llm.engine.scheduler.num_preemptions
    assert outputs[True] == outputs[False]
    # The contiguous reference attends with other kernels: a float32 tie may go the other way (seen on AVX2).
    for completion, prompt in zip(completions[True], prompts, strict=True):
        assert_greedy_equal_up_to_ties(completion, Generator(loaded).generate(prompt, params).token_ids)
    # The same memory holds all four at once with window groups only: every layer full has to preempt.
    assert preemptions[False] > 0 and preemptions[True] < preemptions[False]


@pytest.mark.slow
def test_prefix_caching_and_n_over_window_groups(tiny):
    """A second request sharing a long prefix hits the cache; n=3 samples fork; tokens match no caching."""
    folder, loaded, _ = tiny
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, loaded.config.vocab_size, (30,), generator=gen).tolist()
    prompts = [prefix + [5, 6], prefix + [7]]
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=4, n=3)
    results = {}
    for caching in (True, False):
        llm = LLM(str(folder), dtype="float32", block_size=4, enable_prefix_caching=caching)
        first = llm.generate(prompts[:1], params, use_tqdm=False)
        second = llm.generate(prompts[1:], params, use_tqdm=False)
        results[caching] = [[c.token_ids for c in o.outputs] for o in first + second]
        if caching:
            assert llm.engine.kv_usage().prefix_hit_tokens >= 24
    assert results[True] == results[False]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["snapkv", "pyramid"])
def test_compressing_policies_keep_the_window_in_window_layers(tiny, policy):
    """A compressing policy over a sliding-window model: each window layer keeps its window (plus at most a block
    of slack), each global layer the policy's share. At budget 1, and wherever every layer has a window
    (Mistral), that loses nothing: the tokens of the full cache's window groups."""
    folder, loaded, _ = tiny
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, loaded.config.vocab_size, (n,), generator=gen).tolist() for n in (40, 23, 9)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    options = dict(dtype="float32", block_size=4, max_num_batched_tokens=16)

    def tokens(**kv) -> list[list[int]]:
        llm = LLM(str(folder), **options, **kv)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    full = tokens()
    assert tokens(kv_policy=policy, kv_budget=1.0) == full
    windows = loaded.config.layer_windows
    if all(w is not None for w in windows):
        assert tokens(kv_policy=policy, kv_budget=0.5) == full
    llm = LLM(str(folder), **options, kv_policy=policy, kv_budget=0.5)
    engine = llm.engine
    engine.add_request(prompts[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        for _, seq in engine._seqs.values():
            for layer, (held, window) in enumerate(zip(seq.group_slots, windows, strict=True)):
                limit = window if window is not None else engine.kv_policy.capacity(layer, len(windows), seq.num_tokens)
                assert held <= limit + 4
                if window is not None and seq.num_computed_tokens > window + 4:
                    assert held >= window  # never less than the window sees


@pytest.mark.slow
@pytest.mark.parametrize(
    "options", [{"kv_policy": "snapkv", "kv_window_groups": False}, {"kv_offload": "host", "kv_policy": "full"}]
)
def test_prompt_cache_is_refused_where_windows_count_slots(tiny, options):
    """Under a compressing policy or an offloaded cache a window layer's window is counted in slots, which module
    gaps would shift: registering a schema is refused with the reason, and the engine still generates."""
    folder, _, _ = tiny
    llm = LLM(str(folder), dtype="float32", block_size=4, **options)
    schema = '<schema name="s"><module name="doc">the cat sat on the mat</module></schema>'
    with pytest.raises(ValueError, match="sliding-window layers count a window in cache slots"):
        llm.engine.register_schema(schema)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    assert len(llm.generate([[1, 2, 3, 4, 5]], params, use_tqdm=False)[0].outputs[0].token_ids) == 3


def _first_logprobs(llm: LLM, prompt) -> dict[int, float]:
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=5), use_tqdm=False)
    return out.outputs[0].logprobs[0]


@pytest.mark.slow
def test_prompt_cache_windows_count_positions_not_slots(tiny):
    """A Prompt Cache prompt's slots hold the module blocks in import order (the schema's own text's partial block
    after the document's full blocks), so its BOS sits in the last window by slot but far outside it by position.
    Windows count positions: a document module after the schema's prefix, many windows long, gives the plain
    prompt's next-token distribution."""
    folder, loaded, _ = tiny
    llm = LLM(str(folder), dtype="float32", block_size=4, kv_window_groups=False)
    words = " ".join(f"w{i}" for i in range(30))  # tens of tokens: several windows of 8
    schema = f'<schema name="s">a b c d<module name="doc"> {words}</module></schema>'
    llm.engine.register_schema(schema)
    prompt = '<prompt schema="s"><doc/> and so</prompt>'
    prepared = llm.engine.prompt_cache.prepare(prompt)
    llm.engine.prompt_cache.release(prepared.modules)
    root = llm.engine.prompt_cache.store.modules[("s", "")]
    assert root.num_tokens % 4 and len(prepared.token_ids) > 3 * WINDOW  # the root's tail slots follow the doc's
    order = sorted(range(len(prepared.positions)), key=lambda i: prepared.positions[i])
    assert [prepared.positions[i] for i in order] == list(range(len(order)))  # no gap: the plain prompt
    plain = _first_logprobs(llm, [prepared.token_ids[i] for i in order])
    cached = _first_logprobs(llm, prompt)
    assert cached.keys() == plain.keys()
    for token, logprob in cached.items():
        assert logprob == pytest.approx(plain[token], abs=1e-4)


@pytest.mark.slow
def test_prompt_cache_decodes_by_position_in_window_layers(tiny):
    """Decode steps of a Prompt Cache prompt (several sequences at once, beside a plain one) read the slots within
    each row's window by position, as the prefill does: greedy tokens for several windows past the prompt are the
    plain prompt's, and differ where windows count slots."""
    folder, loaded, _ = tiny
    llm = LLM(str(folder), dtype="float32", block_size=4, kv_window_groups=False)
    words = " ".join(f"w{i}" for i in range(30))
    llm.engine.register_schema(f'<schema name="s">a b c d<module name="doc"> {words}</module></schema>')
    prompts = ['<prompt schema="s"><doc/> and so</prompt>', '<prompt schema="s"><doc/> then</prompt>']
    plain = []
    for prompt in prompts:
        prepared = llm.engine.prompt_cache.prepare(prompt)
        llm.engine.prompt_cache.release(prepared.modules)
        plain.append([t for _, t in sorted(zip(prepared.positions, prepared.token_ids, strict=True))])
    params = SamplingParams(max_tokens=3 * WINDOW, temperature=0, ignore_eos=True, logprobs=2)
    reference = [out.outputs[0].token_ids for out in llm.generate(plain, params, use_tqdm=False)]
    cached = llm.generate([*prompts, plain[0][:5]], params, use_tqdm=False)  # decoding together, one not positioned
    for out, want in zip(cached, reference, strict=False):
        assert_greedy_equal_up_to_ties(out.outputs[0], want)


def test_prompt_cache_recompute_of_every_module_token_is_the_plain_prompt_in_window_layers(tiny):
    """Selective recompute of every imported token attends by position, window layers within their window: two
    modules many windows long, all recomputed, give the plain prompt's next-token distribution."""
    folder, loaded, _ = tiny
    llm = LLM(str(folder), dtype="float32", block_size=4, kv_window_groups=False, prompt_cache_recompute=1.0)
    # Long enough for the recompute's queries to run in several chunks (blend.QUERY_CHUNK), each over its window.
    first, second = " ".join(f"w{i}" for i in range(12)), " ".join(f"v{i}" for i in range(45))
    llm.engine.register_schema(
        f'<schema name="s">a b c d<module name="one"> {first}</module><module name="two"> {second}</module></schema>'
    )
    prompt = '<prompt schema="s"><one/><two/> and so</prompt>'
    prepared = llm.engine.prompt_cache.prepare(prompt)
    llm.engine.prompt_cache.release(prepared.modules)
    order = sorted(range(len(prepared.positions)), key=lambda i: prepared.positions[i])
    assert [prepared.positions[i] for i in order] == list(range(len(order)))
    assert len(prepared.modules[-1].token_ids) > QUERY_CHUNK  # the second module's tokens are all recomputed
    plain = _first_logprobs(llm, [prepared.token_ids[i] for i in order])
    cached = _first_logprobs(llm, prompt)
    assert cached.keys() == plain.keys()
    for token, logprob in cached.items():
        assert logprob == pytest.approx(plain[token], abs=1e-4)


def test_prompt_cache_recompute_selection_probes_only_tokens_whose_layer_one_kv_can_deviate(tiny, monkeypatch):
    """Layer 0 is a window layer: a candidate whose window holds only its own module's tokens gets layer 1's keys
    and values as encoded (deviation zero), so the selection pass runs only the others, and chooses what a pass
    over every candidate would."""
    from kvserve.attention import blend
    from kvserve.core import runner

    folder, loaded, _ = tiny
    # Module two holds ~170 tokens: 3% of them are fewer than the 7 whose window reaches module one.
    llm = LLM(str(folder), dtype="float32", block_size=4, kv_window_groups=False, prompt_cache_recompute=0.03)
    first, second = " ".join(f"w{i}" for i in range(12)), " ".join(f"v{i}" for i in range(45))
    llm.engine.register_schema(
        f'<schema name="s">a b c d<module name="one"> {first}</module><module name="two"> {second}</module></schema>'
    )
    seen = {}
    deviation, recompute = blend._deviation, blend.recompute_modules

    def record_deviation(model, cache, seq_id, ids, positions, slots, candidates):  # noqa: ANN001, ANN202
        every = torch.tensor(seen["job"].candidates)
        scores = deviation(model, cache, seq_id, ids, positions, slots, every)
        seen["every"] = dict(zip(every.tolist(), scores.tolist(), strict=True))
        seen["probed"] = candidates.tolist()
        return deviation(model, cache, seq_id, ids, positions, slots, candidates)

    def record_job(model, cache, job):  # noqa: ANN001, ANN202
        seen["job"] = job
        return recompute(model, cache, job)

    monkeypatch.setattr(blend, "_deviation", record_deviation)
    monkeypatch.setattr(runner, "recompute_modules", record_job)
    _first_logprobs(llm, '<prompt schema="s"><one/><two/> and so</prompt>')
    job = seen["job"]
    probed = seen["probed"]
    assert job.count <= len(probed) < len(job.candidates) and probed == list(job.probe)
    first_of_two = min(job.positions[i] for i in job.candidates)  # module one right after the prefix: exact
    assert all(job.positions[i] - first_of_two < WINDOW - 1 for i in probed)  # the window reaches module one
    others = [d for i, d in seen["every"].items() if i not in job.probe]
    assert max(others) < 1e-9 * max(seen["every"].values())
    largest = sorted(seen["every"], key=seen["every"].get)[-job.count :]
    assert set(largest) <= set(probed)
