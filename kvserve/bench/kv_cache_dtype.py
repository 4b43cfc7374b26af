"""KV cache dtypes side by side (``kv_cache_dtype`` auto, int8, int4): memory, decode speed and accuracy, one run.

One loaded model, one engine per KV dtype at a time (prefix caching off, no host tier for swapping):

1. **Capacity.** From the engine's KV plan: bytes per token (all layers, keys and values, the block's bytes over
   its tokens and the layers it holds, as the plan's summary counts full-cache tokens), the blocks one sequence of
   ``seq_len`` tokens holds in decode (window groups only what their window sees), and so the sequences that fit
   in ``kv_cache_memory`` and in 1 GiB. Then checked by running: more requests of that length than the plan fits
   arrive at once at a small KV memory (room for a few sequences of the model-dtype cache), prompts computed
   whole (one per step), a few tokens generated each; the most sequences the scheduler runs at once.
2. **Decode speed by context.** For each context and batch size B: B distinct prompts of real text (Austen) of
   that many tokens are computed first (not timed), then the steps after every sequence's first token are timed:
   ``decode_tokens`` tokens each, tokens/s and ms per step.
3. **Accuracy.** WikiText-2 perplexity through the engine (sliding windows, prompts computed in chunks of
   ``ppl_chunk`` tokens, so every chunk after the first reads its context from the cache as it is stored), and
   greedy agreement with the baseline dtype: the mean over prompts of the common prefix of the generated token
   ids over the tokens generated, and the share of prompts whose tokens are all identical.
4. **llama.cpp** (``--peers llamacpp``): the same decode cells with its KV types (``type_k = type_v`` f16, q8_0,
   q4_0; flash attention on, which a quantized V needs), in a worker process (``llamacpp_worker.py``).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvserve.bench.speed import WORKER, WorkerProcess, synchronizer
from kvserve.bench.workload import fixed_length_prompts
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.core.kv_plan import KVPlan, plan_kv
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.sizing import parse_memory_size
from kvserve.models.loader import LoadedModel
from kvserve.sampling.sampling_params import SamplingParams

GIB = 2**30
CHECK_NEW_TOKENS = 4  # tokens each request of the capacity check generates
# llama.cpp's KV type (type_k = type_v) for each kvserve KV dtype: its default cache is f16.
LLAMACPP_KV_TYPES = {"auto": "f16", "float16": "f16", "bfloat16": "bf16", "float32": "f32", "int8": "q8_0",
                     "int4": "q4_0"}  # fmt: skip

Log = Callable[[str], None]


@dataclass(frozen=True)
class KVCacheBench:
    """What to measure. ``engine_options``: EngineConfig fields every engine shares (dtype, device, weights)."""

    kv_cache_dtypes: tuple[str, ...] = ("auto", "int8", "int4")
    engine_options: dict = field(default_factory=dict)
    block_size: int = 16
    # Part 1
    seq_len: int = 4096
    kv_cache_memory: str | int = "1GiB"
    check_sequences: int = 3  # the check's KV memory holds this many sequences of the baseline's cache
    check_kv_cache_memory: str | int | None = None  # or this memory
    check_max_requests: int = 64
    # Part 2
    contexts: tuple[int, ...] = (1024, 4096, 8192)
    batch_sizes: tuple[int, ...] = (1, 8)
    decode_tokens: int = 32
    prefill_chunk: int = 2048
    # Part 3
    ppl_tokens: int = 16384
    ppl_context: int = 1024
    ppl_stride: int = 512
    ppl_chunk: int = 256  # max_num_batched_tokens of the accuracy engine
    agreement_prompts: int = 20
    agreement_tokens: int = 64
    # What runs
    capacity: bool = True
    speed: bool = True
    accuracy: bool = True

    def __post_init__(self) -> None:
        if not self.kv_cache_dtypes:
            raise ValueError("--kv-cache-dtypes names no dtype")
        if len(set(self.kv_cache_dtypes)) != len(self.kv_cache_dtypes):
            raise ValueError(f"--kv-cache-dtypes names a dtype twice: {','.join(self.kv_cache_dtypes)}")
        for name in ("block_size", "check_sequences", "check_max_requests", "decode_tokens", "prefill_chunk",
                     "agreement_prompts", "agreement_tokens", "ppl_chunk"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len <= CHECK_NEW_TOKENS:
            raise ValueError(f"--seq-len must exceed {CHECK_NEW_TOKENS}, got {self.seq_len}")
        if not self.contexts or min(self.contexts) < 1 or not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"--contexts and --batch-sizes must be >= 1, got {self.contexts}, {self.batch_sizes}")
        if self.ppl_tokens < 2:
            raise ValueError(f"--ppl-tokens must be >= 2, got {self.ppl_tokens}")

    @property
    def baseline(self) -> str:
        """The dtype the ratios and the agreement are taken against: auto where it runs, else the first."""
        return "auto" if "auto" in self.kv_cache_dtypes else self.kv_cache_dtypes[0]

    def config(self, kv_cache_dtype: str, kv_cache_memory: str | int, **fields: object) -> EngineConfig:
        return EngineConfig(
            **self.engine_options, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=kv_cache_memory,
            block_size=self.block_size, enable_prefix_caching=False, swap_space=0, **fields,
        )  # fmt: skip


# ----- part 1: capacity -----


def seq_blocks(plan: KVPlan, num_layers: int, block_size: int, num_tokens: int) -> int:
    """Blocks one sequence of ``num_tokens`` holds at once in decode, over its KV groups (the KV manager's count:
    a window group holds what its window sees)."""
    manager = KVCacheManager(1, block_size, plan.groups(num_layers))
    return manager.blocks_needed(num_tokens, 1)


def plan_capacity(loaded: LoadedModel, bench: KVCacheBench, kv_cache_dtype: str) -> dict:
    """Part 1 from the engine's KV plan, no engine built."""
    layers = loaded.config.num_layers
    plan = plan_kv(bench.config(kv_cache_dtype, bench.kv_cache_memory), loaded.config, loaded.dtype)
    per_gib = plan_kv(bench.config(kv_cache_dtype, GIB), loaded.config, loaded.dtype)
    per_seq = seq_blocks(plan, layers, bench.block_size, bench.seq_len)
    return {
        "block_bytes": plan.block_bytes,
        "block_size": bench.block_size,
        "block_layers": plan.block_layers,
        "kv_groups": len(plan.groups(layers)),
        "window_groups": sum(g.sliding_window is not None for g in plan.groups(layers)),
        "bytes_per_token": plan.block_bytes * layers / (plan.block_layers * bench.block_size),
        "num_blocks": plan.num_blocks,
        "seq_blocks": per_seq,
        "seq_bytes": per_seq * plan.block_bytes,
        "sequences": plan.num_blocks // per_seq,
        "sequences_per_gib": per_gib.num_blocks // per_seq,
    }


