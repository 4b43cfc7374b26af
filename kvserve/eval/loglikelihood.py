"""Log-likelihood of a continuation given a context, scored through the paged engine's prompt logprobs.

Every likelihood-based eval (perplexity, multiple choice, LAMBADA) goes through ``Scorer``, so it
measures whatever the engine is configured to do (dtype, KV policy, cache sizes). The transformers
reference in ``hf_reference.py`` implements the same interface for the cross-check.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvserve.core.engine import LLMEngine
from kvserve.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class LoglikelihoodRequest:
    context: tuple[int, ...]  # at least one token: the first token of a sequence has no prediction
    continuation: tuple[int, ...]  # the tokens scored

    def __post_init__(self) -> None:
        if not self.context or not self.continuation:
            raise ValueError(
                f"a log-likelihood request needs a context and a continuation, got {len(self.context)} and "
                f"{len(self.continuation)} tokens"
            )


@dataclass(frozen=True)
class Loglikelihood:
    logprob: float  # sum of the continuation's token logprobs (natural log)
    is_greedy: bool  # every continuation token was the most likely one
    num_tokens: int


class Scorer(Protocol):
    name: str

    def loglikelihood(self, requests: Sequence[LoglikelihoodRequest]) -> list[Loglikelihood]: ...


class EngineScorer:
    """Runs requests through ``LLMEngine`` with ``prompt_logprobs=1``, a window of them at a time.

    The window bounds the memory of the per-token logprob entries; inside it the engine batches
    requests continuously as it would any traffic. Under a compressing KV policy the context is
    computed (and compressed, or offloaded) in steps of its own before the continuation is scored against
    it, as a question would be answered after a compressed document (``score_from``).
    """

    name = "kvserve"

    def __init__(self, engine: LLMEngine, window: int = 256, progress: bool = True) -> None:
        self.engine = engine
        self.window = window
        self.progress = progress

    def loglikelihood(self, requests: Sequence[LoglikelihoodRequest]) -> list[Loglikelihood]:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
        bar = _token_bar(requests, self.progress)
        results: list[Loglikelihood] = []
        try:
            for begin in range(0, len(requests), self.window):
                chunk = requests[begin : begin + self.window]
                ids = [
                    self.engine.add_request(
                        list(r.context + r.continuation),
                        params,
                        add_special_tokens=False,
                        score_from=len(r.context) if not self.engine.kv_policy.lossless else 0,
                    )  # fmt: skip
                    for r in chunk
                ]
                done = self._drain(ids, bar)
                results.extend(_score(r, done[i].prompt_logprobs) for r, i in zip(chunk, ids, strict=True))
        finally:
            if bar is not None:
                bar.close()
        return results

    def _drain(self, ids: list[str], bar) -> dict:  # noqa: ANN001 - tqdm or None
        done = {}
        try:
            while len(done) < len(ids):
                for output in self.engine.step():
                    if output.finished:
                        done[output.request_id] = output
                        if bar is not None:
                            bar.update(len(output.prompt_token_ids))
        finally:
            for request_id in ids:
                if request_id not in done:
                    self.engine.abort_request(request_id)
        rejected = [i for i in ids if done[i].outputs[0].stop_reason == "kv_cache_capacity"]
        if rejected:
            raise ValueError(f"{len(rejected)} sequences did not fit the KV cache; raise --kv-cache-memory")
        return done


def _score(request: LoglikelihoodRequest, entries: list[dict[int, float] | None]) -> Loglikelihood:
    """Sum the continuation's entries; a token is greedy when no other token scored higher."""
    start = len(request.context)
    total, greedy = 0.0, True
    for offset, token in enumerate(request.continuation):
        entry = entries[start + offset]
        logprob = entry[token]
        total += logprob
        greedy = greedy and logprob >= max(entry.values())
    return Loglikelihood(total, greedy, len(request.continuation))


def _token_bar(requests: Sequence[LoglikelihoodRequest], enabled: bool):  # noqa: ANN202 - tqdm or None
    if not enabled:
        return None
    from tqdm import tqdm

    total = sum(len(r.context) + len(r.continuation) for r in requests)
    return tqdm(total=total, desc="Scoring", unit="tok", unit_scale=True, file=sys.stderr, dynamic_ncols=True)
