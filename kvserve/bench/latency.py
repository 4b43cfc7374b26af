"""Single-request latency: load time, prefill time, batch-1 decode speed, kvserve vs transformers.

Both engines run in this process on the same GGUF file, dtype and thread count, one after the other
(kvserve with its ``weights`` mode: native int4 or dequantised; transformers dequantises); the
figures that matter are the ratios.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.entrypoints.generation import Generator
from kvserve.models.loader import load_model
from kvserve.platform.extras import extra_imports
from kvserve.sampling.sampling_params import SamplingParams


@dataclass
class LatencyResult:
    engine: str
    load_s: float
    prefill_s: dict[int, float]  # prompt length -> seconds to the first token's logits
    decode_tokens_per_s: float


class Engine:
    """What the benchmark needs from an engine: prefill a prompt, and decode n tokens after it."""

    name: str

    def prefill(self, ids: Sequence[int]) -> None: ...

    def generate(self, ids: Sequence[int], new_tokens: int) -> None: ...


class KVServeEngine(Engine):
    name = "kvserve"

    def __init__(self, model_path: str | None, dtype: torch.dtype, weights: str = "native") -> None:
        self.loaded = load_model(model_path, dtype, weights=weights)
        self.generator = Generator(self.loaded)

    def prefill(self, ids: Sequence[int]) -> None:
        self.generate(ids, 1)

    def generate(self, ids: Sequence[int], new_tokens: int) -> None:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        out = self.generator.generate(list(ids), params)
        if len(out.token_ids) != new_tokens:  # a short run would inflate the measured speed
            raise RuntimeError(f"kvserve produced {len(out.token_ids)} tokens, expected {new_tokens}")


class TransformersEngine(Engine):
    name = "transformers"

    def __init__(self, model_path: Path, dtype: torch.dtype) -> None:
        with extra_imports("bench", "the transformers peer (--no-peer skips it)"):
            from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name, dtype=dtype)
        self.model.eval()

    def prefill(self, ids: Sequence[int]) -> None:
        self.generate(ids, 1)

    @torch.inference_mode()
    def generate(self, ids: Sequence[int], new_tokens: int) -> None:
        out = self.model.generate(
            torch.tensor([list(ids)]), do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens
        )
        if out.shape[1] != len(ids) + new_tokens:
            raise RuntimeError(f"transformers produced {out.shape[1] - len(ids)} tokens, expected {new_tokens}")


def median_time(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(
    make_engine: Callable[[], Engine],
    prompt_ids: Sequence[int],
    prefill_lengths: Sequence[int],
    decode_tokens: int,
    repeats: int,
    log: Callable[[str], None],
) -> LatencyResult:
    start = time.perf_counter()
    engine = make_engine()
    load_s = time.perf_counter() - start
    log(f"  {engine.name}: loaded in {load_s:.2f} s")
    engine.generate(prompt_ids[:16], 4)  # warm-up
    prefill = {}
    for n in prefill_lengths:
        prefill[n] = median_time(lambda n=n: engine.prefill(prompt_ids[:n]), repeats)
        log(f"  {engine.name}: prefill {n} tokens {prefill[n] * 1000:.0f} ms")
    # Decode speed = (time for 1 + N tokens - time for 1 token) / N, after a short prompt.
    short = prompt_ids[:32]
    first = median_time(lambda: engine.generate(short, 1), repeats)
    full = median_time(lambda: engine.generate(short, decode_tokens + 1), repeats)
    decode = decode_tokens / (full - first)
    log(f"  {engine.name}: decode {decode:.1f} tokens/s")
    return LatencyResult(engine.name, load_s, prefill, decode)
