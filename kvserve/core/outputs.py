"""What a request returns, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per generated token: top tokens -> logprob
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" (RequestOutput.error says why)
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, first token and finish times
    # With prompt_logprobs: each prompt token's rank in the vocabulary (1: the most likely; None for the first).
    prompt_token_ranks: list[int | None] | None = None
    error: str | None = None  # why the request failed (finish_reason "error"): a KV tier fault, for one
