"""The paged engine on the real default model (SmolLM2-135M-Instruct, float32).

Greedy outputs of a mixed batch equal the contiguous ``Generator`` and Hugging Face transformers
token for token in every scheduling configuration (default, chunked prefill, prefix-cache hits,
preemption by recompute and by swap); logprobs equal transformers' log-softmax; a shared system
prompt is served from the prefix cache (hit rate derived from block counts, and a lower time to
first token than without the cache); seeded parallel samples reproduce; chat answers; and the KV
accounting returns every block and wastes less than a block per sequence.

One engine per configuration (module-scoped fixtures); every engine reuses the session's loaded
model, with a small KV cache so that building one is cheap.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvserve.entrypoints.llm
from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.core.outputs import RequestOutput
from kvserve.core.step import SchedulerOutput
from kvserve.entrypoints.generation import Generator
from kvserve.eval.data import AUSTEN
from kvserve.kv.manager import KVUsage
from kvserve.kv.sizing import kv_block_bytes

pytestmark = pytest.mark.real_model

BLOCK_SIZE = 16
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
PASSAGE_TOKENS = 300
SYSTEM_TOKENS = 1500
PASSAGE_A, PASSAGE_B = 1, 4  # the two prompts that share the ~300-token passage
HF_CHECKED = (0, 1, 2)  # prompts also compared with transformers' own greedy generate


# ----- data -----


@pytest.fixture(scope="module")
def austen() -> str:
    text = AUSTEN.read_text(encoding="utf-8")
    return text[text.index("Emma Woodhouse, handsome, clever, and rich") :]


@pytest.fixture(scope="module")
def prompts(default_model, austen) -> list[list[int]]:
    """Six mixed-length prompts as token ids (so that every system sees exactly the same ids)."""
    tok = default_model.tokenizer
    passage = tok.encode(austen[:4000])[:PASSAGE_TOKENS]
    return [
        tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}]),
        passage + tok.encode("\n\nQuestion: who is the heroine of this passage, and what is she like?\nAnswer:"),
        tok.encode('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
        tok.encode("Why is the sky blue?"),
        passage + tok.encode("\n\nSummarise the passage above in one sentence:"),
        tok.encode("import numpy as np\n\n# a 3x3 identity matrix\nx ="),
    ]


@pytest.fixture(scope="module")
def reference(default_model, prompts) -> list[list[int]]:
    """Greedy tokens from the contiguous single-request generator."""
    generator = Generator(default_model)
    return [generator.generate(ids, GREEDY).token_ids for ids in prompts]


@pytest.fixture(scope="module")
def hf_reference(hf_default_model, prompts) -> dict[int, list[int]]:
    """Greedy tokens from transformers' ``generate`` for the prompts in ``HF_CHECKED``."""
    out = {}
    for i in HF_CHECKED:
        ids = torch.tensor([prompts[i]])
        with torch.no_grad():
            tokens = hf_default_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                eos_token_id=None,  # ignore_eos: EOS is a token like any other (min_new_tokens would ban it)
            )
        out[i] = tokens[0, ids.shape[1] :].tolist()
        assert len(out[i]) == MAX_TOKENS
    return out


# ----- driving an engine -----


@dataclasses.dataclass
class Run:
    engine: LLMEngine
    name: str = ""
    outputs: dict[str, RequestOutput] = dataclasses.field(default_factory=dict)
    schedules: list[SchedulerOutput] = dataclasses.field(default_factory=list)
    usage: list[KVUsage] = dataclasses.field(default_factory=list)  # after every step

    def step(self) -> None:
        for output in self.engine.step():
            if output.finished:
                self.outputs[output.request_id] = output
        self.usage.append(self.engine.kv_usage())

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()


def _start(engine: LLMEngine) -> Run:
    """A run that records every ``SchedulerOutput`` the engine acts on."""
    run = Run(engine)
    schedule = engine.scheduler.schedule

    def recording_schedule() -> SchedulerOutput:
        out = schedule()
        run.schedules.append(out)
        return out

    engine.scheduler.schedule = recording_schedule
    return run


def _block_bytes(loaded) -> int:
    cfg = loaded.config
    return kv_block_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, BLOCK_SIZE)  # float32