def check_memory(loaded: LoadedModel, bench: KVCacheBench) -> int:
    """The capacity check's KV memory: ``check_kv_cache_memory``, else room for ``check_sequences`` sequences of
    the baseline's cache."""
    if bench.check_kv_cache_memory is not None:
        return parse_memory_size(bench.check_kv_cache_memory)
    plan = plan_kv(bench.config(bench.baseline, bench.kv_cache_memory), loaded.config, loaded.dtype)
    per_seq = seq_blocks(plan, loaded.config.num_layers, bench.block_size, bench.seq_len)
    return bench.check_sequences * per_seq * plan.block_bytes


@dataclass
class CapacityRun:
    kv_cache_memory: int
    num_blocks: int  # the pool's
    planned_sequences: int  # what the plan fits at this memory
    num_requests: int
    prompt_tokens: int
    new_tokens: int
    peak_running: int  # requests in scheduler.running after a step, the most over the run
    peak_decoding: int  # of those, sequences past their prompt (the prompt's step sampled their first token)
    peak_kv_bytes: int
    preemptions: int
    output_tokens: int
    seconds: float


def measure_capacity(
    loaded: LoadedModel, bench: KVCacheBench, kv_cache_dtype: str, memory: int, log: Log
) -> CapacityRun:
    """More requests of ``seq_len`` tokens than fit, all at once; the most running side by side."""
    planned = plan_capacity(loaded, dataclasses.replace(bench, kv_cache_memory=memory), kv_cache_dtype)
    count = min(bench.check_max_requests, planned["sequences"] + 2)
    prompt_len = bench.seq_len - CHECK_NEW_TOKENS
    prompts = fixed_length_prompts(loaded.tokenizer, count, prompt_len, seed=11)
    # A step's budget takes every prompt: the first step admits as many as the pool holds, and all of them then
    # decode side by side (a budget of one prompt would admit one a step, and the first would finish before the
    # last arrived).
    config = bench.config(kv_cache_dtype, memory, max_num_seqs=count, max_num_batched_tokens=count * prompt_len)
    engine = LLMEngine(config, loaded)
    log(f"  {kv_cache_dtype}: {engine.kv_summary}; {count} requests of {prompt_len} + {CHECK_NEW_TOKENS} tokens")
    params = SamplingParams(max_tokens=CHECK_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [engine.requests[engine.add_request(p, params)] for p in prompts]
    scheduler = engine.scheduler
    preempted = scheduler.num_preemptions
    peak_running = peak_decoding = peak_blocks = output_tokens = done = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        running = [s for r in scheduler.running for s in r.live_seqs]
        peak_running = max(peak_running, len(running))
        peak_decoding = max(peak_decoding, sum(1 for s in running if s.output_token_ids))
        peak_blocks = max(peak_blocks, engine.kv_usage().used_blocks)
        for o in outputs:
            if o.finished:
                done += 1
                output_tokens += len(o.outputs[0].token_ids)
                if done % 4 == 0 or done == count:
                    log(f"  {kv_cache_dtype}: {done}/{count} requests done, peak running {peak_running}")
    run = CapacityRun(
        kv_cache_memory=memory, num_blocks=engine.plan.num_blocks, planned_sequences=planned["sequences"],
        num_requests=count, prompt_tokens=prompt_len, new_tokens=CHECK_NEW_TOKENS, peak_running=peak_running,
        peak_decoding=peak_decoding, peak_kv_bytes=peak_blocks * engine.kv_block_bytes,
        preemptions=scheduler.num_preemptions - preempted, output_tokens=output_tokens,
        seconds=time.perf_counter() - start,
    )  # fmt: skip
    if any(len(r.seqs[0].output_token_ids) != CHECK_NEW_TOKENS for r in requests):
        raise RuntimeError(f"{kv_cache_dtype}: a request of the capacity check stopped early")
    _drop(engine)
    return run


# ----- part 2: decode speed -----


@dataclass
class DecodeCell:
    engine: str  # kvserve or llama.cpp
    kv_cache_dtype: str  # kvserve's name (llama.cpp's cell: the kvserve dtype its KV type stands for)
    kv_type: str  # what the engine ran: kvserve's dtype, or llama.cpp's type_k = type_v
    context: int
    batch: int
    decode_tokens: int  # per sequence
    seconds: float  # the decode steps'
    steps: int
    load_average: float = 0.0  # the 1-minute load average after the cell (other work on a shared machine)

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.decode_tokens / self.seconds

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.seconds / self.steps

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s, "ms_per_step": self.ms_per_step}


