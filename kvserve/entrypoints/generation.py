"""Single-request generation over a contiguous KV cache: prefill once, then decode token by token.

This is the foundation's generation loop (and the reference the paged engine is checked against):
one sequence, explicit positions, the contiguous attention backend, the sampler and incremental
detokenisation with stop strings.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kvserve.attention import AttentionMetadata, ContiguousKVCache
from kvserve.models.loader import LoadedModel
from kvserve.sampling.sampler import make_generator, sample
from kvserve.sampling.sampling_params import SamplingParams
from kvserve.sampling.stopping import find_stop, partial_stop_len
from kvserve.text.detokenizer import IncrementalDetokenizer


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" (EOS or stop string/token) or "length"
    # time.monotonic() of arrival, first token and finish, as in the engine's RequestOutput.metrics
    metrics: dict[str, float] = field(default_factory=lambda: {"arrival_time": time.monotonic()})


class Generator:
    def __init__(self, loaded: LoadedModel, device: torch.device | str = "cpu") -> None:
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.config = loaded.config
        self.dtype = loaded.dtype
        self.device = torch.device(device)

    def generate(self, prompt: str | Sequence[int], params: SamplingParams) -> GenerationOutput:
        stream = self.stream(prompt, params)
        for _ in stream:
            pass
        return stream.output

    def stream(self, prompt: str | Sequence[int], params: SamplingParams) -> GenerationStream:
        """Iterate for text deltas; ``.output`` holds the whole result once the iteration ends."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        limit = self.config.max_position_embeddings
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= limit:
            raise ValueError(f"the prompt has {len(ids)} tokens; the model's context is {limit} tokens")
        return GenerationStream(self, ids, params)

    @torch.inference_mode()
    def forward_last(self, cache: ContiguousKVCache, ids: Sequence[int], start: int) -> torch.Tensor:
        """Run ``ids`` at positions start.. and return the float32 logits (vocab,) of the last one."""
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(ids), device=self.device)
        cfg = self.model.config
        metadata = AttentionMetadata(
            (0,), (len(ids),), (start,), layer_windows=cfg.layer_windows, softcap=cfg.attention_softcap
        )
        hidden = self.model(input_ids, positions, cache, metadata)
        return self.model.compute_logits(hidden[-1:])[0]


class GenerationStream:
    """Iterator of text deltas for one request; stops on EOS, stop token, stop string or length."""

    def __init__(self, generator: Generator, prompt_ids: list[int], params: SamplingParams) -> None:
        self.generator = generator
        self.params = params
        self.output = GenerationOutput(prompt_token_ids=prompt_ids)
        context = generator.config.max_position_embeddings
        self.max_new = min(params.max_tokens, context - len(prompt_ids))
        self.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids |= set(generator.tokenizer.eos_token_ids)

    def __iter__(self) -> Iterator[str]:
        gen, params, out = self.generator, self.params, self.output
        cfg = gen.config
        cache = ContiguousKVCache(
            cfg.num_layers,
            1,
            cfg.num_kv_heads,
            cfg.head_dim,
            len(out.prompt_token_ids) + self.max_new,
            gen.dtype,
            gen.device,
        )
        rng = make_generator(params, gen.device)
        detok = IncrementalDetokenizer(gen.tokenizer, out.prompt_token_ids)
        logits = gen.forward_last(cache, out.prompt_token_ids, 0)
        emitted = 0  # characters of out.text already yielded
        while True:
            token = sample(logits, params, rng)
            out.token_ids.append(token)
            out.metrics.setdefault("first_token_time", time.monotonic())
            if token in self.stop_ids:
                out.finish_reason = "stop"
            else:
                searched = len(out.text)
                out.text += detok.step(token)
                stop = find_stop(out.text, params.stop, searched)
                if stop is not None:
                    out.text = out.text[: stop[0]]
                    out.finish_reason = "stop"
                elif len(out.token_ids) >= self.max_new:
                    out.finish_reason = "length"
            if out.finish_reason:
                out.metrics["finish_time"] = time.monotonic()
            # Hold back a tail that could still grow into a stop string.
            safe = len(out.text) if out.finish_reason else len(out.text) - partial_stop_len(out.text, params.stop)
            if safe > emitted:
                yield out.text[emitted:safe]
                emitted = safe
            if out.finish_reason:
                return
            position = len(out.prompt_token_ids) + len(out.token_ids) - 1
            logits = gen.forward_last(cache, [token], position)