def _blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _engine_config(name: str, loaded, prompts: list[list[int]]) -> EngineConfig:
    small = dict(kv_cache_memory="64MiB", swap_space=0)
    if name in ("default", "prefix"):
        return EngineConfig(**small)
    if name == "chunked":
        return EngineConfig(**small, max_num_batched_tokens=64)
    # Preemption: room for the largest request and only a few blocks more.
    largest = max(_blocks_for(len(ids) + MAX_TOKENS) for ids in prompts)
    mode = name.removeprefix("preempt-")
    swap_blocks = 64 if mode == "swap" else 0
    return EngineConfig(
        kv_cache_memory=(largest + 3) * _block_bytes(loaded),
        swap_space=swap_blocks * _block_bytes(loaded),
        preemption_mode=mode,
    )


CONFIGS = ["default", "chunked", "prefix", "preempt-recompute", "preempt-swap"]


@pytest.fixture(scope="module", params=CONFIGS)
def batch(request, default_model, prompts) -> Run:
    """The six prompts, greedy, through one engine per configuration."""
    name = request.param
    run = _start(LLMEngine(_engine_config(name, default_model, prompts), loaded=default_model))
    run.name = name
    late = PASSAGE_B if name == "prefix" else None
    for i, ids in enumerate(prompts):
        if i != late:
            run.engine.add_request(ids, GREEDY, request_id=str(i))
    if late is not None:
        run.step()  # the first passage prompt is computed whole in this step (its blocks become cached)
        run.engine.add_request(prompts[late], GREEDY, request_id=str(late))
    run.drain()
    return run


# ----- 1. greedy parity in every configuration -----


def test_greedy_batch_matches_generator(batch, prompts, reference):
    assert sorted(batch.outputs, key=int) == [str(i) for i in range(len(prompts))]
    for i in range(len(prompts)):
        output = batch.outputs[str(i)]
        assert output.prompt_token_ids == prompts[i]
        assert output.outputs[0].token_ids == reference[i], f"prompt {i}"
        assert output.outputs[0].finish_reason == "length"


def test_greedy_batch_matches_transformers(batch, hf_reference):
    for i, expected in hf_reference.items():
        assert batch.outputs[str(i)].outputs[0].token_ids == expected, f"prompt {i}"


def test_configuration_did_what_it_says(batch, prompts):
    name = batch.name
    scheduler = batch.engine.scheduler
    if not name.startswith("preempt-"):
        assert scheduler.num_preemptions == 0
    if name == "chunked":
        assert max(out.num_batched_tokens for out in batch.schedules) <= 64
        # The passage prompt was computed in several chunks, each after the ones before it.
        chunks = [
            s for out in batch.schedules for s in out.scheduled
            if s.request_id == str(PASSAGE_A) and s.num_computed_tokens < len(prompts[PASSAGE_A])
        ]  # fmt: skip
        assert len(chunks) >= len(prompts[PASSAGE_A]) // 64
        for before, after in zip(chunks, chunks[1:], strict=False):
            assert after.num_computed_tokens == before.num_computed_tokens + len(before.token_ids)
        assert sum(len(s.token_ids) for s in chunks) == len(prompts[PASSAGE_A]) - chunks[0].num_computed_tokens
    elif name == "prefix":
        shared = _common_prefix(prompts[PASSAGE_A], prompts[PASSAGE_B])
        cached = batch.outputs[str(PASSAGE_B)].num_cached_tokens
        assert cached > 0
        assert cached == shared // BLOCK_SIZE * BLOCK_SIZE
        assert batch.outputs[str(PASSAGE_A)].num_cached_tokens == 0
    elif name.startswith("preempt-"):
        assert scheduler.num_preemptions > 0
        assert any(out.preempted for out in batch.schedules)
        swapped_out = sum(len(out.blocks_to_swap_out) for out in batch.schedules)
        swapped_in = sum(len(out.blocks_to_swap_in) for out in batch.schedules)
        if name == "preempt-swap":
            assert swapped_out > 0
            assert swapped_in == swapped_out  # everything that left came back
        else:
            assert swapped_out == swapped_in == 0


# ----- 6. memory accounting (on the same runs) -----


def test_kv_accounting_after_and_during_the_batch(batch):
    final = batch.engine.kv_usage()
    assert final.used_blocks == 0
    assert final.free_blocks == final.total_blocks
    assert final.num_sequences == 0
    assert final.host_used_blocks == 0
    assert final.cached_blocks > 0  # prefix caching is on: finished prompts stay findable
    busy = [u for u in batch.usage if u.num_sequences]
    assert busy
    for usage in busy:
        # Each sequence's last block is its only partly filled one.
        assert usage.waste_slots <= (BLOCK_SIZE - 1) * usage.num_sequences, usage
        assert usage.used_blocks <= usage.total_blocks


# ----- 2. logprobs against transformers -----


@pytest.fixture(scope="module")
def default_engine(default_model) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory="64MiB", swap_space=0), loaded=default_model)