def speed_prompts(loaded: LoadedModel, bench: KVCacheBench) -> dict[int, list[list[int]]]:
    """Per context, max(batch_sizes) distinct prompts of that many tokens of real text."""
    count = max(bench.batch_sizes)
    return {c: fixed_length_prompts(loaded.tokenizer, count, c, seed=12 + i) for i, c in enumerate(bench.contexts)}


def speed_memory(loaded: LoadedModel, bench: KVCacheBench) -> int:
    """KV memory holding max(batch) sequences of max(context) + decode tokens in every dtype's cache, with a block
    per sequence and group to spare."""
    tokens = max(bench.contexts) + bench.decode_tokens + 1
    return max(bench.batch_sizes) * widest_seq_bytes(loaded, bench, tokens)


def widest_seq_bytes(loaded: LoadedModel, bench: KVCacheBench, num_tokens: int) -> int:
    """The most bytes one sequence of ``num_tokens`` holds in any of the bench's dtypes, a block per group more."""
    layers = loaded.config.num_layers
    sizes = []
    for kv_dtype in bench.kv_cache_dtypes:
        plan = plan_kv(bench.config(kv_dtype, bench.kv_cache_memory), loaded.config, loaded.dtype)
        blocks = seq_blocks(plan, layers, bench.block_size, num_tokens) + len(plan.groups(layers))
        sizes.append(blocks * plan.block_bytes)
    return max(sizes)


def decode_engine(loaded: LoadedModel, bench: KVCacheBench, kv_cache_dtype: str, memory: int) -> LLMEngine:
    config = bench.config(
        kv_cache_dtype, memory, max_num_seqs=max(bench.batch_sizes), max_num_batched_tokens=bench.prefill_chunk
    )
    engine = LLMEngine(config, loaded)
    warm = fixed_length_prompts(loaded.tokenizer, 2, 16, seed=3)
    time_decode(engine, warm[:1], 4)  # kernels and first-call costs, untimed
    time_decode(engine, warm, 4)
    return engine


