"""What ``kvserve generate`` shows: the text streamed to stdout, uncut by log lines, then a summary on stderr.

Log lines that come while the text streams are held and written after its final newline; the engine is
built (and logs its KV cache) before the first character. The summary is one log line with the request's
own timings, as llama.cpp prints its timings after the text.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TextIO

from kvserve.config import EngineConfig
from kvserve.core.outputs import RequestOutput
from kvserve.entrypoints.generation import GenerationOutput
from kvserve.log import logs_held
from kvserve.models.loader import LoadedModel
from kvserve.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerationSummary:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from a cache (prefix cache, Prompt Cache modules)
    generated_tokens: int
    metrics: Mapping[str, float]  # time.monotonic() of arrival_time, first_token_time, finish_time
    prefill: str = ""  # where the prompt was prefilled, when a parallel prefill was asked for

    @classmethod
    def of_request(cls, output: RequestOutput, prefill: str = "") -> GenerationSummary:
        generated = len(output.outputs[0].token_ids)
        return cls(len(output.prompt_token_ids), output.num_cached_tokens, generated, output.metrics, prefill)

    @classmethod
    def of_generation(cls, output: GenerationOutput) -> GenerationSummary:
        return cls(len(output.prompt_token_ids), 0, len(output.token_ids), output.metrics)

    def line(self) -> str:
        m = self.metrics
        ttft = m["first_token_time"] - m["arrival_time"]
        decode = m["finish_time"] - m["first_token_time"]
        computed = self.prompt_tokens - self.cached_tokens
        parts = [
            f"prompt {self.prompt_tokens} tokens ({self.cached_tokens} cached), TTFT {ttft * 1000:.0f} ms, "
            f"{_rate(computed, ttft)} prompt tokens/s",
            # The first token comes with the prompt; decode is the rest.
            f"generated {self.generated_tokens} tokens, {_rate(self.generated_tokens - 1, decode)} decode tokens/s",
        ]
        return "; ".join(parts + ([self.prefill] if self.prefill else []))


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f}" if tokens > 0 and seconds > 0 else "-"


def print_stream(deltas: Iterable[str], echo: str, out: TextIO) -> None:
    """``echo`` (the prompt, or ""), then each text delta as it comes, then a newline; log lines meanwhile wait."""
    with logs_held():
        out.write(echo)
        out.flush()
        for delta in deltas:
            out.write(delta)
            out.flush()
        out.write("\n")
        out.flush()


class EngineStream:
    """One request through the paged engine (a parallel prefill, a KV policy or offloading, Prompt Cache), as
    text deltas. The engine is built on construction, so its start-up log lines come before any text;
    ``with`` closes it."""

    def __init__(
        self, loaded: LoadedModel, config: EngineConfig, schemas: list[str], prompt: str | list[int],
        params: SamplingParams,
    ) -> None:  # fmt: skip
        from kvserve.core.engine import LLMEngine
        from kvserve.entrypoints.engine_args import register_schemas

        self.engine = LLMEngine(config, loaded)
        self.output: RequestOutput | None = None
        try:
            register_schemas(self.engine, schemas)
            self.engine.add_request(prompt, params, add_special_tokens=isinstance(prompt, str))
        except Exception:
            self.engine.close()
            raise

    def __iter__(self) -> Iterator[str]:
        shown = 0
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                self.output = output
                text = output.outputs[0].text
                yield text[shown:]
                shown = len(text)

    def summary(self) -> GenerationSummary:
        return GenerationSummary.of_request(self.output, self._prefill_route())

    def _prefill_route(self) -> str:
        """Where the prompt was prefilled, when more than one process was asked for."""
        parallel = self.engine.parallel_prefill
        if parallel is None:
            return ""
        if parallel.last_route is not None:
            return parallel.last_route.describe()
        if self.output.num_cached_tokens:
            return "prefill in this process: part of the prompt was cached"
        return "prefill in this process: the prompt did not run as one whole step"

    def __enter__(self) -> EngineStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.engine.close()
