"""LLMEngine / LLM over a tiny random checkpoint: the paged engine against the contiguous ``Generator``,
against Hugging Face logits and beam search, and under memory pressure (chunked prefill, prefix
caching, preemption by recompute and by swap, aborts, bad requests)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel, RepetitionPenaltyLogitsProcessor

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.core.outputs import RequestOutput
from kvserve.core.step import SchedulerOutput
from kvserve.entrypoints.generation import Generator
from kvserve.entrypoints.llm import LLM
from kvserve.kv.sizing import kv_block_bytes
from kvserve.models import LoadedModel, load_model
from kvserve.sampling.sampling_params import SamplingParams
from tests.tiny_models import (  # noqa: F401 - torch_single_thread is an autouse fixture
    TinySpec,
    hf_logits,
    load_hf_model,
    torch_single_thread,
    write_tiny_model,
)

SPEC = TinySpec(num_heads=4, num_kv_heads=2, seed=7)
BLOCK = 4
# 9, 5, 23 and 2 tokens with the BOS.
PROMPTS = ["the cat sat on the mat", "hello world", "one two three four five six seven", "a"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("engine"), SPEC)


@pytest.fixture(scope="module")
def loaded(folder) -> LoadedModel:
    return load_model(folder)


@pytest.fixture(scope="module")
def generator(loaded) -> Generator:
    return Generator(loaded)


@pytest.fixture(scope="module")
def hf(folder) -> PreTrainedModel:
    return load_hf_model(folder)


def block_bytes(loaded: LoadedModel) -> int:
    cfg = loaded.config
    return kv_block_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, BLOCK)  # float32


def make_engine(folder, loaded, num_blocks: int = 64, host_blocks: int = 0, **options) -> LLMEngine:
    """An engine with exactly ``num_blocks`` device and ``host_blocks`` host blocks of 4 tokens."""
    size = block_bytes(loaded)
    config = EngineConfig(
        model=str(folder), block_size=BLOCK, kv_cache_memory=num_blocks * size + size - 1,
        swap_space=host_blocks * size, **options,
    )  # fmt: skip
    engine = LLMEngine(config, loaded)
    assert engine.kv.pool.num_blocks == num_blocks
    assert (engine.kv.host_pool.num_blocks if engine.kv.host_pool else 0) == host_blocks
    return engine


def record(engine: LLMEngine) -> list[SchedulerOutput]:
    """Every SchedulerOutput the engine acts on from now on."""
    outs: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def spy() -> SchedulerOutput:
        outs.append(schedule())
        return outs[-1]

    engine.scheduler.schedule = spy
    return outs


def run(engine: LLMEngine, prompts, params, request_ids=None) -> list[RequestOutput]:
    """Add every prompt, step until done; the finished outputs in prompt order (each reported once)."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    request_ids = request_ids or [None] * len(prompts)
    ids = [engine.add_request(p, sp, rid) for p, sp, rid in zip(prompts, params, request_ids, strict=True)]
    return drain(engine, ids)


