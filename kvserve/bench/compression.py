"""KV compression at a fixed KV memory: memory per sequence, how many sequences fit, and their throughput.

The same prompts (1-2k tokens of prose, greedy, EOS ignored, fixed output length) run through one
engine per policy, every engine with the same ``kv_cache_memory``. All requests arrive at once, so
the scheduler admits as many as the pool holds: the peak number running side by side is the maximum
batch at that memory. Measured per policy:

- KV memory per sequence after its prefill (bytes of the blocks it holds once the step that completes
  its prompt ran) and during that step (the blocks reserved for it: a compressing policy never reserves
  the whole prompt);
- peak sequences running at once;
- output tokens/s end to end (prefills included) and in decode-only steps, and the seconds spent in the other steps
  (those that computed prompt tokens): what the prefills cost;
- preemptions: a sequence that outgrows the pool while decoding is preempted, and later recomputed (or, with
  ``--preemption-mode swap``, swapped back in): time that shows in the end-to-end figure, not in the decode-only one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from kvserve.core.engine import LLMEngine
from kvserve.core.step import ScheduledSequence
from kvserve.platform.machine import machine_line
from kvserve.sampling.sampling_params import SamplingParams


@dataclass
class CompressionResult:
    policy: str
    budget: float
    kv_summary: str
    num_requests: int
    output_tokens: int
    seconds: float
    decode_tokens: int  # tokens sampled in steps that computed no prompt token
    decode_seconds: float
    peak_running: int
    mean_running_in_decode: float
    kv_bytes_per_seq: float  # after the prefill step, averaged over sequences
    prefill_reserved_bytes_per_seq: float  # blocks reserved for the prefill step, averaged
    preemptions: int = 0  # sequences preempted for memory (recomputed or swapped back later)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            **asdict(self),
            "output_tokens_per_s": self.output_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
        }


def run_policy(
    engine: LLMEngine, prompts: Sequence[list[int]], max_tokens: int, log: Callable[[str], None]
) -> CompressionResult:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    block_bytes = engine.kv_block_bytes
    after_prefill: list[int] = []
    reserved: list[int] = []
    decode_tokens = output_tokens = peak = done = 0
    decode_seconds = 0.0
    running_in_decode: list[int] = []
    schedule = engine.scheduler.schedule
    last: list = []

    def spy():  # noqa: ANN202 - the scheduler's output, kept to classify the step
        out = schedule()
        last[:] = [out]
        # Blocks reserved for the step that completes a prompt (before the policy frees what it drops).
        for s in out.scheduled:
            if _completes_prompt(s):
                reserved.append(_blocks_of(engine, s.seq_id) * block_bytes)
        return out

    engine.scheduler.schedule = spy
    preempted_before = engine.scheduler.num_preemptions
    start = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            step_start = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - step_start
            (out,) = last
            if out.scheduled and all(len(s.token_ids) == 1 for s in out.scheduled):
                decode_tokens += len(out.scheduled)
                decode_seconds += elapsed
                running_in_decode.append(len(out.scheduled))
            for s in out.scheduled:
                if _completes_prompt(s) and s.seq_id in engine.kv:
                    after_prefill.append(_blocks_of(engine, s.seq_id) * block_bytes)
            peak = max(peak, len(engine.scheduler.running))
            for o in outputs:
                if o.finished:
                    done += 1
                    output_tokens += len(o.outputs[0].token_ids)
                    if done % 8 == 0:
                        log(f"  {engine.kv_policy.name}: {done}/{len(ids)} requests done")
    finally:
        engine.scheduler.schedule = schedule
    return CompressionResult(
        policy=engine.kv_policy.name,
        budget=engine.kv_policy.budget,
        kv_summary=engine.kv_summary,
        num_requests=len(ids),
        output_tokens=output_tokens,
        seconds=time.perf_counter() - start,
        decode_tokens=decode_tokens,
        decode_seconds=decode_seconds,
        peak_running=peak,
        mean_running_in_decode=sum(running_in_decode) / max(len(running_in_decode), 1),
        kv_bytes_per_seq=sum(after_prefill) / max(len(after_prefill), 1),
        prefill_reserved_bytes_per_seq=sum(reserved) / max(len(reserved), 1),
        preemptions=engine.scheduler.num_preemptions - preempted_before,
    )


def _completes_prompt(s: ScheduledSequence) -> bool:
    """A prefill chunk that reaches the prompt's end (a prompt may take several steps)."""
    return s.samples and len(s.token_ids) > 1


def _blocks_of(engine: LLMEngine, seq_id: int) -> int:
    return sum(len(engine.kv.block_table(seq_id, g)) for g in range(len(engine.kv.groups)))


def markdown(report: dict) -> str:
    results = report["results"]
    full = results[0]
    lines = [
        f"# KV policies at a fixed KV memory: {report['model']}, {report['dtype']}"
        f"{' with int8 activations' if report.get('int8_activations') else ''}",
        "",
        f"`{report['command']}`",
        "",
        f"Machine: {machine_line(report['machine'])}; threads {report['threads']}. Workload: {report['workload']}. "
        f"KV memory {report['kv_cache_memory']} for every policy.",
        "",
        "| policy | budget | KV/seq after prefill (MB) | KV reserved in prefill (MB) | peak batch | "
        "preemptions | prompt steps (s) | output tok/s | decode tok/s | vs full (prompt s / out / decode) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r['policy']} | {r['budget']:g} | {r['kv_bytes_per_seq'] / 1e6:.1f} | "
            f"{r['prefill_reserved_bytes_per_seq'] / 1e6:.1f} | {r['peak_running']} | {r.get('preemptions', '')} | "
            f"{_prompt_seconds(r):.1f} | {r['output_tokens_per_s']:.1f} | {r['decode_tokens_per_s']:.1f} | "
            f"{_prompt_seconds(r) / max(_prompt_seconds(full), 1e-9):.2f}x / "
            f"{r['output_tokens_per_s'] / full['output_tokens_per_s']:.2f}x / "
            f"{r['decode_tokens_per_s'] / max(full['decode_tokens_per_s'], 1e-9):.2f}x |"
        )
    return "\n".join(lines) + "\n"


def _prompt_seconds(result: dict) -> float:
    """Seconds in steps that computed prompt tokens (decodes batched with them included): the run's prefill cost."""
    return result.get("seconds", 0.0) - result.get("decode_seconds", 0.0)
