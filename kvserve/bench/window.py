"""Sliding-window KV groups against every layer kept full, on a model with sliding-window layers (Gemma 3).

The real model runs in the real engine, once with window groups (``kv_window_groups=True``: a
sliding-window layer keeps only the blocks its window still sees) and once with every layer holding
its whole context (``kv_window_groups=False``), the same prompts (Austen), greedy, EOS ignored:

1. One long sequence (default 8,192 tokens: prompt plus 16 generated): the KV bytes it holds while it
   decodes (``used_blocks * kv_block_bytes``, the largest over its decode steps) and the most it holds
   while its prompt is computed in chunks; next to them the analytic bytes of every layer full and of
   each layer keeping min(context, window).
2. Many sequences of one length (default 4,096 tokens) in one KV memory (default 1 GiB): more requests
   than the window groups can hold arrive at once, so the scheduler admits as many as the pool holds;
   the peak number running side by side, the peak KV in use, output tokens/s and wall time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from kvserve.bench.workload import fixed_length_prompts
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.models.config import ModelConfig
from kvserve.models.loader import LoadedModel
from kvserve.sampling.sampling_params import SamplingParams

CONFIGURATIONS = {True: "window groups", False: "every layer full"}


@dataclass(frozen=True)
class WindowBench:
    """What to measure. ``engine_options``: EngineConfig fields every engine shares (dtype, device,
    weights, kv_cache_memory, block_size)."""

    engine_options: dict = field(default_factory=dict)
    context_tokens: int = 8192  # part 1: prompt + generated tokens of the long sequence
    context_new_tokens: int = 16  # part 1: tokens it generates (decode steps measured: all but the last)
    prefill_chunk: int = 2048  # part 1: max_num_batched_tokens, the prompt's chunk
    seq_tokens: int = 4096  # part 2: prompt + max_tokens of every sequence
    max_tokens: int = 32  # part 2: tokens each sequence generates
    batch_tokens: int = 8192  # part 2: max_num_batched_tokens (room to admit two prompts a step)
    max_num_seqs: int = 256  # part 2: the scheduler's limit, above what the KV memory holds
    max_sequences: int = 64  # part 2: at most this many requests

    def __post_init__(self) -> None:
        if self.context_new_tokens < 2 or self.context_tokens <= self.context_new_tokens:
            raise ValueError(
                f"the long sequence needs >= 2 generated tokens and a prompt before them; got context "
                f"{self.context_tokens}, generated {self.context_new_tokens}"
            )
        if self.max_tokens < 1 or self.seq_tokens <= self.max_tokens:
            raise ValueError(f"--seq-tokens ({self.seq_tokens}) must exceed --max-tokens ({self.max_tokens}) >= 1")
        for name in ("prefill_chunk", "batch_tokens", "max_num_seqs", "max_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class SequenceKV:
    """Part 1: one sequence alone in the engine."""

    prompt_tokens: int
    new_tokens: int
    decode_bytes: int  # the most KV held after a decode step (before the sequence finished)
    prefill_peak_bytes: int  # the most KV held after a prefill step (the chunk's reservation)
    prefill_seconds: float
    decode_seconds_per_token: float  # the decode steps after the prompt's
    decode_steps: int


@dataclass
class Concurrency:
    """Part 2: requests of one length arriving together."""

    num_requests: int
    prompt_tokens: int  # per request
    max_tokens: int
    peak_running: int  # sequences running at once (scheduler.running), the most over all steps
    peak_kv_bytes: int  # KV in use, the most over all steps
    kv_pool_bytes: int
    output_tokens: int
    seconds: float
    steps: int
    preemptions: int
    decode_tokens: int  # tokens computed in steps that ran no prompt chunk
    decode_seconds: float  # those steps' time
    max_load_average: float  # the 1-minute load average, the most over the steps (other work on a shared machine)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            **asdict(self), "output_tokens_per_s": self.output_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
        }  # fmt: skip


def analytic_kv_bytes(config: ModelConfig, num_tokens: int, dtype_size: int) -> dict[str, int]:
    """Bytes of keys and values for ``num_tokens`` tokens: every layer full, and each layer keeping
    min(tokens, its window) (no block rounding, no chunk in flight)."""
    per_token_layer = 2 * config.num_kv_heads * config.head_dim * dtype_size  # keys and values
    kept = sum(num_tokens if w is None else min(num_tokens, w) for w in config.layer_windows)
    return {"full": per_token_layer * config.num_layers * num_tokens, "windows": per_token_layer * kept}


def run(loaded: LoadedModel, bench: WindowBench, log: Callable[[str], None]) -> dict:
    """Both parts for both configurations; a dict of plain values for the report."""
    if not any(w is not None for w in loaded.config.layer_windows):
        raise ValueError(f"{loaded.path.name} has no sliding-window layer: window groups would change nothing")
    prompt = fixed_length_prompts(loaded.tokenizer, 1, bench.context_tokens - bench.context_new_tokens)[0]
    sequence = {}
    for groups, name in CONFIGURATIONS.items():
        engine = _engine(loaded, bench, groups, bench.prefill_chunk, max_num_seqs=1)
        log(f"part 1, {name}: {engine.kv_summary}")
        sequence[groups] = measure_sequence(engine, prompt, bench.context_new_tokens, name)
        del engine  # its KV pool goes before the next one's
    count = num_requests(_engine(loaded, bench, True, bench.batch_tokens, 1), bench.seq_tokens, bench.max_sequences)
    prompt_len = bench.seq_tokens - bench.max_tokens
    log(f"part 2: {count} requests of {prompt_len} prompt + {bench.max_tokens} generated tokens")
    prompts = fixed_length_prompts(loaded.tokenizer, count, prompt_len)
    concurrency = {}
    for groups, name in CONFIGURATIONS.items():
        engine = _engine(loaded, bench, groups, bench.batch_tokens, bench.max_num_seqs)
        log(f"part 2, {name}: {engine.kv_summary}")
        concurrency[groups] = measure_concurrency(engine, prompts, bench.max_tokens, name)
        del engine
    dtype_size = torch.empty((), dtype=loaded.dtype).element_size()
    return {
        "analytic_bytes": analytic_kv_bytes(loaded.config, bench.context_tokens, dtype_size),
        "configurations": [
            {
                "name": name,
                "kv_window_groups": groups,
                "sequence": asdict(sequence[groups]),
                "concurrency": concurrency[groups].as_dict(),
            }
            for groups, name in CONFIGURATIONS.items()
        ],
    }


def _engine(loaded: LoadedModel, bench: WindowBench, groups: bool, batch_tokens: int, max_num_seqs: int) -> LLMEngine:
    config = EngineConfig(
        **{"swap_space": 0, **bench.engine_options}, kv_window_groups=groups, enable_prefix_caching=False,
        max_num_batched_tokens=batch_tokens, max_num_seqs=max_num_seqs,
    )  # fmt: skip
    return LLMEngine(config, loaded)


def num_requests(engine: LLMEngine, seq_tokens: int, cap: int) -> int:
    """More requests than ``engine`` can run at once: its pool over what one sequence holds in decode at
    its full length (an upper bound: admitting a prompt takes more), plus two, at most ``cap``."""
    per_seq = engine.kv.blocks_needed(seq_tokens, 1)
    return min(cap, engine.kv.pool.num_blocks // per_seq + 2)


def measure_sequence(engine: LLMEngine, prompt: list[int], new_tokens: int, label: str) -> SequenceKV:
    """Run one request alone; the KV it holds after each step, split by prefill and decode steps."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    request = engine.requests[engine.add_request(prompt, params)]
    total = len(prompt) + new_tokens - 1  # tokens computed by the end (the last one sampled is not)
    prefill_peak = decode_peak = decode_steps = 0
    prefill_seconds = decode_seconds = 0.0
    with tqdm(total=total, desc=f"{label}: one sequence", unit="tok", dynamic_ncols=True) as bar:
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            (output,) = engine.step()
            elapsed = time.perf_counter() - start
            held = engine.kv_usage().used_blocks * engine.kv_block_bytes
            generated = len(output.outputs[0].token_ids)
            if generated <= 1:  # chunks of the prompt; the last one samples the first token
                prefill_peak, prefill_seconds = max(prefill_peak, held), prefill_seconds + elapsed
            else:
                decode_seconds += elapsed
                decode_steps += 1
                if not output.finished:  # a finished sequence has given its blocks back
                    decode_peak = max(decode_peak, held)
            bar.update(request.seqs[0].num_computed_tokens - bar.n)
    return SequenceKV(
        len(prompt), new_tokens, decode_peak, prefill_peak, prefill_seconds,
        decode_seconds / max(decode_steps, 1), decode_steps,
    )  # fmt: skip


