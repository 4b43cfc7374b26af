"""What a user may ask of sampling, validated on construction (vLLM's ``SamplingParams`` shape)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.policies import make_policy

if TYPE_CHECKING:  # xgrammar (and the transformers it imports) loads only when a request is guided
    from kvserve.structured.params import GuidedDecodingParams

MAX_LOGPROBS = 20
MAX_N = 64
# Stop strings are matched on the engine thread at every token of every sequence, so one request's list
# costs every request time. OpenAI and TGI allow 4; 16 leaves room for evaluation harnesses and agent
# frameworks that send more, and 256 characters holds any delimiter line (streaming holds back up to
# that much text while it might still become a stop string).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


@dataclass
class SamplingParams:
    """Sampling options for one request.

    ``temperature == 0`` is greedy decoding. ``top_k == -1``, ``top_p == 1`` and ``min_p == 0``
    disable those filters. ``seed`` makes a sampled request reproducible on its own, whatever else
    runs in the batch. ``n`` samples share the prompt's KV blocks; with ``use_beam_search`` the
    ``n`` best of ``best_of`` beams come back. ``logprobs``/``prompt_logprobs`` ask for that many
    most likely tokens (plus the chosen one) at each generated / prompt position.
    """

    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # keep the stop string that ended a sequence at its text's end
    min_tokens: int = 0  # stop tokens (EOS, stop_token_ids) and stop strings take effect only after this many
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's: -100 bans, 100 forces)
    allowed_token_ids: list[int] | None = None  # sample only among these tokens
    guided_decoding: GuidedDecodingParams | None = None  # structured output: JSON schema, regex, choice, grammar
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    kv_policy: str | None = None  # override the engine's KV policy for this request (pyramid, snapkv, adakv, ...)
    kv_budget: float | None = None  # and/or its budget (fraction of the full cache kept)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.best_of is None:
            self.best_of = self.n
        _check_int("n", self.n, 1, MAX_N)
        _check_int("best_of", self.best_of, self.n, MAX_N)
        _check_int("max_tokens", self.max_tokens, 1, None)
        if not self.temperature >= 0 or math.isinf(self.temperature):  # also rejects NaN
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0, MAX_LOGPROBS)
        self._check_stop()
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        self._check_token_choice()
        self._check_guided()
        if self.use_beam_search:
            self._check_beam_search()
        if self.kv_budget is not None and not 0 < self.kv_budget <= 1:
            raise ValueError(f"kv_budget must be in (0, 1], got {self.kv_budget!r}")
        if self.kv_policy is not None:
            make_policy(self.kv_policy, self.kv_budget)  # names the valid policies, checks the pair

    def _check_stop(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")
        longest = max(self.stop, key=len, default="")
        if len(longest) > MAX_STOP_CHARS:
            raise ValueError(
                f"stop strings may be at most {MAX_STOP_CHARS} characters long; one has {len(longest)} "
                f"({longest[:20]!r}...)"
            )

    def _check_token_choice(self) -> None:
        for token_id, bias in (self.logit_bias or {}).items():
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
            if not -100 <= bias <= 100:  # also rejects NaN
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}")
        allowed = self.allowed_token_ids
        if allowed is not None and (not allowed or any(not isinstance(i, int) or i < 0 for i in allowed)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {allowed!r}")
        if allowed is not None:
            self.allowed_token_ids = sorted(set(allowed))  # each id once, whatever the client repeated

    def _check_guided(self) -> None:
        if self.guided_decoding is None:
            return
        from kvserve.structured.params import GuidedDecodingParams

        if not isinstance(self.guided_decoding, GuidedDecodingParams):
            kind = type(self.guided_decoding).__name__
            raise ValueError(f"guided_decoding must be a GuidedDecodingParams, got {kind}")
        if self.use_beam_search:
            raise ValueError("guided_decoding applies to sampled sequences, not to beam search")

    def _check_beam_search(self) -> None:
        if self.best_of < 2:
            raise ValueError(f"beam search needs best_of >= 2 beams, got best_of={self.best_of}")
        if self.temperature != 0 or self.top_p != 1 or self.top_k != -1 or self.min_p != 0:
            raise ValueError("beam search is deterministic: temperature must be 0 and top_p/top_k/min_p disabled")
        for name in ("min_tokens", "logit_bias", "allowed_token_ids"):
            if getattr(self, name):
                raise ValueError(f"{name} applies to sampled sequences, not to beam search, got {getattr(self, name)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def _check_int(name: str, value: object, low: int, high: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
