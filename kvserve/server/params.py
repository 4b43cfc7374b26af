"""Request body -> ``SamplingParams``, with each ``ValueError`` turned into a 400 that names the field."""

from __future__ import annotations

from kvserve.sampling.sampling_params import SamplingParams
from kvserve.server.errors import ApiError, bad_request
from kvserve.server.guided import guided_params
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from kvserve.structured import GuidedDecodingParams

_FIELDS = (
    "n", "best_of", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "logprobs", "prompt_logprobs", "seed", "stop", "kv_policy",
    "kv_budget", "min_tokens", "logit_bias", "allowed_token_ids",
)  # fmt: skip
_STRUCTURED = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


def completion_params(body: CompletionRequest, max_num_seqs: int) -> SamplingParams:
    """The engine computes the prompt's logprobs for ``echo`` with ``logprobs``, and for ``prompt_logprobs``: the
    larger count serves both."""
    prompt_logprobs, renames = (body.logprobs if body.echo else None), {"prompt_logprobs": "logprobs"}
    asked = _prompt_logprobs(body)
    if asked is not None and (prompt_logprobs is None or not 0 <= asked <= prompt_logprobs):
        prompt_logprobs, renames = asked, {}
    return _build(body, body.max_tokens, body.logprobs, prompt_logprobs, renames, max_num_seqs)


def chat_params(
    body: ChatCompletionRequest,
    prompt_len: int,
    max_model_len: int,
    max_num_seqs: int,
    guided: GuidedDecodingParams | None = None,
) -> SamplingParams:
    """``guided``: the constraint a tool choice sets (``server/tools.py``), instead of the body's fields."""
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:  # as OpenAI and vLLM: up to the end of the context
        max_tokens = max(1, max_model_len - prompt_len)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    renames = {"max_tokens": field, "logprobs": "top_logprobs"}
    return _build(body, max_tokens, logprobs, _prompt_logprobs(body), renames, max_num_seqs, guided)


def _prompt_logprobs(body: _SamplingFields) -> int | None:
    """vLLM's ``prompt_logprobs`` come in the whole response only: refused with ``stream`` (0 asks for no
    alternatives, and a stream gets nothing, as from vLLM)."""
    if body.stream and body.prompt_logprobs is not None and body.prompt_logprobs > 0:
        raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    return None if body.stream and body.prompt_logprobs == 0 else body.prompt_logprobs


def _build(
    body: _SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None,
    renames: dict[str, str],
    max_num_seqs: int,
    guided: GuidedDecodingParams | None = None,
) -> SamplingParams:
    if body.seed is not None and not _SEED_RANGE[0] <= body.seed <= _SEED_RANGE[1]:
        raise bad_request(f"seed must be a 64-bit integer, got {body.seed}", "seed")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    guided = guided or guided_params(body)
    try:
        params = SamplingParams(
            n=body.n,
            best_of=body.best_of,
            use_beam_search=body.use_beam_search,
            length_penalty=body.length_penalty,
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            seed=body.seed,
            stop=stop,
            stop_token_ids=list(body.stop_token_ids or []),
            include_stop_str_in_output=body.include_stop_str_in_output,
            min_tokens=body.min_tokens,
            logit_bias=_logit_bias(body.logit_bias),
            allowed_token_ids=body.allowed_token_ids,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            kv_policy=body.kv_policy,
            kv_budget=body.kv_budget,
            guided_decoding=guided,
        )
    except ValueError as exc:
        raise _named(str(exc), body, renames) from None
    if params.best_of > max_num_seqs:
        param = "best_of" if body.best_of is not None else "n"
        raise bad_request(
            f"{param}={params.best_of} sequences can never run side by side: the server runs at most "
            f"{max_num_seqs} sequences at once (--max-num-seqs)",
            param,
        )
    if body.stream and (params.best_of > params.n or params.use_beam_search):
        param = "use_beam_search" if params.use_beam_search else "best_of"
        raise bad_request(f"{param} cannot be streamed: the best sequences are only known at the end", param)
    return params


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    """JSON object keys are strings: ``{"1234": -100}`` -> ``{1234: -100.0}``."""
    bad = [key for key in raw or () if not (key.isascii() and key.isdigit())]
    if bad:
        raise bad_request(f"logit_bias keys must be token ids (integers >= 0), got {bad[0]!r}", "logit_bias")
    return {int(key): bias for key, bias in raw.items()} if raw else None


def _named(message: str, body: _SamplingFields, renames: dict[str, str]) -> ApiError:
    """A 400 for a ``SamplingParams`` error; its message starts with the field's name."""
    first = message.split(" ", 1)[0]
    if first in _FIELDS:
        param = renames.get(first, first)
        if param != first:
            message = param + message[len(first) :]
        return bad_request(message, param)
    if message.startswith("guided_decoding"):
        return bad_request(message, next((f for f in _STRUCTURED if getattr(body, f) is not None), "tool_choice"))
    if message.startswith("beam search"):
        return bad_request(message, "use_beam_search")
    return bad_request(message)