def measure_concurrency(engine: LLMEngine, prompts: Sequence[list[int]], max_tokens: int, label: str) -> Concurrency:
    """All requests at once; the most sequences running side by side and the most KV in use."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = [engine.requests[engine.add_request(p, params)] for p in prompts]
    total = sum(len(p) + max_tokens - 1 for p in prompts)
    scheduler = engine.scheduler
    peak_running = peak_blocks = output_tokens = steps = decode_tokens = 0
    decode_seconds = max_load = 0.0
    computed = [0] * len(requests)
    start = time.perf_counter()
    with tqdm(total=total, desc=f"{label}: {len(prompts)} sequences", unit="tok", dynamic_ncols=True) as bar:
        while engine.has_unfinished_requests():
            step_start = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - step_start
            steps += 1
            now = [r.seqs[0].num_computed_tokens for r in requests]
            advanced = [b - a for a, b in zip(computed, now, strict=True)]
            if all(a in (0, 1) for a in advanced):  # no prompt chunk (nor a recompute) ran: a decode-only step
                decode_tokens, decode_seconds = decode_tokens + sum(advanced), decode_seconds + elapsed
            computed, max_load = now, max(max_load, os.getloadavg()[0])
            peak_running = max(peak_running, sum(len(r.live_seqs) for r in scheduler.running))
            peak_blocks = max(peak_blocks, engine.kv_usage().used_blocks)
            output_tokens += sum(len(o.outputs[0].token_ids) for o in outputs if o.finished)
            bar.update(sum(now) - bar.n)
            bar.set_postfix(running=len(scheduler.running), peak=peak_running, refresh=False)
    return Concurrency(
        num_requests=len(prompts), prompt_tokens=len(prompts[0]), max_tokens=max_tokens, peak_running=peak_running,
        peak_kv_bytes=peak_blocks * engine.kv_block_bytes,
        kv_pool_bytes=engine.kv.pool.num_blocks * engine.kv_block_bytes, output_tokens=output_tokens,
        seconds=time.perf_counter() - start, steps=steps, preemptions=scheduler.num_preemptions,
        decode_tokens=decode_tokens, decode_seconds=decode_seconds, max_load_average=max_load,
    )  # fmt: skip


def cpu_label(machine: dict) -> str:
    """The CPU's name with what decides bfloat16 speed on it (family/model, avx512_bf16, AMX)."""
    facts = _cpuinfo()
    flags = set(facts.get("flags", "").split())
    extras = [f"family {facts['cpu family']} model {facts['model']}"] if "cpu family" in facts else []
    if flags:
        extras.append("avx512_bf16" if "avx512_bf16" in flags else "no avx512_bf16")
        extras.append("AMX" if "amx_bf16" in flags else "no AMX")
    return f"{machine.get('cpu')}" + (f" ({', '.join(extras)})" if extras else "")


