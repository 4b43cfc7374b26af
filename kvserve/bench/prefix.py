"""Shared system prompt: N requests that start with the same long prompt, prefix caching on vs off.

All requests arrive at once. With caching, the first request's prompt blocks are computed once
and every other request reuses them in the same step, so each computes only its own question.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.core.engine import LLMEngine
from kvserve.sampling.sampling_params import SamplingParams


@dataclass
class PrefixResult:
    prefix_caching: bool
    seconds: float
    mean_ttft_s: float
    p50_ttft_s: float
    max_ttft_s: float
    prefix_hit_rate: float  # of all prompt tokens looked up
    cached_tokens_per_request: float
    prompt_tokens: int


def run_shared_prefix(engine: LLMEngine, prompts: Sequence[list[int]], max_tokens: int) -> PrefixResult:
    before = engine.kv_usage()
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    arrival = time.monotonic()
    ids = [engine.add_request(p, params) for p in prompts]
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    seconds = time.perf_counter() - start
    ttft = [finished[i].metrics["first_token_time"] - arrival for i in ids]
    after = engine.kv_usage()
    queried = after.prefix_query_tokens - before.prefix_query_tokens
    hits = after.prefix_hit_tokens - before.prefix_hit_tokens
    return PrefixResult(
        prefix_caching=engine.config.enable_prefix_caching,
        seconds=seconds,
        mean_ttft_s=statistics.mean(ttft),
        p50_ttft_s=statistics.median(ttft),
        max_ttft_s=max(ttft),
        prefix_hit_rate=hits / queried if queried else 0.0,
        cached_tokens_per_request=statistics.mean(finished[i].num_cached_tokens for i in ids),
        prompt_tokens=sum(len(p) for p in prompts),
    )


def markdown(report: dict) -> str:
    """The report's table: prefix caching on, off, and the saving."""
    m, w = report["machine"], report["workload"]
    on, off = report["results"]
    lines = [
        f"# Shared system prompt: {report['model']}, {report['dtype']}",
        "",
        f"`{report['command']}` on {report['date']}: {m['cpu']}, {m['nproc']} CPUs, torch {m['torch']}, "
        f"{m['torch_threads']} threads. {w['num_requests']} requests arriving together, each a {w['shared_tokens']}"
        f"-token shared prompt (Austen) plus its own question, {w['max_tokens']} greedy tokens each.",
        "",
        "| prefix caching | total (s) | mean TTFT (s) | p50 TTFT (s) | max TTFT (s) | hit rate | cached tokens/req |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in (on, off):
        lines.append(
            f"| {'on' if r['prefix_caching'] else 'off'} | {r['seconds']:.1f} | {r['mean_ttft_s']:.2f} | "
            f"{r['p50_ttft_s']:.2f} | {r['max_ttft_s']:.2f} | {r['prefix_hit_rate']:.1%} | "
            f"{r['cached_tokens_per_request']:.0f} |"
        )
    saving = f"{off['seconds'] / on['seconds']:.2f}x | {off['mean_ttft_s'] / on['mean_ttft_s']:.2f}x"
    lines.append(f"| **saving** | {saving} | | | | |")
    return "\n".join(lines) + "\n"