def drain(engine: LLMEngine, ids: list[str]) -> list[RequestOutput]:
    results: dict[str, RequestOutput] = {}
    for _ in range(3000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                assert out.request_id not in results, "a request finished twice"
                results[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return [results[i] for i in ids]


def greedy(max_tokens: int = 16, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def reference(generator: Generator, prompts, params: SamplingParams) -> list[list[int]]:
    return [generator.generate(p, params).token_ids for p in prompts]


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """(N, vocab) log-probabilities of the next token after each position of ``ids``."""
    return torch.log_softmax(hf_logits(hf, ids), dim=-1)


def num_repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


# ----- greedy parity with the contiguous generator -----


def test_mixed_length_batch_matches_generator(folder, loaded, generator):
    engine = make_engine(folder, loaded)
    params = greedy(16)
    outputs = run(engine, PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        ref = generator.generate(prompt, params)
        assert out.prompt_token_ids == ref.prompt_token_ids
        assert out.outputs[0].token_ids == ref.token_ids
        assert out.outputs[0].text == ref.text
        assert out.outputs[0].finish_reason == "length" and out.finished
    assert len({tuple(t) for t in tokens(outputs)}) == len(PROMPTS)
    assert engine.kv_usage().used_blocks == 0


def test_offline_llm_api_matches_generator(folder, generator):
    llm = LLM(str(folder), dtype="float32", block_size=BLOCK, kv_cache_memory="64KiB", swap_space=0)
    params = greedy(8)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    assert tokens(outputs) == reference(generator, PROMPTS, params)


def test_chunked_prefill_matches_generator(folder, loaded, generator):
    engine = make_engine(folder, loaded, max_num_batched_tokens=5)
    steps = record(engine)
    params = greedy(12)
    assert tokens(run(engine, PROMPTS, params)) == reference(generator, PROMPTS, params)
    assert max(s.num_batched_tokens for s in steps) == 5
    chunks = [s for out in steps for s in out.scheduled if not s.samples]
    assert {s.request_id for s in chunks} >= {"0", "2"}  # the 9- and 23-token prompts were split


def test_prefix_caching_hits_and_matches_generator(folder, loaded, generator):
    base = "the quick brown fox jumps over the lazy dog. "  # 35 shared tokens with the BOS: 8 whole blocks
    prompts = [base + "the cat", base + "hello there", base + "one two three"]
    engine = make_engine(folder, loaded)
    params = greedy(10)
    ids = [engine.tokenizer.encode(p) for p in prompts]
    # Whole blocks of each later prompt that the first one computed (its prefix, up to a mismatch).
    hits = [next(i for i, (a, b) in enumerate(zip(ids[0], other, strict=False)) if a != b) // BLOCK * BLOCK
            for other in ids[1:]]  # fmt: skip
    assert min(hits) >= 2 * BLOCK

    first = run(engine, prompts[:1], params)  # computes and caches the shared blocks
    later = run(engine, prompts[1:], params)  # both admitted at once: they hit only the first's blocks
    assert first[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in later] == hits
    usage = engine.kv_usage()
    assert usage.prefix_hit_tokens == sum(hits)
    assert usage.prefix_query_tokens == sum(len(i) for i in ids)
    assert tokens(first + later) == reference(generator, prompts, params)


def test_requests_admitted_in_one_step_share_the_blocks_that_step_computes(folder, loaded, generator):
    base = "the quick brown fox jumps over the lazy dog. "
    prompts = [base + "the cat", base + "hello there"]
    engine = make_engine(folder, loaded)
    steps = record(engine)
    params = greedy(6)
    ids = [engine.tokenizer.encode(p) for p in prompts]
    shared = next(i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b) // BLOCK * BLOCK
    outputs = run(engine, prompts, params)
    first_step = steps[0].scheduled
    assert [s.request_id for s in first_step] == [o.request_id for o in outputs]  # one step, together
    assert outputs[1].num_cached_tokens == shared > 0
    assert first_step[1].num_computed_tokens == shared  # the second computes only its own suffix
    assert tokens(outputs) == reference(generator, prompts, params)


def test_prefix_caching_off_reports_no_hits(folder, loaded):
    engine = make_engine(folder, loaded, enable_prefix_caching=False)
    run(engine, PROMPTS[:1], greedy(2))
    assert run(engine, PROMPTS[:1], greedy(2))[0].num_cached_tokens == 0
    assert engine.kv_usage().prefix_hit_tokens == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_identical(folder, loaded, generator, mode):
    # 10 blocks hold 40 tokens: the 23-token prompt plus 16 outputs fits alone, not beside the others.
    engine = make_engine(folder, loaded, num_blocks=10, host_blocks=40, preemption_mode=mode)
    steps = record(engine)
    params = greedy(16)
    assert tokens(run(engine, PROMPTS, params)) == reference(generator, PROMPTS, params)
    assert engine.scheduler.num_preemptions > 0
    swapped = any(out.blocks_to_swap_out for out in steps)
    assert swapped == (mode == "swap")
    if mode == "swap":
        assert any(out.blocks_to_swap_in for out in steps)
    usage = engine.kv_usage()
    assert (usage.used_blocks, usage.host_used_blocks, usage.num_sequences) == (0, 0, 0)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forked_requests_under_preemption_match_an_unconstrained_run(folder, loaded, mode):
    """n=2 sampled requests share prompt blocks and copy on write; squeezing the cache (preemption,
    swaps of shared blocks) must not change a single token."""
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]  # each request's two samples fit 10 blocks unshared
    params = [SamplingParams(n=2, seed=10 + i, max_tokens=10, ignore_eos=True) for i in range(3)]
    roomy = run(make_engine(folder, loaded), prompts, params)
    tight = make_engine(folder, loaded, num_blocks=10, host_blocks=40, preemption_mode=mode)
    squeezed = run(tight, prompts, params)
    assert tight.scheduler.num_preemptions > 0
    for a, b in zip(roomy, squeezed, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert [c.cumulative_logprob for c in a.outputs] == pytest.approx([c.cumulative_logprob for c in b.outputs])
    assert tight.kv_usage().used_blocks == 0


def test_a_request_outgrowing_the_cache_stops_with_length(folder, loaded):
    engine = make_engine(folder, loaded, num_blocks=3, host_blocks=8, preemption_mode="swap")
    (out,) = run(engine, [list(range(1, 11))], greedy(10))
    completion = out.outputs[0]
    assert len(completion.token_ids) == 3  # 10 + 2 tokens fill 3 blocks; the 13th token has no slot
    assert (completion.finish_reason, completion.stop_reason) == ("length", "kv_cache_capacity")


def test_a_beam_search_outgrowing_the_cache_returns_its_beams(folder, loaded):
    # 3 beams of a 9-token prompt need 2 shared + 3 * 3 blocks by their 10th token; there are 6.
    engine = make_engine(folder, loaded, num_blocks=6)
    params = SamplingParams(use_beam_search=True, best_of=3, n=2, temperature=0.0, max_tokens=10, ignore_eos=True)
    (out,) = run(engine, PROMPTS[:1], params)
    assert out.finished and engine.kv_usage().used_blocks == 0
    assert len(out.outputs) == 2
    for beam in out.outputs:
        assert (beam.finish_reason, beam.stop_reason) == ("length", "kv_cache_capacity")
        assert 0 < len(beam.token_ids) < 10


# ----- parallel sampling -----


def test_n_samples_are_seeded_and_independent_of_the_batch(folder, loaded, generator):
    params = SamplingParams(n=3, seed=1234, max_tokens=12, ignore_eos=True)
    (alone,) = run(make_engine(folder, loaded), PROMPTS[:1], params)
    (again,) = run(make_engine(folder, loaded), PROMPTS[:1], params)
    others = [SamplingParams(n=2, temperature=0.8, max_tokens=9, ignore_eos=True), greedy(5), SamplingParams(seed=5)]
    batch = run(make_engine(folder, loaded), [PROMPTS[2], PROMPTS[1], PROMPTS[0], PROMPTS[3]],
                [others[0], others[1], params, others[2]])  # fmt: skip
    together = batch[2]
    samples = [c.token_ids for c in alone.outputs]
    assert len(samples) == 3 and [c.index for c in alone.outputs] == [0, 1, 2]
    assert all(len(s) == 12 for s in samples) and len({tuple(s) for s in samples}) == 3
    assert [c.token_ids for c in again.outputs] == samples
    assert [c.token_ids for c in together.outputs] == samples
    # The first sample uses the request's own seed: the contiguous generator draws the same tokens.
    assert generator.generate(PROMPTS[0], dataclasses.replace(params, n=1, best_of=1)).token_ids == samples[0]


def test_n_samples_share_the_prompt_blocks(folder, loaded):
    engine = make_engine(folder, loaded)
    prompt = list(range(1, 11))  # 2 full blocks and a partial one
    rid = engine.add_request(prompt, SamplingParams(n=3, seed=0, max_tokens=4, ignore_eos=True))
    request = engine.requests[rid]
    engine.step()  # the prompt, sampled 3 times: the request forks
    tables = [engine.kv.block_table(s.seq_id) for s in request.seqs]
    assert len(tables) == 3 and tables[0] == tables[1] == tables[2] and len(tables[0]) == 3
    assert engine.kv_usage().used_blocks == 3
    engine.step()  # each sample writes its own token into the partial block: two copy on write
    tables = [engine.kv.block_table(s.seq_id) for s in request.seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3
    assert engine.kv_usage().used_blocks == 2 + 3  # three separate prompts would hold 3 * 3


def test_best_of_returns_the_highest_cumulative_logprobs(folder, loaded, hf):
    best = SamplingParams(n=2, best_of=4, seed=7, max_tokens=8, ignore_eos=True)
    all_four = dataclasses.replace(best, n=4)  # the same four seeded samples, all returned
    (out,) = run(make_engine(folder, loaded), PROMPTS[:1], best)
    (every,) = run(make_engine(folder, loaded), PROMPTS[:1], all_four)
    ranked = sorted(every.outputs, key=lambda c: c.cumulative_logprob, reverse=True)
    assert len({c.cumulative_logprob for c in ranked}) == 4
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in out.outputs] == [0, 1]
    # The cumulative logprob is that of the raw model distribution (checked against HF).
    prompt_ids = every.prompt_token_ids
    for c in every.outputs:
        logprobs = hf_logprobs(hf, prompt_ids + c.token_ids)[len(prompt_ids) - 1 : -1]
        expected = float(logprobs[torch.arange(len(c.token_ids)), torch.tensor(c.token_ids)].sum())
        assert c.cumulative_logprob == pytest.approx(expected, abs=1e-3)


# ----- logprobs -----


@pytest.mark.parametrize("sampled", [False, True])
def test_logprobs_are_the_model_log_softmax(folder, loaded, hf, sampled):
    params = SamplingParams(temperature=1.5 if sampled else 0.0, seed=3, max_tokens=10, ignore_eos=True, logprobs=3)
    (out,) = run(make_engine(folder, loaded), PROMPTS[:1], params)
    c = out.outputs[0]
    ref = hf_logprobs(hf, out.prompt_token_ids + c.token_ids)[len(out.prompt_token_ids) - 1 : -1]
    assert len(c.logprobs) == len(c.token_ids) == 10
    sizes = []
    for token, entry, row in zip(c.token_ids, c.logprobs, ref, strict=True):
        top3 = row.topk(3).indices.tolist()
        assert list(entry)[:3] == top3  # most likely first
        assert len(entry) == (3 if token in top3 else 4)
        assert token in entry
        for t, value in entry.items():
            assert value == pytest.approx(float(row[t]), abs=1e-4)
        sizes.append(len(entry))
    assert c.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(c.token_ids, c.logprobs, strict=True)))
    assert (4 in sizes) == sampled  # greedy picks the top token; this seed draws one outside the top 3


@pytest.mark.parametrize("budget", [2048, 3])
def test_prompt_logprobs_are_the_model_log_softmax(folder, loaded, hf, budget):
    engine = make_engine(folder, loaded, max_num_batched_tokens=budget)
    params = greedy(2, prompt_logprobs=2)
    out, repeat = run(engine, [PROMPTS[2], PROMPTS[2]], params)
    ids = out.prompt_token_ids
    ref = hf_logprobs(hf, ids)
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        entry = out.prompt_logprobs[i]
        top2 = ref[i - 1].topk(2).indices.tolist()
        assert list(entry)[:2] == top2
        assert len(entry) == (2 if ids[i] in top2 else 3) and ids[i] in entry
        for t, value in entry.items():
            assert value == pytest.approx(float(ref[i - 1, t]), abs=1e-4)
    # Cached blocks cannot give prompt logprobs: the same prompt again is computed again.
    assert repeat.num_cached_tokens == 0 and repeat.prompt_logprobs[0] is None
    for entry, again in zip(out.prompt_logprobs[1:], repeat.prompt_logprobs[1:], strict=True):
        assert list(again) == list(entry) and list(again.values()) == pytest.approx(list(entry.values()), abs=1e-5)


# ----- sampling options -----


def _hf_greedy_penalised(hf, prompt: list[int], penalty: float, n: int, prompt_too: bool) -> list[int]:
    """Greedy under HF's own repetition processor on HF logits, recomputed from scratch each step."""
    context, out = list(prompt), []
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    for _ in range(n):
        seen = context if prompt_too else out
        scores = hf_logits(hf, context)[-1:].clone()
        if seen:
            scores = processor(torch.tensor([seen]), scores)
        out.append(int(scores.argmax()))
        context.append(out[-1])
    return out


def test_repetition_penalty_matches_hf_and_repeats_less(folder, loaded, hf):
    engine = make_engine(folder, loaded)
    (first,) = run(engine, PROMPTS[:1], greedy(8))
    prompt = first.prompt_token_ids + first.outputs[0].token_ids  # a prompt holding tokens the model repeats
    (plain,) = run(engine, [prompt], greedy(30))
    (penalised,) = run(engine, [prompt], greedy(30, repetition_penalty=1.8))
    ids = penalised.outputs[0].token_ids
    assert ids == _hf_greedy_penalised(hf, prompt, 1.8, 30, prompt_too=True)
    # The prompt's tokens are penalised too (HF's and vLLM's rule): here that changes the output.
    assert ids != _hf_greedy_penalised(hf, prompt, 1.8, 30, prompt_too=False)
    assert num_repeats(plain.outputs[0].token_ids) >= 10
    assert num_repeats(ids) < num_repeats(plain.outputs[0].token_ids)


@pytest.mark.parametrize("option", ["frequency_penalty", "presence_penalty"])
def test_frequency_and_presence_penalties_repeat_less(folder, loaded, option):
    (plain,) = run(make_engine(folder, loaded), PROMPTS[:1], greedy(30))
    (penalised,) = run(make_engine(folder, loaded), PROMPTS[:1], greedy(30, **{option: 2.0}))
    assert num_repeats(penalised.outputs[0].token_ids) < num_repeats(plain.outputs[0].token_ids)
    assert penalised.outputs[0].token_ids[0] == plain.outputs[0].token_ids[0]  # no output yet: no penalty


def test_min_p_one_keeps_only_the_most_likely_token(folder, loaded):
    (plain,) = run(make_engine(folder, loaded), PROMPTS[:1], greedy(16))
    sampled = SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
    (free,) = run(make_engine(folder, loaded), PROMPTS[:1], sampled)
    (min_p,) = run(make_engine(folder, loaded), PROMPTS[:1], dataclasses.replace(sampled, min_p=1.0))
    assert free.outputs[0].token_ids != plain.outputs[0].token_ids  # the seed alone does not make it greedy
    assert min_p.outputs[0].token_ids == plain.outputs[0].token_ids


# ----- stopping -----


def _stop_string(text: str) -> tuple[int, str]:
    """A two-character printable stop string whose first occurrence is past the first token."""
    for k in range(3, len(text) - 2):
        s = text[k : k + 2]
        if s.isprintable() and s.strip() and text.find(s) == k:
            return k, s
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_ends_output_before_it(folder, loaded):
    engine = make_engine(folder, loaded)
    (full,) = run(engine, [PROMPTS[2]], greedy(24))
    text, ids = full.outputs[0].text, full.outputs[0].token_ids
    k, stop = _stop_string(text)
    (out,) = run(engine, [PROMPTS[2]], greedy(24, stop=[stop, "never appears"]))
    c = out.outputs[0]
    assert c.text == text[:k]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert len(c.token_ids) < len(ids) and c.token_ids == ids[: len(c.token_ids)]


def test_stop_token_id_ends_output_with_it(folder, loaded):
    engine = make_engine(folder, loaded)
    (full,) = run(engine, [PROMPTS[2]], greedy(24))
    ids = full.outputs[0].token_ids
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    (out,) = run(engine, [PROMPTS[2]], greedy(24, stop_token_ids=[ids[k]]))
    c = out.outputs[0]
    assert c.token_ids == ids[: k + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", ids[k])


# ----- aborts and bad requests -----


def test_abort_frees_blocks_and_the_others_complete(folder, loaded, generator):
    engine = make_engine(folder, loaded, max_num_seqs=3)
    params = greedy(12)
    ids = [engine.add_request(p, params) for p in PROMPTS]  # the fourth waits: max_num_seqs=3
    for _ in range(3):
        engine.step()
    before = engine.kv_usage().used_blocks
    seq_ids = [s.seq_id for s in engine.requests["1"].seqs]
    engine.abort_request("1")  # running
    engine.abort_request("3")  # still waiting
    engine.abort_request("no such request")
    assert all(s not in engine.kv for s in seq_ids)
    assert engine.kv_usage().used_blocks == before - 2  # "hello world" + 3 tokens: 2 blocks
    outputs = drain(engine, ["0", "2"])
    assert tokens(outputs) == reference(generator, [PROMPTS[0], PROMPTS[2]], params)
    assert engine.kv_usage().used_blocks == 0 and ids == ["0", "1", "2", "3"]


def test_abort_of_the_only_request_leaves_no_block_used(folder, loaded):
    engine = make_engine(folder, loaded)
    rid = engine.add_request(PROMPTS[2], greedy(12))
    engine.step()
    engine.step()
    assert engine.kv_usage().used_blocks == 6
    engine.abort_request(rid)
    usage = engine.kv_usage()
    assert (usage.used_blocks, usage.num_sequences) == (0, 0)
    assert not engine.has_unfinished_requests() and engine.step() == []


def test_bad_requests_raise_and_the_engine_keeps_serving(folder, loaded, generator):
    engine = make_engine(folder, loaded, num_blocks=16)
    params = greedy(6)
    good = engine.add_request(PROMPTS[0], params, request_id="x")
    cases = [
        ([], "empty"),
        (list(range(1, 257)), "256"),  # the context is 256 tokens
        ([5, 300, 7], "300"),
        ([5, -1], "-1"),
        (list(range(1, 70)), "69"),  # the 16 blocks hold 64 tokens
    ]
    for prompt, named in cases:
        with pytest.raises(ValueError, match=named):
            engine.add_request(prompt, params)
    with pytest.raises(ValueError, match="'x'"):
        engine.add_request(PROMPTS[1], params, request_id="x")
    assert list(engine.requests) == [good] and len(engine.scheduler.waiting) == 1
    (out,) = drain(engine, [good])
    assert out.outputs[0].token_ids == generator.generate(PROMPTS[0], params).token_ids


def test_more_samples_than_max_num_seqs_is_a_bad_request(folder, loaded):
    engine = make_engine(folder, loaded, max_num_seqs=2)
    with pytest.raises(ValueError, match="best_of=3.*max_num_seqs=2"):
        engine.add_request(PROMPTS[0], SamplingParams(n=3, max_tokens=4))


# ----- beam search -----


def _hf_beams(
    hf, ids: list[int], max_tokens: int, length_penalty: float, eos: int | None = None
) -> tuple[list[list[int]], list[float]]:
    config = GenerationConfig(
        num_beams=3, num_return_sequences=2, do_sample=False, early_stopping=False, length_penalty=length_penalty,
        max_new_tokens=max_tokens, eos_token_id=eos, pad_token_id=0, output_scores=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    out = hf.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), generation_config=config
    )
    return out.sequences[:, len(ids) :].tolist(), out.sequences_scores.tolist()


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_beam_search_matches_hf(folder, loaded, hf, prompt, length_penalty):
    params = SamplingParams(use_beam_search=True, best_of=3, n=2, temperature=0.0, max_tokens=10, ignore_eos=True,
                            length_penalty=length_penalty)  # fmt: skip
    engine = make_engine(folder, loaded)
    (out,) = run(engine, [prompt], params)
    beams = out.outputs
    assert len(beams) == 2 and [b.index for b in beams] == [0, 1]
    assert all(len(b.token_ids) == 10 for b in beams)
    # Equal lengths: any length penalty ranks by cumulative logprob.
    assert beams[0].cumulative_logprob >= beams[1].cumulative_logprob
    hf_ids, hf_scores = _hf_beams(hf, out.prompt_token_ids, 10, length_penalty)
    assert [b.token_ids for b in beams] == hf_ids
    assert [b.cumulative_logprob / 10**length_penalty for b in beams] == pytest.approx(hf_scores, abs=1e-4)
    for b in beams:  # each beam's score is its path's log-probability under the model
        logprobs = hf_logprobs(hf, out.prompt_token_ids + b.token_ids)[len(out.prompt_token_ids) - 1 : -1]
        expected = float(logprobs[torch.arange(10), torch.tensor(b.token_ids)].sum())
        assert b.cumulative_logprob == pytest.approx(expected, abs=1e-3)
    assert engine.kv_usage().used_blocks == 0


@pytest.mark.parametrize(
    ("prompt", "stop", "length_penalty"),
    [
        ("hello world", 245, 0.0),  # both hypotheses end with the stop token, at different lengths
        ("hello world", 287, 2.0),  # a strong length penalty prefers the long hypotheses
        (PROMPTS[2], 168, 1.0),  # a 10-token beam outranks a 6-token stopped one
        (PROMPTS[2], 280, 1.0),
        # A stop token ranked below the beam width among the 2 * width proposals ends no hypothesis:
        (PROMPTS[0], 161, 0.0),
        (PROMPTS[2], 287, 0.0),
    ],
)
def test_beam_search_with_a_stop_token_matches_hf(folder, loaded, hf, prompt, stop, length_penalty):
    """The stop token plays HF's EOS: finished hypotheses, length-penalised scores, early stopping."""
    params = SamplingParams(use_beam_search=True, best_of=3, n=2, temperature=0.0, max_tokens=10, ignore_eos=True,
                            stop_token_ids=[stop], length_penalty=length_penalty)  # fmt: skip
    (out,) = run(make_engine(folder, loaded), [prompt], params)
    hf_ids, hf_scores = _hf_beams(hf, out.prompt_token_ids, 10, length_penalty, eos=stop)
    hf_ids = [ids[: ids.index(stop) + 1] if stop in ids else ids for ids in hf_ids]  # drop HF's padding
    assert any(stop in ids for ids in hf_ids)
    beams = out.outputs
    assert [b.token_ids for b in beams] == hf_ids
    scores = [b.cumulative_logprob / len(b.token_ids) ** length_penalty for b in beams]
    assert scores == pytest.approx(hf_scores, abs=1e-4)
    for b in beams:
        assert (b.finish_reason, b.stop_reason) == (("stop", stop) if b.token_ids[-1] == stop else ("length", None))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_two_step_beam_search_is_never_worse_than_greedy(folder, loaded, prompt):
    """Beam search is not better than greedy in general: the greedy prefix can fall out of the beam
    and then outscore every kept hypothesis later. For two tokens it cannot lose: the first step keeps
    the top-3 first tokens, greedy's among them, and the second step ranks every continuation of
    every kept token, greedy's full path included, by cumulative logprob (length_penalty=0 scores
    are cumulative logprobs, and every hypothesis has 2 tokens with ignore_eos)."""
    engine = make_engine(folder, loaded)
    beam = SamplingParams(use_beam_search=True, best_of=3, n=2, temperature=0.0, max_tokens=2, ignore_eos=True,
                          length_penalty=0.0)  # fmt: skip
    (beams,) = run(engine, [prompt], beam)
    (plain,) = run(engine, [prompt], greedy(2))
    # The beams run as a batch of 3 and greedy alone: float32 matmuls round differently per batch shape (~1e-6).
    assert beams.outputs[0].cumulative_logprob >= plain.outputs[0].cumulative_logprob - 1e-5
    assert beams.outputs[0].cumulative_logprob >= beams.outputs[1].cumulative_logprob
