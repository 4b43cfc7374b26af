"""Tensor parallelism on the real default model (9 query heads, 3 KV heads: size 3, one KV head per rank) in
float32: the offline API and the HTTP server, asked through the official ``openai`` client, against one
process."""

from __future__ import annotations

import pytest

from kvserve import LLM
from kvserve.sampling.sampling_params import SamplingParams
from tests.server.conftest import start_server

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden press adapted from wine making. Within fifty years",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink",  # the first's first block: a prefix hit
]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)
# A module and a question: Prompt Cache's KV sharded like any other.
SCHEMA = """<schema name="press">
  <module name="doc">Gutenberg's press used movable metal type, an oil-based ink and a screw press; it printed
  about 3,600 pages a day, against forty by hand.</module>
</schema>"""
PML = '<prompt schema="press"><doc/> How many pages a day did the press print?</prompt>'
pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("shared_real_loads")]  # size 1: the session's model
OPTIONS = dict(dtype="float32", kv_cache_memory="48MiB", max_num_batched_tokens=32)  # prompts span chunks


def _outputs(size: int, **options):
    with LLM(tensor_parallel_size=size, **{**OPTIONS, **options}) as llm:
        llm.register_schema(SCHEMA)
        # The first prompt alone, so the third (its prefix) finds its blocks cached; then the module's import.
        outputs = [
            out for batch in ([PROMPTS[0]], PROMPTS[1:], [PML]) for out in llm.generate(batch, GREEDY, use_tqdm=False)
        ]
        return outputs, llm.engine.kv_usage().prefix_hit_tokens


def _assert_same(reference, got) -> None:
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in reference]
    for a, b in zip(reference, got, strict=True):
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert list(lb.values()) == pytest.approx(list(la.values()), abs=1e-4)


@pytest.mark.parametrize("policy", ["full", "h2o"])
def test_size_3_generates_what_one_process_does(policy) -> None:
    options = {} if policy == "full" else {"kv_policy": policy, "kv_budget": 0.5}
    reference, hits = _outputs(1, **options)
    got, hits_tp = _outputs(3, **options)
    _assert_same(reference, got)
    assert got[-1].num_cached_tokens > 0  # the module was imported
    if policy == "full":
        assert hits_tp == hits > 0  # the third prompt starts with the first's blocks


def test_server_with_size_3_answers_the_openai_client_as_one_process() -> None:
    answers = {}
    for size in (1, 3):
        llm = LLM(tensor_parallel_size=size, **OPTIONS)
        server = start_server(llm.engine, name="smollm2")
        try:
            client = server.client(timeout=300)
            completion = client.completions.create(
                model="smollm2", prompt=PROMPTS[:2], max_tokens=12, temperature=0, logprobs=2
            )
            chat = client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=12, temperature=0,
            )  # fmt: skip
            answers[size] = ([c.text for c in completion.choices], chat.choices[0].message.content)
            if size == 3:
                assert server.metrics()["kvserve:tensor_parallel_up"] == 1.0
                assert server.metrics()["kvserve:tensor_parallel_size"] == 3.0
        finally:
            server.stop()
            llm.close()
    assert answers[3] == answers[1]
    assert "Paris" in answers[3][1]
