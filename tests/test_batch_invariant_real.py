"""The batch-invariant mode on the real default model (SmolLM2-135M-Instruct, Q4_1, bfloat16).

Twelve greedy prompts of different lengths run concurrently, and three prompts whose first blocks come from
the prefix cache, give exactly the tokens and logprobs each prompt gets alone; the default mode does not (its
int4 kernel serves up to 3 rows and a bfloat16 copy more, and its attention follows the batch), except that its
prefix-cache hits equal misses where the bfloat16 prefill kernel runs. The same
holds through the HTTP server: concurrent completions equal the same requests sent one at a time, and the
offline engine's numbers.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvserve.attention.flash_prefill import flash_prefill_available
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.entrypoints.llm import LLM
from kvserve.models import LoadedModel
from kvserve.sampling.sampling_params import SamplingParams
from tests.real_models import shared_load
from tests.server.conftest import start_server

pytestmark = pytest.mark.real_model

TEXTS = [
    "The capital of France is",
    "Once upon a time, in a village at the edge of a great forest, there lived",
    "def fibonacci(n):\n    ",
    "A list of five fruits: apple,",
    "The three laws of thermodynamics say that energy is conserved, that entropy grows, and",
    "Dear Sir, I write to you regarding the",
    "In 1969 the first people walked on",
    "Water boils at a temperature of",
    "The quick brown fox",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make their own "
    "food. In the leaves, chlorophyll captures light, and the energy is used to split water molecules. Oxygen "
    "is released as a by-product, while the hydrogen is combined with carbon dioxide to form",
    "Question: what is 12 times 12? Answer:",
    "To make a cup of tea, first",
]
SHARED = (
    "You are a helpful assistant who answers questions about geography in one short sentence. Keep your answers "
    "accurate and friendly, and say so when you do not know. Here is the question:"
)
QUESTIONS = [" Where is Peru?", " What is the longest river in Africa and which countries does it cross?", " Why?"]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def invariant_model() -> LoadedModel:
    return shared_load(dtype=torch.bfloat16, batch_invariant=True)


@pytest.fixture(scope="module")
def default_bf16_model() -> LoadedModel:
    return shared_load(dtype=torch.bfloat16)


def engine(loaded: LoadedModel, **options) -> LLMEngine:
    config = EngineConfig(dtype="bfloat16", kv_cache_memory="96MiB", swap_space=0, **options)
    return LLMEngine(config, loaded)


def numbers(outputs) -> list[tuple[list[int], list]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def concurrent_and_alone(loaded: LoadedModel, batch_invariant: bool) -> dict[str, list]:
    """Numbers of the prompts run together (and as prefix-cache hits) and each alone."""
    tok = loaded.tokenizer
    prompts = [tok.encode(t) for t in TEXTS]
    shared = tok.encode(SHARED)
    cached = [shared + tok.encode(q, add_special_tokens=False) for q in QUESTIONS]
    together = LLM.from_engine(engine(loaded, batch_invariant=batch_invariant))
    solo = LLM.from_engine(engine(loaded, batch_invariant=batch_invariant, enable_prefix_caching=False))
    together.generate([shared], SamplingParams(max_tokens=1), use_tqdm=False)  # fills the prefix cache
    return {
        "concurrent": numbers(together.generate(prompts, GREEDY, use_tqdm=False)),
        "alone": [numbers(solo.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts],
        "hits": numbers(together.generate(cached, GREEDY, use_tqdm=False)),
        "misses": [numbers(solo.generate([p], GREEDY, use_tqdm=False))[0] for p in cached],
    }


def test_concurrent_and_cached_prompts_get_their_numbers_alone(invariant_model) -> None:
    got = concurrent_and_alone(invariant_model, batch_invariant=True)
    assert len(set(map(len, (t for t, _ in got["concurrent"])))) == 1  # every prompt made its 8 tokens
    assert got["concurrent"] == got["alone"]
    assert got["hits"] == got["misses"]


def test_the_default_gives_other_numbers_in_a_batch(default_bf16_model) -> None:
    """Measured: every prompt's logprobs differ in their last bits, a third of the greedy tokens differ. Prefix-cache
    hits equal misses where kvserve's bfloat16 prefill kernel runs (a query row meets the same key blocks in the
    same order however the keys split between cache and step), not where torch's kernel merges two calls."""
    got = concurrent_and_alone(default_bf16_model, batch_invariant=False)
    assert got["concurrent"] != got["alone"]
    if flash_prefill_available():
        assert got["hits"] == got["misses"]
    else:
        assert got["hits"] != got["misses"]


def test_http_completions_match_their_single_runs_and_the_offline_engine(invariant_model) -> None:
    name = "SmolLM2-135M-Instruct"
    running = start_server(engine(invariant_model, batch_invariant=True), name=name)
    try:
        client = running.client(timeout=120)

        def complete(prompt: str) -> tuple[str, list[float]]:
            choice = client.completions.create(
                model=name, prompt=prompt, max_tokens=8, temperature=0, logprobs=1, extra_body={"ignore_eos": True}
            ).choices[0]
            return choice.text, choice.logprobs.token_logprobs

        with ThreadPoolExecutor(len(TEXTS)) as pool:
            concurrent = list(pool.map(complete, TEXTS))
        alone = [complete(text) for text in TEXTS]
    finally:
        running.stop()
    assert concurrent == alone
    offline = LLM.from_engine(engine(invariant_model, batch_invariant=True))
    for text, (_, logprobs) in zip(TEXTS, alone, strict=True):
        (out,) = offline.generate([text], GREEDY, use_tqdm=False)
        assert [lp[t] for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids, strict=True)] == logprobs