def time_decode(engine: LLMEngine, prompts: Sequence[list[int]], decode_tokens: int) -> tuple[float, int]:
    """Run ``prompts`` together, ``decode_tokens + 1`` greedy tokens each: the prompts' steps (which sample the
    first tokens) untimed, then the seconds and count of the steps after that, each one token per sequence."""
    params = SamplingParams(max_tokens=decode_tokens + 1, temperature=0.0, ignore_eos=True)
    requests = [engine.requests[engine.add_request(list(p), params)] for p in prompts]
    while any(r.prefilling for r in requests):
        engine.step()
    sync = synchronizer(engine.config.device)
    preempted = engine.scheduler.num_preemptions
    sync()
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    sync()
    seconds = time.perf_counter() - start
    lengths = [len(r.seqs[0].output_token_ids) for r in requests]
    if lengths != [decode_tokens + 1] * len(requests) or engine.scheduler.num_preemptions != preempted:
        raise RuntimeError(f"decode run cut short or preempted (tokens {lengths}): raise the KV memory")
    return seconds, steps


def measure_decode(
    engine: LLMEngine, kv_cache_dtype: str, bench: KVCacheBench, prompts: dict[int, list[list[int]]], log: Log
) -> list[DecodeCell]:
    cells = []
    for context in bench.contexts:
        for batch in bench.batch_sizes:
            seconds, steps = time_decode(engine, prompts[context][:batch], bench.decode_tokens)
            cell = DecodeCell("kvserve", kv_cache_dtype, kv_cache_dtype, context, batch, bench.decode_tokens,
                              seconds, steps, os.getloadavg()[0])  # fmt: skip
            log(f"  kvserve {kv_cache_dtype}: context {context}, batch {batch}: {cell.tokens_per_s:.1f} tokens/s, "
                f"{cell.ms_per_step:.1f} ms/step")  # fmt: skip
            cells.append(cell)
    return cells


# ----- part 3: accuracy -----


def agreement_prompts(loaded: LoadedModel, count: int) -> tuple[list[list[int]], str]:
    """``count`` ARC-Easy questions, chat-formatted where the model has a chat template, else as plain text."""
    from kvserve.eval.multiple_choice import load_questions

    questions = [q.contexts[0] for q in load_questions("arc_easy", count)]
    tokenizer = loaded.tokenizer
    if tokenizer.chat_template:
        prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
        return prompts, f"{len(prompts)} ARC-Easy questions as one-message chats"
    return [tokenizer.encode(q) for q in questions], f"{len(questions)} ARC-Easy questions as plain text"


