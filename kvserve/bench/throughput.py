"""Offline throughput: a replayed trace through kvserve's paged engine vs transformers' static batches.

kvserve gets every request at once and schedules them itself (continuous batching); transformers
runs them in arrival order as left-padded static batches of ``hf_batch_size`` that decode until
their longest request is done. Both run greedy with EOS ignored, so every request produces
exactly its trace length and the useful work is identical.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvserve.bench.workload import TraceRequest
from kvserve.core.engine import LLMEngine
from kvserve.sampling.sampling_params import SamplingParams


@dataclass
class ThroughputResult:
    engine: str
    seconds: float
    num_requests: int
    output_tokens: int
    prompt_tokens: int
    kv_waste_pct: float  # allocated KV slots holding no token, time-averaged over steps

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def run_kvserve(engine: LLMEngine, requests: Sequence[TraceRequest], log: Callable[[str], None]) -> ThroughputResult:
    for r in requests:
        engine.add_request(r.prompt_ids, SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True))
    block_size = engine.config.block_size
    waste = allocated = output_tokens = done = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done += 1
                output_tokens += len(out.outputs[0].token_ids)
                if done % 8 == 0:
                    log(f"  kvserve: {done}/{len(requests)} requests done")
        usage = engine.kv_usage()
        waste += usage.waste_slots
        allocated += usage.used_blocks * block_size
    seconds = time.perf_counter() - start
    prompt_tokens = sum(len(r.prompt_ids) for r in requests)
    return ThroughputResult("kvserve", seconds, len(requests), output_tokens, prompt_tokens, 100 * waste / allocated)


def run_transformers(model: torch.nn.Module, requests: Sequence[TraceRequest], batch_size: int, pad_id: int,
                     log: Callable[[str], None]) -> ThroughputResult:  # fmt: skip
    """Static batching: each batch is padded to its longest prompt and decodes to its longest output."""
    waste = allocated = output_tokens = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(r.prompt_ids) for r in batch)
        new = max(r.output_len for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[row, width - len(r.prompt_ids) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                pad_token_id=pad_id,
            )  # fmt: skip
        if out.shape[1] != width + new:
            raise RuntimeError(f"transformers produced {out.shape[1] - width} tokens, expected {new}")
        output_tokens += sum(r.output_len for r in batch)  # only what each request asked for is useful
        used = sum(len(r.prompt_ids) + r.output_len for r in batch)
        allocated += len(batch) * (width + new)
        waste += len(batch) * (width + new) - used
        log(f"  transformers: {min(i + batch_size, len(requests))}/{len(requests)} requests done")
    seconds = time.perf_counter() - start
    prompt_tokens = sum(len(r.prompt_ids) for r in requests)
    return ThroughputResult("transformers", seconds, len(requests), output_tokens, prompt_tokens,
                            100 * waste / allocated)  # fmt: skip


def decode_scaling_kvserve(engine: LLMEngine, prompts: Sequence[list[int]], new_tokens: int) -> float:
    """Decode tokens/s for this batch: (time for 1 + new tokens - time for 1 token) per generated token."""

    def run(max_tokens: int) -> float:
        for p in prompts:
            engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start

    first = run(1)
    full = run(new_tokens + 1)
    return len(prompts) * new_tokens / (full - first)


def decode_scaling_transformers(model: torch.nn.Module, prompts: Sequence[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)  # equal lengths: no padding

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        return time.perf_counter() - start

    first = run(1)
    full = run(new_tokens + 1)
    return len(prompts) * new_tokens / (full - first)
