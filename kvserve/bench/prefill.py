"""``kvserve bench prefill``: time to first token of long prompts, single process vs KV-Runahead vs TSP.

Per context length: one process with every core; KV-Runahead over p processes (one core's share of
threads each) with even (KVR-E), searched (KVR-S, measured on this machine; the search itself is not
timed) and predicted (KVR-P, interpolated from the ``tune-runahead`` table) partitions; and the
tensor/sequence-parallel baseline (TSP). All through the engine (``LLM.generate`` with one new token,
prefix caching off), median of ``repeats``. The paper's bound for p processes,
TTFT*(p) = TTFT(1) / 2 * (1/p + 1/p^2), is computed from the single-process time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvserve.entrypoints.llm import LLM
from kvserve.sampling.sampling_params import SamplingParams

METHODS = ("single", "KVR-E", "KVR-S", "KVR-P", "TSP")
_PARTITION_OF = {"KVR-E": "even", "KVR-S": "searched", "KVR-P": "predicted", "TSP": "tsp"}


@dataclass
class PrefillBenchResult:
    ttft_s: dict[str, dict[int, float]] = field(default_factory=dict)  # method -> context length -> seconds
    bound_s: dict[int, float] = field(default_factory=dict)  # context length -> TTFT*(p)
    partitions: dict[str, dict[int, list[int]]] = field(default_factory=dict)  # method -> length -> chunk sizes


def ttft(llm: LLM, ids: Sequence[int], repeats: int) -> float:
    params = SamplingParams(max_tokens=1, temperature=0)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(list(ids), params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bound(single_s: float, p: int) -> float:
    """KV-Runahead's ideal TTFT over p processes (Cho et al., ICML'24), from the single-process TTFT."""
    return single_s / 2 * (1 / p + 1 / p**2)


def run(
    single: LLM,
    parallel: LLM | None,
    prompts: dict[int, list[int]],
    methods: Sequence[str],
    repeats: int,
    log: Callable[[str], None],
) -> PrefillBenchResult:
    result = PrefillBenchResult()
    p = parallel.engine.config.prefill_parallel if parallel is not None else 1
    prefill = parallel.engine.parallel_prefill if parallel is not None else None
    for method in methods:
        result.ttft_s[method] = {}
        if method != "single":
            prefill.set_partition(_PARTITION_OF[method])
            result.partitions[method] = {}
        for n, ids in prompts.items():
            llm = single if method == "single" else parallel
            if method != "single":
                boundaries = prefill.boundaries(n)  # KVR-S searches here, outside the timing
                result.partitions[method][n] = [b - a for a, b in zip(boundaries, boundaries[1:], strict=False)]
            llm.generate(list(ids[:64]), SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)  # warm
            result.ttft_s[method][n] = ttft(llm, ids, repeats)
            chunks = f", chunks {result.partitions[method][n]}" if method != "single" else ""
            log(f"  {method}: {n} tokens, TTFT {result.ttft_s[method][n] * 1000:.0f} ms{chunks}")
            if prefill is not None and not prefill.available:
                raise RuntimeError("the parallel prefill group failed during the benchmark; see the log")
    if "single" in result.ttft_s and parallel is not None:
        result.bound_s = {n: bound(s, p) for n, s in result.ttft_s["single"].items()}
    return result
