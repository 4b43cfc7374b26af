"""OpenAI's request and response shapes (with vLLM's extra sampling fields), as pydantic models.

A request body's fields are the declared ones; any other is a 400 naming it, unless it only carries
metadata or asks for nothing (``server/fields.py``). A known field of the wrong type fails validation,
which the API turns into a 400 naming the field. Types are strict, as OpenAI's are: ``"max_tokens": "10"``
or ``"n": 2.0`` is an error, not a number (an integer is a fine float). Ranges are checked by
``SamplingParams`` itself.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvserve.server.fields import drop_ignorable

MAX_TOP_LOGPROBS = 20


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class _Body(_Request):
    """A request body (or an options object in one): a field it does not declare is refused (``server/fields.py``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_ignorable(cls, data: Any) -> Any:
        return drop_ignorable(data, cls.model_fields) if isinstance(data, dict) else data


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM extra: with include_usage, every chunk carries the usage so far


class JsonSchemaFormat(_Body):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` or not, the output matches it)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Body):
    """Fields both endpoints share: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM extras
    prompt_logprobs: int | None = None  # each prompt token's logprob and this many alternatives (not streamed)
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids (as JSON keys) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (server/truncation.py)
    # structured output (server/guided.py): OpenAI's response_format, or one of vLLM's guided_* fields
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0
    cache_salt: str | None = None  # prefix-cache blocks are shared only among requests of one salt (isolation.py)
    # kvserve extras: this request's KV policy (the engine must run with per-layer KV groups)
    kv_policy: str | None = None
    kv_budget: float | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: the usage so far in every chunk (only with ``include_usage``)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str | list[int]]  # a mix of texts and token lists is fine too
    max_tokens: int = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    add_special_tokens: bool = True  # vLLM extra: the tokenizer's BOS in front of a text prompt


class FunctionDefinition(_Body):
    """A tool's function: its ``parameters`` are a JSON schema for the arguments (none: any object)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: this function must be called."""

    type: Literal["function"]
    function: NamedFunction


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class MessageToolCall(_Request):
    """A tool call in an assistant message the client sends back (OpenAI's shape)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True  # vLLM extra
    echo: bool = False  # vLLM extra: the last message's content before the reply, when it has the reply's role
    # tool calling (server/tools.py)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(_Body):
    """``POST /tokenize`` (vLLM's shape): a ``prompt``, or chat ``messages`` through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True  # messages only
    tools: list[ChatTool] | None = None  # messages only: rendered as chat completions render them
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages (the template adds BOS)
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    """``POST /detokenize`` (vLLM's shape)."""

    model: str | None = None
    tokens: list[int]


# ----- responses -----


class SchemaRequest(_Body):
    """``POST /v1/schemas``: a Prompt Cache schema in PML."""

    pml: str


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache or Prompt Cache modules


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> UsageInfo:
        details = PromptTokensDetails(cached_tokens=cached)
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=details,
        )


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob``: one token's logprob at a prompt position, its rank in the vocabulary (1: the most
    likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's ``prompt_logprobs``: None for the first token, then per prompt token its id (a JSON key) and the top ones.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionResponseChoice(CompletionChoice):
    prompt_logprobs: PromptLogprobs | None = None  # not in stream chunks, as vLLM


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM puts the chat prompt's here, not in a choice


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed tool call: ``id``, ``type`` and the name come in its first chunk, then argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    """A completions stream chunk has the same shape as the full response."""

    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # the tokenizer's own spelling of each token (``Ġthe``)


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "kvserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