def generate_greedy(engine: LLMEngine, prompts: Sequence[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of every prompt, EOS ignored (so every sequence has ``max_tokens``), all submitted at once."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = [engine.requests[engine.add_request(list(p), params)] for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    return [list(r.seqs[0].output_token_ids) for r in requests]


def agreement(reference: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], num_tokens: int) -> dict:
    """Mean over prompts of the common prefix of the two token lists over ``num_tokens``, and the share of prompts
    whose ``num_tokens`` tokens are all the same."""
    if len(reference) != len(outputs) or not reference:
        raise ValueError(f"agreement needs as many outputs as references, got {len(outputs)} and {len(reference)}")
    prefixes = []
    for ref, out in zip(reference, outputs, strict=True):
        n = 0
        while n < min(len(ref), len(out), num_tokens) and ref[n] == out[n]:
            n += 1
        prefixes.append(n)
    return {
        "prefix_agreement": sum(p / num_tokens for p in prefixes) / len(prefixes),
        "identical": sum(p == num_tokens for p in prefixes) / len(prefixes),
        "common_prefix_tokens": prefixes,
    }


def same_top_token(engine: LLMEngine, prompts: Sequence[list[int]], reference: Sequence[Sequence[int]]) -> float:
    """Teacher-forced agreement (llama.cpp's "same top p"): each prompt followed by the reference's greedy tokens,
    the share of those positions where this engine's most likely next token is the reference's token."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    ids = [engine.add_request(list(p) + list(r[:-1]), params) for p, r in zip(prompts, reference, strict=True)]
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    same = total = 0
    for request_id, prompt, ref in zip(ids, prompts, reference, strict=True):
        out = done[request_id]
        # prompt_logprobs[i] scores token i given the tokens before it; position len(prompt) + j predicts ref[j].
        steps = [*out.prompt_logprobs[len(prompt) :], None]
        top_after_last = out.outputs[0].token_ids[0]  # the greedy token after ref[:-1]
        for j, step in enumerate(steps):
            top = max(step, key=step.get) if step is not None else top_after_last
            same += top == ref[j]
            total += 1
    return same / total


def ppl_tokens(loaded: LoadedModel, count: int) -> tuple[list[int], str]:
    """The first ``count`` tokens of WikiText-2's test split and their text."""
    from kvserve.eval.data import WIKITEXT2, require

    text = require(WIKITEXT2, "WikiText-2").read_text(encoding="utf-8")
    tokens = loaded.tokenizer.encode(text[: count * 8], add_special_tokens=False)[:count]
    return tokens, loaded.tokenizer.decode(tokens)


def accuracy_memory(loaded: LoadedModel, bench: KVCacheBench, longest_prompt: int) -> int:
    """Room for 8 perplexity windows or all agreement prompts at once, in every dtype's cache."""
    window = 8 * widest_seq_bytes(loaded, bench, bench.ppl_context + 1)
    return max(
        window, bench.agreement_prompts * widest_seq_bytes(loaded, bench, longest_prompt + bench.agreement_tokens)
    )


def measure_accuracy(
    engine: LLMEngine,
    bench: KVCacheBench,
    tokens: list[int],
    text: str,
    prompts: Sequence[list[int]],
    log: Log,
    reference: Sequence[Sequence[int]] | None = None,
) -> tuple[dict, list[list[int]], float | None]:
    from kvserve.eval.loglikelihood import EngineScorer
    from kvserve.eval.perplexity import evaluate_perplexity

    result = evaluate_perplexity(EngineScorer(engine, progress=False), tokens, text, bench.ppl_context,
                                 bench.ppl_stride)  # fmt: skip
    log(f"  perplexity {result.perplexity:.4f} over {result.scored_tokens:,} tokens ({result.seconds:.1f} s)")
    start = time.perf_counter()
    outputs = generate_greedy(engine, prompts, bench.agreement_tokens)
    log(f"  {len(prompts)} prompts x {bench.agreement_tokens} greedy tokens ({time.perf_counter() - start:.1f} s)")
    same = same_top_token(engine, prompts, reference if reference is not None else outputs)
    log(f"  same top token as the reference's greedy tokens: {same:.1%}")
    return result.as_dict(), outputs, same


# ----- part 4: llama.cpp -----


class LlamaCppKV(WorkerProcess):
    """llama.cpp with one KV type (``type_k = type_v``) and flash attention on, in ``llamacpp_worker.py``."""

    name = "llama.cpp"

    def __init__(self, python: str, model: Path, threads: int, kv_type: str, n_ctx: int, max_seqs: int) -> None:
        command = [python, str(WORKER), str(model), "--threads", str(threads), "--n-ctx", str(n_ctx)]
        command += ["--max-seqs", str(max_seqs), "--type-k", kv_type, "--type-v", kv_type, "--flash-attn", "on"]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self._read()
        self.kv_type = kv_type
        self.load_s = ready["load_s"]
        self.version = ready.get("llama_cpp", "?")
        self.system_info = ready.get("system_info", "")
        self.settings = {k: ready.get(k) for k in ("n_ctx", "kv_unified", "type_k", "type_v", "flash_attn",
                                                   "use_extra_bufts")}  # fmt: skip

    def decode(self, prompts: Sequence[list[int]], decode_tokens: int) -> float:
        """Seconds of the decode steps after every sequence's first token: ``decode_tokens`` each."""
        answer = self._ask({"op": "batch", "prompts": [list(p) for p in prompts], "new_tokens": decode_tokens + 1})
        if any(len(t) != decode_tokens + 1 for t in answer["tokens"]):
            raise RuntimeError("llama.cpp produced fewer tokens than asked")
        return answer["seconds"] - answer["first_token_s"]


def measure_llamacpp(
    python: str, model: Path, threads: int, bench: KVCacheBench, prompts: dict[int, list[list[int]]], log: Log
) -> tuple[list[DecodeCell], dict]:
    """The decode cells for each KV type the bench's dtypes stand for; llama.cpp's version and settings."""
    cells: list[DecodeCell] = []
    info: dict = {"runs": {}}
    n_ctx = max(bench.batch_sizes) * (max(bench.contexts) + bench.decode_tokens + 1) + 256
    for kv_dtype in bench.kv_cache_dtypes:
        kv_type = LLAMACPP_KV_TYPES.get(kv_dtype)
        if kv_type is None or kv_type in info["runs"]:
            continue
        worker = LlamaCppKV(python, model, threads, kv_type, n_ctx, max(bench.batch_sizes))
        try:
            info.update(version=worker.version, system_info=worker.system_info)
            info["runs"][kv_type] = worker.settings
            log(f"  llama.cpp {worker.version}, KV {kv_type}: {worker.settings}")
            worker.decode([prompts[min(bench.contexts)][0][:16]], 4)  # warm-up
            for context in bench.contexts:
                for batch in bench.batch_sizes:
                    seconds = worker.decode(prompts[context][:batch], bench.decode_tokens)
                    cell = DecodeCell("llama.cpp", kv_dtype, kv_type, context, batch, bench.decode_tokens, seconds,
                                      bench.decode_tokens, os.getloadavg()[0])  # fmt: skip
                    log(f"  llama.cpp {kv_type}: context {context}, batch {batch}: {cell.tokens_per_s:.1f} "
                        f"tokens/s, {cell.ms_per_step:.1f} ms/step")  # fmt: skip
                    cells.append(cell)
        finally:
            worker.close()
    return cells, info


# ----- the whole run -----


def run(loaded: LoadedModel, bench: KVCacheBench, log: Log, llamacpp: tuple[str, Path] | None = None) -> dict:
    """The parts ``bench`` asks for, for every dtype; a dict of plain values for the report. ``llamacpp``: the
    interpreter with ``llama_cpp`` and the GGUF file it runs, or None for no peer."""
    results: dict = {"baseline": bench.baseline}
    longest = max(bench.contexts) + bench.decode_tokens
    if bench.speed and longest > loaded.config.max_position_embeddings:  # before minutes of other parts
        raise ValueError(
            f"--contexts {max(bench.contexts)} + --decode-tokens {bench.decode_tokens} is past the model's context of "
            f"{loaded.config.max_position_embeddings} tokens"
        )
    if bench.capacity:
        results["capacity"] = run_capacity(loaded, bench, log)
    if bench.speed:
        results["speed"] = run_speed(loaded, bench, log, llamacpp)
    if bench.accuracy:
        results["accuracy"] = run_accuracy(loaded, bench, log)
    return results


def run_capacity(loaded: LoadedModel, bench: KVCacheBench, log: Log) -> dict:
    memory = check_memory(loaded, bench)
    log(f"capacity: sequences of {bench.seq_len} tokens; checked by running at {_size(memory)} of KV")
    plans = {d: plan_capacity(loaded, bench, d) for d in bench.kv_cache_dtypes}
    for d, p in plans.items():
        log(f"  {d}: {p['bytes_per_token']:,.0f} bytes/token, {p['sequences']} sequences in {bench.kv_cache_memory}, "
            f"{p['sequences_per_gib']} per GiB")  # fmt: skip
    measured = {d: asdict(measure_capacity(loaded, bench, d, memory, log)) for d in bench.kv_cache_dtypes}
    base_plan, base_run = plans[bench.baseline], measured[bench.baseline]
    rows = {}
    for d in bench.kv_cache_dtypes:
        p, m = plans[d], measured[d]
        rows[d] = {
            "plan": p, "measured": m,
            "vs_baseline": {
                "bytes_per_token": base_plan["bytes_per_token"] / p["bytes_per_token"],
                "sequences_per_gib": _ratio(p["sequences_per_gib"], base_plan["sequences_per_gib"]),
                "peak_running": _ratio(m["peak_running"], base_run["peak_running"]),
            },
        }  # fmt: skip
    return {"seq_len": bench.seq_len, "kv_cache_memory": bench.kv_cache_memory, "check_kv_cache_memory": memory,
            "dtypes": rows}  # fmt: skip


def run_speed(loaded: LoadedModel, bench: KVCacheBench, log: Log, llamacpp: tuple[str, Path] | None) -> dict:
    memory = speed_memory(loaded, bench)
    prompts = speed_prompts(loaded, bench)
    log(f"decode speed: contexts {list(bench.contexts)} x batches {list(bench.batch_sizes)}, {bench.decode_tokens} "
        f"tokens each, KV memory {_size(memory)} for every dtype")  # fmt: skip
    cells: list[DecodeCell] = []
    for kv_dtype in bench.kv_cache_dtypes:
        engine = decode_engine(loaded, bench, kv_dtype, memory)
        log(f"  {kv_dtype}: {engine.kv_summary}")
        try:
            cells += measure_decode(engine, kv_dtype, bench, prompts, log)
        finally:
            _drop(engine)
    peer: dict = {}
    if llamacpp is not None:
        python, model = llamacpp
        peer_cells, peer = measure_llamacpp(python, model, torch.get_num_threads(), bench, prompts, log)
        cells += peer_cells
    base = {(c.engine, c.context, c.batch): c.tokens_per_s for c in cells if c.kv_cache_dtype == bench.baseline}
    rows = [{**c.as_dict(), "vs_baseline": _ratio(c.tokens_per_s, base.get((c.engine, c.context, c.batch)))}
            for c in cells]  # fmt: skip
    return {"kv_cache_memory": memory, "cells": rows, "llama.cpp": peer or None}


def run_accuracy(loaded: LoadedModel, bench: KVCacheBench, log: Log) -> dict:
    tokens, text = ppl_tokens(loaded, bench.ppl_tokens)
    prompts, source = agreement_prompts(loaded, bench.agreement_prompts)
    memory = accuracy_memory(loaded, bench, max(len(p) for p in prompts))
    log(f"accuracy: WikiText-2 perplexity over {len(tokens):,} tokens (context {bench.ppl_context}, stride "
        f"{bench.ppl_stride}, chunks of {bench.ppl_chunk}); greedy agreement on {source}")  # fmt: skip
    perplexity, outputs, same = {}, {}, {}
    order = [bench.baseline, *(d for d in bench.kv_cache_dtypes if d != bench.baseline)]  # the reference first
    for kv_dtype in order:
        engine = LLMEngine(bench.config(kv_dtype, memory, max_num_batched_tokens=bench.ppl_chunk), loaded)
        log(f"  {kv_dtype}: {engine.kv_summary}")
        try:
            perplexity[kv_dtype], outputs[kv_dtype], same[kv_dtype] = measure_accuracy(
                engine, bench, tokens, text, prompts, log, outputs.get(bench.baseline)
            )
        finally:
            _drop(engine)
    base = perplexity[bench.baseline]["perplexity"]
    rows = {}
    for kv_dtype in bench.kv_cache_dtypes:
        ppl = perplexity[kv_dtype]
        rows[kv_dtype] = {
            "perplexity": ppl, "perplexity_change": ppl["perplexity"] / base - 1,
            "agreement": agreement(outputs[bench.baseline], outputs[kv_dtype], bench.agreement_tokens),
            "same_top_token": same[kv_dtype],
            "tokens": outputs[kv_dtype],
        }  # fmt: skip
    return {"ppl_tokens": len(tokens), "ppl_context": bench.ppl_context, "ppl_stride": bench.ppl_stride,
            "ppl_chunk": bench.ppl_chunk, "agreement_tokens": bench.agreement_tokens, "prompts": source,
            "kv_cache_memory": memory, "dtypes": rows}  # fmt: skip


def _drop(engine: LLMEngine) -> None:
    """Close the engine and let its KV pool go before the next one is built."""
    engine.close()
    del engine
    gc.collect()


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ----- the report -----


def markdown(report: dict) -> str:
    m, r = report["machine"], report["results"]
    base = r["baseline"]
    lines = [
        f"# KV cache dtypes: {report['model']}, {report['dtype']} model",
        "",
        f"`{report['command']}` on {report['date']}: {report['cpu']}, {m['nproc']} vCPU, {m['memory_gib']} GiB, "
        f"torch {m['torch']}, {report['threads']} threads; model dtype {report['dtype']} (the `auto` cache's), "
        f"weights `{report['weights']}`. Ratios are against `{base}`.",
    ]
    if "capacity" in r:
        lines += ["", *_capacity_lines(r["capacity"], base)]
    if "speed" in r:
        lines += ["", *_speed_lines(r["speed"], base, m["nproc"])]
    if "accuracy" in r:
        lines += ["", *_accuracy_lines(r["accuracy"], base)]
    skipped = [part for part in ("capacity", "speed", "accuracy") if part not in r]
    if skipped:
        lines += ["", f"Not run: {', '.join(skipped)}."]
    return "\n".join(lines) + "\n"


def _capacity_lines(c: dict, base: str) -> list[str]:
    check = c["check_kv_cache_memory"]
    lines = [
        f"## Capacity: sequences of {c['seq_len']:,} tokens",
        "",
        f"From the engine's KV plan (bytes per token: all layers, keys and values; a sequence: the blocks it holds in "
        f"decode), and checked by running at {_size(check)} of KV: more requests than fit arrive at once, "
        f"every prompt computed whole in the first step the pool has room for it, {CHECK_NEW_TOKENS} tokens "
        "generated each; peak running = the most sequences in "
        "the scheduler's running list after a step (decoding: of those, past their prompt).",
    ]
    header = [
        f"| KV dtype | bytes/token | vs {base} | KV/sequence (MiB) | sequences in {c['kv_cache_memory']} | "
        f"per GiB | vs {base} | planned at {_size(check)} | peak running | peak decoding | "
        f"vs {base} | preemptions |",
        "| --- |" + " ---: |" * 11,
    ]
    if any(row["plan"].get("window_groups") for row in c["dtypes"].values()):
        lines += ["", "Window groups keep only what their window sees once a sequence decodes, which the plan counts; "
                  "a prompt computed whole holds every group's blocks for its step, so the run may admit one "
                  "sequence fewer than planned."]  # fmt: skip
    lines += ["", *header]
    for d, row in c["dtypes"].items():
        p, m, v = row["plan"], row["measured"], row["vs_baseline"]
        lines.append(
            f"| {d} | {p['bytes_per_token']:,.0f} | {_x(v['bytes_per_token'])} | {p['seq_bytes'] / 2**20:.1f} | "
            f"{p['sequences']} | {p['sequences_per_gib']} | {_x(v['sequences_per_gib'])} | {m['planned_sequences']} | "
            f"{m['peak_running']} | {m['peak_decoding']} | {_x(v['peak_running'])} | {m['preemptions']} |"
        )
    return lines


def _speed_lines(s: dict, base: str, nproc: int) -> list[str]:
    cells = s["cells"]
    lines = [
        "## Decode speed by context",
        "",
        f"B distinct prompts of real text of each context computed first (not timed), then "
        f"{cells[0]['decode_tokens'] if cells else '?'} tokens each: tokens/s of the steps after every sequence's "
        f"first token. kvserve's KV memory {_size(s['kv_cache_memory'])} for every dtype.",
    ]
    peer = s.get("llama.cpp")
    if peer:
        lines.append(
            f"llama.cpp {peer['version']}: type_k = type_v as named, flash attention on (a quantized V needs it), "
            "use_extra_bufts=False (the model is loaded without llama.cpp's extra CPU buffer types), one KV pool "
            "shared by the batch's sequences; its ratio is against its own f16 cache."
        )
    if cells:
        lines.append(
            f"1-minute load average after the cells: at most {max(c['load_average'] for c in cells):.1f} on "
            f"{nproc} CPUs (this benchmark's threads included; more means other work shared the CPUs)."
        )
    lines += ["", "| engine | KV | context | batch | tokens/s | ms/step | vs " + base + " |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for c in cells:
        lines.append(
            f"| {c['engine']} | {c['kv_type']} | {c['context']:,} | {c['batch']} | {c['tokens_per_s']:.1f} | "
            f"{c['ms_per_step']:.1f} | {_x(c['vs_baseline'])} |"
        )
    return lines


def _accuracy_lines(a: dict, base: str) -> list[str]:
    lines = [
        "## Accuracy",
        "",
        f"WikiText-2 test perplexity over its first {a['ppl_tokens']:,} tokens (windows of {a['ppl_context']}, "
        f"stride {a['ppl_stride']}, prompts computed {a['ppl_chunk']} tokens a step, so later chunks read the "
        f"cache as stored). Greedy agreement with `{base}` on {a['prompts']}, {a['agreement_tokens']} tokens each "
        "(EOS ignored): the mean over prompts of the common prefix over the tokens generated, the share of "
        f"prompts whose tokens are all identical, and the same top token (teacher-forced: after `{base}`'s own "
        "tokens, the share of positions where this cache's most likely token is the one it chose; llama.cpp's "
        '"same top p").',
        "",
        f"| KV dtype | perplexity | vs {base} | agreement | identical | same top token |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for d, row in a["dtypes"].items():
        lines.append(
            f"| {d} | {row['perplexity']['perplexity']:.4f} | {row['perplexity_change']:+.2%} | "
            f"{row['agreement']['prefix_agreement']:.3f} | {row['agreement']['identical']:.0%} | "
            f"{row['same_top_token']:.1%} |"
        )
    return lines


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB" if num_bytes >= 2**20 else f"{num_bytes / 2**10:.1f} KiB"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"