def _hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) float32: row t is the distribution of the token after ids[: t + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "chunked-16"])
def test_prompt_and_sample_logprobs_match_transformers(chunk, default_engine, default_model, hf_default_model, austen):
    engine = default_engine
    if chunk is not None:  # the prompt's logprobs arrive over several chunks
        config = EngineConfig(kv_cache_memory="16MiB", swap_space=0, max_num_batched_tokens=chunk)
        engine = LLMEngine(config, loaded=default_model)
    tok = default_model.tokenizer
    sentence = tok.encode(austen[: austen.index(";") + 1])  # "Emma Woodhouse, handsome, clever, ..."
    question = tok.encode("The three primary colours are")
    run = Run(engine)
    engine.add_request(sentence, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1), "prompt")
    engine.add_request(question, SamplingParams(max_tokens=8, temperature=0, logprobs=5), "sample")
    run.drain()

    prompt_lp = run.outputs["prompt"].prompt_logprobs
    expected = _hf_logprobs(hf_default_model, sentence)
    assert len(sentence) > 2 * 16
    assert len(prompt_lp) == len(sentence)
    assert prompt_lp[0] is None
    for t in range(1, len(sentence)):
        entry, row = prompt_lp[t], expected[t - 1]
        assert sentence[t] in entry and len(entry) <= 2
        assert entry[sentence[t]] == pytest.approx(row[sentence[t]].item(), abs=1e-3), f"position {t}"
        assert max(entry.values()) == pytest.approx(row.max().item(), abs=1e-3), f"position {t}"

    completion = run.outputs["sample"].outputs[0]
    generated = completion.token_ids
    assert len(generated) == 8 and len(completion.logprobs) == 8
    expected = _hf_logprobs(hf_default_model, question + generated)
    for i, (token, entry) in enumerate(zip(generated, completion.logprobs, strict=True)):
        row = expected[len(question) - 1 + i]
        assert token == row.argmax().item()  # greedy
        assert entry[token] == pytest.approx(row[token].item(), abs=1e-3), f"step {i}"
        assert len(entry) == 5
        top = torch.topk(row, 5).values.tolist()
        assert sorted(entry.values(), reverse=True) == pytest.approx(top, abs=1e-3), f"step {i}"
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t] for t, e in zip(generated, completion.logprobs, strict=True))
    )


# ----- 3. a shared system prompt -----


QUESTIONS = [
    "Who is Emma Woodhouse?",
    "Where does Emma live?",
    "What happened to Emma's mother?",
    "How old is Emma?",
    "Who is Miss Taylor?",
    "What is Mr. Woodhouse like?",
    "Does Emma have a sister?",
    "What is Hartfield?",
    "Who is Mr. Knightley?",
    "Why does Emma feel lonely?",
    "What does Emma enjoy doing?",
    "Is Emma rich?",
    "Who married Miss Taylor?",
    "What is Randalls?",
    "How does Mr. Woodhouse feel about marriage?",
    "Describe Emma in three words.",
    "What is the name of the village?",
    "Who is Isabella?",
    "Which city does Isabella live in?",
    "What is Emma's greatest fault?",
    "Who is Harriet Smith?",
    "What does Emma plan for Harriet?",
    "Who is Mr. Elton?",
    "Who is Robert Martin?",
    "What is the tone of the opening chapter?",
    "Summarise the first paragraph.",
    "Name one of Emma's friends.",
    "What season is it?",
    "Is Mr. Woodhouse healthy?",
    "Who wrote this novel?",
    "When was the novel published?",
    "What is the novel's first sentence about?",
]
NUM_SHARED = len(QUESTIONS)  # 32 requests for the hit rate
NUM_TIMED = 8  # requests in the time-to-first-token comparison (a 1,500-token prefill costs seconds on CPU)
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)


@dataclasses.dataclass
class SharedPrefixRuns:
    prompts: list[list[int]]
    cached: Run  # prefix caching on: all NUM_SHARED requests
    uncached: Run  # prefix caching off: requests 1 .. NUM_TIMED - 1


