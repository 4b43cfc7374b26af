"""Decode with the KV cache offloaded: latency and bytes fetched per token, InfiniGen against its baselines.

One engine per (tier, policy), KV in the host tier, a memory-mapped file (``kv_offload``) or a file read with
direct I/O (``disk-direct``: ``kv_disk_io="direct"``, every read from the device), prefix caching on. Per
context length, eight distinct prompts (prose cut at different places) are prefilled once by the batch-8 run;
the batch-4 and batch-1 runs reuse their cached blocks, so only decoding is repeated. Each run decodes a few
warm-up tokens, then ``steps`` measured ones; a measured step is one in which every sequence of the batch
decodes. Reported per cell: the median step time (the per-token decode latency of that batch), the KV bytes the
step moved from the slower tier, per sequence, and (``disk-direct``) the bytes it read from the device.

- ``full``: fetch-everything (FlexGen-style: each layer's whole KV fetched while the layer before runs);
- ``int4``: the same with 4-bit group-wise KV (the tier holds codes and scales);
- ``infinigen``: the rows layer i's rehearsal selects, fetched while layer i - 1 runs (on ``disk-direct``: the
  blocks whose predicted attention mass covers what those rows would keep, read whole);
- ``h2o``: H2O at a 20% budget through the compressed cache (no offload: the kept KV lives in host
  memory and each layer gathers it per step, which on a CPU is the same memory traffic); its bytes per
  token are the rows it holds, read once per layer.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from kvserve.attention.backend import AttentionBackend
from kvserve.core.engine import LLMEngine
from kvserve.platform.machine import machine_line
from kvserve.sampling.sampling_params import SamplingParams

WARMUP_TOKENS = 2


@dataclass
class DecodeCell:
    tier: str  # host | disk | memory (h2o: not offloaded)
    policy: str
    context: int
    batch: int
    ms_per_step: float  # median over measured steps: every sequence decodes one token
    bytes_per_token: float  # KV moved from the slower tier per sequence and step
    steps: int  # measured: fewer than asked only if the sequences never decoded together that often
    disk_bytes_per_step: float = 0.0  # disk-direct: bytes read from the device per measured step (whole extents)
    disk_wait_ms_per_step: float = 0.0  # disk-direct: ms a measured step waited for its reads (mean)


def measure(
    engine: LLMEngine, prompts: Sequence[list[int]], steps: int, log: Callable[[str], None]
) -> tuple[float, float, int, float, float]:
    """Decode every prompt at once until ``steps`` steps in which all of them decode are measured (after the
    warm-up), then abort them; (median ms/step, bytes/token, steps measured, bytes read from the device per
    step and ms waited for them: the direct-I/O disk tier's, else 0).

    Prompts that do not fit one step's token budget are prefilled over several steps, so the sequences
    start decoding up to that many steps apart: each may make that many more tokens than warm-up + steps.
    """
    prefill_steps = len(prompts) + math.ceil(sum(map(len, prompts)) / engine.config.max_num_batched_tokens)
    params = SamplingParams(max_tokens=WARMUP_TOKENS + steps + prefill_steps, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params, add_special_tokens=False) for p in prompts]
    produced = dict.fromkeys(ids, 0)
    times, fetched, disk, wait = [], 0, 0, 0.0
    cache = engine.runner.cache
    while engine.has_unfinished_requests() and len(times) < steps:
        measured = min(produced.values()) >= WARMUP_TOKENS and all(i in engine.requests for i in ids)
        before, disk_before, wait_before = _fetched(cache), _disk_read(cache), _disk_read(cache, "wait_s")
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        for out in outputs:
            produced[out.request_id] = len(out.outputs[0].token_ids)
        if measured and len(outputs) == len(ids):
            times.append(elapsed)
            fetched += _fetched(cache) - before
            disk += _disk_read(cache) - disk_before
            wait += _disk_read(cache, "wait_s") - wait_before
    for request_id in ids:  # those still decoding (finished ones are ignored)
        engine.abort_request(request_id)
    if not cache.bytes_moved():  # h2o: what each layer holds, read once per step
        lengths = [len(p) + produced[i] for p, i in zip(prompts, ids, strict=True)]
        fetched = _compressed_bytes(engine, lengths) * len(times)
    median = statistics.median(times) if times else float("nan")
    per_token = fetched / max(1, len(times)) / len(prompts)
    per_step, wait_ms = disk / max(1, len(times)), wait * 1e3 / max(1, len(times))
    read = f", {per_step / 1e6:.1f} MB/step from the device ({wait_ms:.0f} ms waited)" if disk else ""
    rate = f"{median * 1e3:.1f} ms/step, {per_token / 1e6:.2f} MB/token{read}"
    log(f"    batch {len(prompts)}: {rate} ({len(times)} steps)")
    return median * 1e3, per_token, len(times), per_step, wait_ms


def _fetched(cache: AttentionBackend) -> int:
    return cache.bytes_moved().get("fetched", 0)


def _disk_read(cache: AttentionBackend, what: str = "disk_read") -> float:
    """The direct-I/O disk tier's count so far: bytes read from the device, or seconds waited for reads (0 for any
    other tier)."""
    offloaded = getattr(cache, "offloaded", cache)  # a split cache's tier part (SplitOffloadKVCache)
    stats = getattr(getattr(offloaded, "tier", None), "stats", None)
    return stats[what] if stats else 0


def _compressed_bytes(engine: LLMEngine, lengths: Sequence[int]) -> float:
    """Bytes of KV an H2O step reads per step for the batch: its budget of every sequence (at the lengths
    they reached), every layer."""
    cfg = engine.loaded.config
    row = engine.kv_block_bytes // engine.config.block_size  # one token of one layer
    kept = sum(engine.kv_policy.capacity(0, cfg.num_layers, n) for n in lengths)
    return kept * row * cfg.num_layers


def as_rows(cells: list[DecodeCell]) -> list[dict]:
    return [asdict(c) for c in cells]


def markdown(report: dict) -> str:
    cells = report["results"]
    tiers = sorted({c["tier"] for c in cells if c["policy"] != "h2o"})
    policies = [p for p in report["policies"] if any(c["policy"] == p for c in cells)]
    lines = [
        f"# Decode with offloaded KV: {report['model']}, {report['dtype']}, {report['threads']} threads",
        "",
        f"`{report['command']}`",
        "",
        f"Machine: {machine_line(report['machine'])}. {report['note']}",
        "",
    ]
    for tier in tiers:
        lines += [f"## KV in the {tier} tier", "", "ms per decode step (every sequence of the batch decodes one "
                  "token) and MB fetched per token; speed-up of InfiniGen over fetch-everything.", ""]  # fmt: skip
        head = " | ".join(f"{p} ms | {p} MB/tok" for p in policies)
        lines += [f"| context | batch | {head} | InfiniGen vs full |", "|" + " ---: |" * (2 + 2 * len(policies) + 1)]
        keys = sorted({(c["context"], c["batch"]) for c in cells})
        for context, batch in keys:
            row, by = [], {}
            for p in policies:
                where = "memory" if p == "h2o" else tier
                by[p] = next((c for c in cells if (c["tier"], c["policy"], c["context"], c["batch"]) ==
                              (where, p, context, batch)), None)  # fmt: skip
                row += [f"{by[p]['ms_per_step']:.1f}", f"{by[p]['bytes_per_token'] / 1e6:.2f}"] if by[p] else ["", ""]
            ratio = ""
            if by.get("full") and by.get("infinigen"):
                ratio = f"{by['full']['ms_per_step'] / by['infinigen']['ms_per_step']:.2f}x"
            lines.append(f"| {context:,} | {batch} | " + " | ".join(row) + f" | {ratio} |")
        lines.append("")
        lines += _device_reads(cells, tier, policies)
    return "\n".join(lines)


def _device_reads(cells: list[dict], tier: str, policies: list[str]) -> list[str]:
    """The direct-I/O tier's table of MB read from the device per step (whole extents, padding included)."""
    ours = [c for c in cells if c["tier"] == tier and c.get("disk_bytes_per_step")]
    if not ours:
        return []
    lines = ["MB read from the device per decode step (O_DIRECT; the write buffer's partial blocks excluded), and the "
             "ms a step waited for them (mean; the rest of the step is compute, the reads overlapping it):", "",
             "| context | batch | " + " | ".join(f"{p} MB/step | {p} ms waited" for p in policies) + " |",
             "|" + " ---: |" * (2 + 2 * len(policies))]  # fmt: skip
    for context, batch in sorted({(c["context"], c["batch"]) for c in ours}):
        by = {c["policy"]: c for c in ours if (c["context"], c["batch"]) == (context, batch)}
        row = [f"{by[p]['disk_bytes_per_step'] / 1e6:.1f} | {by[p].get('disk_wait_ms_per_step', 0):.0f}"
               if p in by else " | " for p in policies]  # fmt: skip
        lines.append(f"| {context:,} | {batch} | " + " | ".join(row) + " |")
    return [*lines, ""]