def _cpuinfo() -> dict[str, str]:
    path = Path("/proc/cpuinfo")
    facts: dict[str, str] = {}
    if not path.is_file():
        return facts
    for line in path.read_text().splitlines():
        if not line.strip():
            break  # the first processor is enough
        key, _, value = line.partition(":")
        facts[key.strip()] = value.strip()
    return facts


def markdown(report: dict) -> str:
    window, full = report["results"]["configurations"]
    m, settings = report["machine"], report["settings"]
    ws, wc = window["sequence"], window["concurrency"]
    lines = [
        f"# Sliding-window KV groups vs every layer full: {report['model']}, {report['dtype']}",
        "",
        f"`{report['command']}` on {report['date']}: {report['cpu']}, {m['nproc']} vCPU, {m['memory_gib']} GiB, "
        f"torch {m['torch']}, {report['threads']} threads.",
        "",
        f"## KV per sequence at {ws['prompt_tokens'] + ws['new_tokens']:,} tokens ({ws['prompt_tokens']:,}-token "
        f"prompt in {settings['prefill_chunk']}-token chunks, {ws['new_tokens']} generated)",
        "",
        *_sequence_table(window, full, report["results"]["analytic_bytes"]),
        "",
        f"## Sequences of {wc['prompt_tokens'] + wc['max_tokens']:,} tokens in {report['kv_cache_memory']} of KV "
        f"({wc['num_requests']} requests at once, {wc['prompt_tokens']:,}-token prompts, {wc['max_tokens']} generated, "
        f"max_num_seqs {settings['max_num_seqs']}, {settings['batch_tokens']} tokens a step)",
        "",
        *_concurrency_table(window, full),
        "",
        f"1-minute load average at most {wc['max_load_average']:.1f} (window groups) and "
        f"{full['concurrency']['max_load_average']:.1f} (every layer full) during these runs, "
        f"{report['threads']} threads of this benchmark included.",
    ]
    if wc["peak_running"] >= wc["num_requests"]:
        lines += ["", f"Every request ran at once with window groups: the cap of {wc['num_requests']} requests, not "
                  "the KV memory, bounded the peak (raise --max-sequences)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _sequence_table(window: dict, full: dict, analytic: dict[str, int]) -> list[str]:
    ws, fs = window["sequence"], full["sequence"]

    def row(name: str, s: dict, expected: int) -> str:
        return (
            f"| {name} | {s['decode_bytes'] / 1e6:.1f} | {s['prefill_peak_bytes'] / 1e6:.1f} | {expected / 1e6:.1f} | "
            f"{s['prefill_seconds']:.1f} | {s['decode_seconds_per_token'] * 1e3:.1f} |"
        )

    keys = ("decode_bytes", "prefill_peak_bytes", "prefill_seconds", "decode_seconds_per_token")
    ratios = [_ratio(fs[key], ws[key]) for key in keys]
    ratios.insert(2, _ratio(analytic["full"], analytic["windows"]))
    return [
        "| configuration | KV in decode (MB) | KV peak in prefill (MB) | analytic (MB) | prefill (s) | "
        "decode (ms/token) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        row(window["name"], ws, analytic["windows"]),
        row(full["name"], fs, analytic["full"]),
        f"| **full / window groups** | **{ratios[0]}** | " + " | ".join(ratios[1:]) + " |",
    ]


def _concurrency_table(window: dict, full: dict) -> list[str]:
    wc, fc = window["concurrency"], full["concurrency"]

    def row(name: str, c: dict) -> str:
        return (
            f"| {name} | {c['peak_running']} | {c['peak_kv_bytes'] / 2**20:.0f} MiB "
            f"({c['peak_kv_bytes'] / c['kv_pool_bytes']:.0%}) | {c['output_tokens_per_s']:.1f} | "
            f"{c['decode_tokens_per_s']:.1f} | {c['seconds']:.1f} | {c['steps']} | {c['preemptions']} |"
        )

    return [
        "| configuration | peak running | peak KV in use | output tok/s | decode tok/s (decode-only steps) | wall (s) "
        "| steps | preemptions |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        row(window["name"], wc),
        row(full["name"], fc),
        f"| **window groups / full** | **{_ratio(wc['peak_running'], fc['peak_running'])}** | | "
        + " | ".join(_ratio(wc[k], fc[k]) for k in ("output_tokens_per_s", "decode_tokens_per_s", "seconds"))
        + " | | |",
    ]


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"
