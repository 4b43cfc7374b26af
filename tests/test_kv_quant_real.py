"""The int8 and int4 KV cache on the shipped models (SmolLM2 and Gemma 3 with its sliding-window groups): the
prompt's log-likelihood close to the model-dtype cache's, read through the quantized cache in chunks, and greedy
text that follows the model-dtype cache's for most of its length."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.eval.data import TEXTS

pytestmark = pytest.mark.real_model


@pytest.mark.parametrize("model", [None, "gemma3-270m"])
def test_quantized_cache_keeps_the_likelihood_and_the_greedy_text(shared_real_loads, model) -> None:
    text = TEXTS["wikitext-2"].read_text(encoding="utf-8")[5000:9000]
    params = SamplingParams(temperature=0, max_tokens=32, prompt_logprobs=0, ignore_eos=True)
    results = {}
    for kv_cache_dtype in ("auto", "int8", "int4"):
        llm = LLM(model=model, kv_cache_dtype=kv_cache_dtype, kv_cache_memory="64MiB", max_num_batched_tokens=128,
                  swap_space=0)  # fmt: skip
        ids = llm.engine.tokenizer.encode(text)[:400]  # four chunks of prefill over the cache, then decode
        (out,) = llm.generate([ids], params, use_tqdm=False)
        logprobs = torch.tensor([step[t] for step, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)])
        results[kv_cache_dtype] = logprobs, out.outputs[0].token_ids
        llm.close()
    base_logprobs, base_tokens = results["auto"]
    nll = -base_logprobs.mean()
    for name, bound in (("int8", 0.005), ("int4", 0.08)):  # relative change of the mean NLL
        logprobs, tokens = results[name]
        assert abs(-logprobs.mean() - nll) / nll < bound, name
    assert results["int8"][1][:8] == base_tokens[:8]  # greedy text parts later (Gemma 3: after 15 tokens, AMD EPYC)