@pytest.fixture(scope="module")
def shared_prefix(default_model, austen) -> SharedPrefixRuns:
    """Request 0 runs alone first (so its prompt blocks are cached); then requests 1..7 arrive together
    (their time to first token is compared), then the other 24."""
    tok = default_model.tokenizer
    system = tok.encode(austen[:12000])[:SYSTEM_TOKENS]
    prompts = [system + tok.encode(f"\n\nAnswer briefly. {q}\nAnswer:") for q in QUESTIONS]
    config = dict(kv_cache_memory=400 * _block_bytes(default_model), swap_space=0)

    cached = Run(LLMEngine(EngineConfig(**config), loaded=default_model))
    for group in ([0], range(1, NUM_TIMED), range(NUM_TIMED, NUM_SHARED)):
        for i in group:
            cached.engine.add_request(prompts[i], ONE_TOKEN, str(i))
        cached.drain()

    # Without a prefix cache the lone first request leaves nothing behind, so it is skipped.
    uncached = Run(LLMEngine(EngineConfig(**config, enable_prefix_caching=False), loaded=default_model))
    for i in range(1, NUM_TIMED):
        uncached.engine.add_request(prompts[i], ONE_TOKEN, str(i))
    uncached.drain()
    return SharedPrefixRuns(prompts, cached, uncached)


def test_shared_system_prompt_hit_rate(shared_prefix):
    prompts, engine = shared_prefix.prompts, shared_prefix.cached.engine
    # Every later request hits the full blocks it shares with an earlier, finished one (they are all
    # still cached: the pool has room for every prompt); a hit never covers a prompt's last token.
    expected_hits = []
    for j in range(1, NUM_SHARED):
        earlier = range(j) if j >= NUM_TIMED else [0]  # requests 1..7 ran together, after request 0 only
        shared = max(_common_prefix(prompts[j], prompts[i]) for i in earlier)
        expected_hits.append(min(shared, len(prompts[j]) - 1) // BLOCK_SIZE * BLOCK_SIZE)
    usage = engine.kv_usage()
    total = sum(len(p) for p in prompts)
    assert usage.prefix_query_tokens == total
    assert usage.prefix_hit_tokens == sum(expected_hits)
    for j, hit in zip(range(1, NUM_SHARED), expected_hits, strict=True):
        assert shared_prefix.cached.outputs[str(j)].num_cached_tokens == hit
    assert shared_prefix.cached.outputs["0"].num_cached_tokens == 0
    # Approximately (32 - 1) requests x floor(common / 16) blocks x 16 tokens out of 32 x ~1515 tokens,
    # where the common prefix is the 1,500-token system prompt plus the instruction after it.
    common = min(_common_prefix(prompts[0], p) for p in prompts[1:])
    assert common >= SYSTEM_TOKENS
    approx = (NUM_SHARED - 1) * (common // BLOCK_SIZE) * BLOCK_SIZE / total
    assert approx > 0.9
    assert usage.prefix_hit_rate == pytest.approx(approx, abs=0.01)
    assert shared_prefix.uncached.engine.kv_usage().prefix_hit_tokens == 0


def _mean_ttft(run: Run, request_ids: range) -> float:
    times = [run.outputs[str(i)].metrics for i in request_ids]
    return sum(m["first_token_time"] - m["arrival_time"] for m in times) / len(times)


def test_shared_system_prompt_time_to_first_token(shared_prefix):
    timed = range(1, NUM_TIMED)
    for run in (shared_prefix.cached, shared_prefix.uncached):
        assert all(run.outputs[str(i)].metrics["first_token_time"] > 0 for i in timed)
    with_cache = _mean_ttft(shared_prefix.cached, timed)
    without = _mean_ttft(shared_prefix.uncached, timed)
    assert with_cache < without, (with_cache, without)


# ----- 4. seeded parallel samples, 5. chat (through the offline LLM API) -----


@pytest.fixture(scope="module")
def llm(default_model) -> LLM:
    """``LLM`` with its engine built on the session's loaded model instead of loading it again."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kvserve.entrypoints.llm, "LLMEngine", lambda config: LLMEngine(config, loaded=default_model))
        return LLM(kv_cache_memory="64MiB", swap_space=0)


def test_seeded_parallel_samples_differ_and_reproduce(llm):
    prompt = "Write a short poem about the sea:"
    params = SamplingParams(n=2, temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    assert len(first.outputs) == 2
    a, b = (c.token_ids for c in first.outputs)
    assert len(a) == len(b) == 16
    assert a != b
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [a, b]
    assert [c.text for c in again.outputs] == [c.text for c in first.outputs]
    # The seed makes the request reproducible whatever else shares the batch.
    other = SamplingParams(temperature=1.0, max_tokens=16)
    mixed = llm.generate(["Tell me a joke.", prompt], [other, params], use_tqdm=False)[1]
    assert [c.token_ids for c in mixed.outputs] == [a, b]


def test_chat_answers_capital_of_france(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    output = llm.chat(messages, SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)[0]
    assert "Paris" in output.outputs[0].text
    assert output.finished
