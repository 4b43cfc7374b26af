"""The offline API, shaped like vLLM's: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.core.outputs import RequestOutput
from kvserve.sampling.sampling_params import SamplingParams
from kvserve.text.prompts import Prompt, parse_prompts
from kvserve.text.tool_prompt import chat_prompt

Message = dict  # {"role", "content"}, and "tool_calls" / "tool_call_id" for tool turns


class LLM:
    """Loads a model once and runs batches of prompts through the paged engine.

    Keyword arguments are ``EngineConfig`` fields: ``model`` (a path, a shipped model's name or a Hugging Face
    name in the local cache), ``tokenizer`` and ``chat_template`` (instead of the model's: a tokenizer folder,
    tokenizer.json or GGUF; a Jinja file or template), ``dtype``, ``device``, ``weights``,
    ``kv_cache_memory``, ``swap_space``, ``block_size``, ``enable_prefix_caching``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``preemption_mode``, ``max_model_len``, ``batch_invariant``
    (a prompt's tokens and logprobs do not depend on what runs beside it or on the prefix cache; slower),
    ``int8_activations`` (float32 models: the 4-bit projections and a Q8_0 head round their activations to int8;
    faster, lossy).

    ``close()`` (or leaving ``with LLM(...) as llm:``) stops parallel prefill workers and offloading
    threads at once rather than at exit, and lets another ``LLM`` with ``prefill_parallel`` start in
    this process.
    """

    def __init__(self, model: str | None = None, **engine_options: object) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an engine that is already built (the CLI's, an eval's) instead of loading another."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def close(self) -> None:
        """Release the engine's prefill workers, process group and threads (``LLMEngine.close``); idempotent."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_tokenizer(self):  # noqa: ANN201 - kvserve.text.tokenizer.Tokenizer
        return self.engine.tokenizer

    def register_schema(self, pml_text: str) -> dict:
        """Register a Prompt Cache schema (PML); ``generate`` then accepts ``<prompt schema=...>`` prompts that
        import its modules. Returns the schema's layout: each module's positions, tokens and parameters. With
        ``prompt_cache_encode="eager"`` (the default) the modules are encoded before it returns."""
        name = self.engine.register_schema(pml_text)["name"]
        self.engine.encode_modules()
        return self.engine.prompt_cache.info(name).to_dict()

    def delete_schema(self, name: str) -> None:
        """Forget a schema and evict its modules' KV (requests using them keep it until they finish)."""
        self.engine.prompt_cache.remove(name)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in prompt order. A prompt is text, a list of token ids, vLLM's
        ``{"prompt": text}`` or ``{"prompt_token_ids": [...]}`` (either with a ``"cache_salt"``: prefix-cache
        blocks are shared only among prompts of the same salt), or a PML prompt (text starting with
        ``<prompt schema=...>``) over a registered schema."""
        return self._run([(p.prompt, True, p.cache_salt) for p in parse_prompts(prompts)], sampling_params, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tools: Sequence[dict] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of messages) or several. ``tools``
        (OpenAI's function tools) reach the template as Hugging Face passes them, or as Hermes-style text for a
        template that renders none (``kvserve/text/tool_prompt.py``); the output is the model's text, calls included."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts = [
            (tokenizer.encode(chat_prompt(tokenizer, conversation, True, tools), add_special_tokens=False), False, None)
            for conversation in conversations
        ]
        return self._run(prompts, sampling_params, use_tqdm)

    def _run(
        self,
        prompts: list[tuple[Prompt, bool, str | None]],  # (prompt, add special tokens, cache salt)
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        params = _params_per_prompt(sampling_params, len(prompts))
        ids = [
            self.engine.add_request(prompt, p, add_special_tokens=special, cache_salt=salt)
            for (prompt, special, salt), p in zip(prompts, params, strict=True)
        ]
        results: dict[str, RequestOutput] = {}
        progress = _progress_bar(len(ids), use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
        finally:
            if progress is not None:
                progress.close()
            for request_id in ids:
                if request_id not in results:
                    self.engine.abort_request(request_id)  # interrupted: leave nothing queued
        return [results[request_id] for request_id in ids]


def _params_per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    if len(sampling_params) != count:
        raise ValueError(f"got {len(sampling_params)} SamplingParams for {count} prompts")
    return list(sampling_params)


def _progress_bar(total: int, enabled: bool):  # noqa: ANN202 - tqdm or None
    if not enabled or total < 2:
        return None
    from tqdm import tqdm

    # disable=None: no bar where stderr is not a terminal (a log would get every redrawn frame).
    return tqdm(total=total, desc="Processed prompts", unit="req", file=sys.stderr, dynamic_ncols=True, disable=None)
