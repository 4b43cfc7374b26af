"""CPU speed: kvserve against llama.cpp (and transformers) on the same GGUF file and thread count, in one run.

Per engine: load time, prefill time per prompt length (prompt in, first token out), batch-1 decode
tokens/s, and end-to-end output tokens/s for N concurrent sequences (N prompts in at once, each
producing ``new_tokens`` greedy tokens with EOS ignored, so every engine does identical work).
kvserve runs its paged engine with prefix caching off (a repeated prompt must be recomputed);
llama.cpp runs in a worker process (``llamacpp_worker.py``, llama-cpp-python's low-level batched API)
under whatever interpreter has ``llama_cpp`` installed; kvserve runs in a worker process too
(``kvserve_worker.py``) unless asked to run in this one, so each engine's peak resident set (``VmHWM``) is its own.

Each figure is also placed against this machine's roofline, measured in the same run: decode against
copy bandwidth (the bytes of weights one token reads), prefill against the matmul FLOP/s of kvserve's dtype.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from kvserve.models.config import ModelConfig
from kvserve.models.gguf_linear import GGUFLinear
from kvserve.models.layers import Linear, RMSNorm
from kvserve.models.moe import BlockExperts, Experts
from kvserve.models.quant_linear import Q8Linear, QuantLinear
from kvserve.platform.extras import extra_imports

WORKER = Path(__file__).with_name("llamacpp_worker.py")


@dataclass
class SpeedResult:
    engine: str
    load_s: float
    prefill_s: dict[int, float] = field(default_factory=dict)  # prompt length -> seconds
    decode_tokens_per_s: float = 0.0  # batch 1, after a 32-token prompt
    long_decode_tokens_per_s: dict[int, float] = field(default_factory=dict)  # batch 1, context -> tok/s
    batch_tokens_per_s: dict[int, float] = field(default_factory=dict)  # concurrent sequences -> output tok/s
    decode_bytes_per_token: int | None = None  # weight bytes one batch-1 decode step reads
    # Concurrent sequences -> tokens/s of the steps after every sequence's first token (the batch's decode alone).
    batch_decode_tokens_per_s: dict[int, float] = field(default_factory=dict)
    peak_rss_bytes: int | None = None  # the engine's process's resident high-water mark (None: not its own process)


class SpeedEngine(Protocol):
    name: str
    load_s: float
    decode_bytes_per_token: int | None

    def generate(self, ids: Sequence[int], new_tokens: int) -> float:
        """Seconds to prefill ``ids`` and produce ``new_tokens`` greedy tokens."""

    def decode(self, ids: Sequence[int], new_tokens: int) -> float:
        """The same run, timed from its first token to its last: the ``new_tokens - 1`` decode steps alone."""

    def batch(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> float:
        """Seconds to run all ``prompts`` concurrently, ``new_tokens`` greedy tokens each."""

    def close(self) -> None: ...


class KVServeSpeed:
    name = "kvserve"

    def __init__(
        self, model: str, dtype: str, weights: str, max_seqs: int, batch_invariant: bool = False, device: str = "cpu",
        kv_cache_dtype: str = "auto", int8_activations: bool = False, kv_cache_memory: str | int | None = None,
        swap_space: str | int | None = None,
    ) -> None:  # fmt: skip
        from kvserve.entrypoints.llm import LLM

        memory = {"kv_cache_memory": kv_cache_memory, "swap_space": swap_space}  # None: the engine's default
        start = time.perf_counter()
        self.llm = LLM(
            model=model, dtype=dtype, weights=weights, enable_prefix_caching=False, max_num_seqs=max_seqs,
            batch_invariant=batch_invariant, device=device, kv_cache_dtype=kv_cache_dtype,
            int8_activations=int8_activations, **{k: v for k, v in memory.items() if v is not None},
        )  # fmt: skip
        self.load_s = time.perf_counter() - start
        self.decode_bytes_per_token = decode_weight_bytes(self.llm.engine.loaded.model)
        mode = ", batch-invariant" if batch_invariant else ""
        mode += f", {kv_cache_dtype} KV" if kv_cache_dtype != "auto" else ""
        mode += ", int8 activations" if int8_activations else ""
        self.name = f"kvserve ({self.llm.engine.loaded.weights}{mode})"

    def generate(self, ids: Sequence[int], new_tokens: int) -> float:
        return self.batch([ids], new_tokens)

    def decode(self, ids: Sequence[int], new_tokens: int) -> float:
        (output,) = self._run([ids], new_tokens)[1]
        return output.metrics["finish_time"] - output.metrics["first_token_time"]

    def batch(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> float:
        return self._run(prompts, new_tokens)[0]

    def batch_phases(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> tuple[float, float]:
        """``batch``'s seconds, and the seconds until the last sequence's first token."""
        start = time.monotonic()  # the clock of the outputs' metrics
        seconds, outputs = self._run(prompts, new_tokens)
        return seconds, max(o.metrics["first_token_time"] for o in outputs) - start

    def _run(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> tuple[float, list]:
        from kvserve.sampling.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        outputs = self.llm.generate([list(p) for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        _check_lengths(self.name, [o.outputs[0].token_ids for o in outputs], new_tokens)
        return seconds, outputs

    def close(self) -> None:
        del self.llm


class WorkerProcess:
    """An engine in a worker process speaking JSON lines (``llamacpp_worker.py``'s protocol)."""

    process: subprocess.Popen

    def batch_phases(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> tuple[float, float]:
        """``batch``'s seconds, and the seconds until every sequence's first token."""
        answer = self._ask({"op": "batch", "prompts": [list(p) for p in prompts], "new_tokens": new_tokens})
        return answer["seconds"], answer["first_token_s"]

    def peak_rss_bytes(self) -> int | None:
        """The worker's resident high-water mark so far (``VmHWM``), or None where /proc does not tell."""
        return process_peak_rss(self.process.pid)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def _ask(self, command: dict) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker exited (status {self.process.wait()}); see its messages above")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{self.name} worker: {answer['error']}")
        return answer


class KVServeProcess(WorkerProcess):
    """``KVServeSpeed`` in a worker process of its own (``kvserve_worker.py``): the same figures, and a resident set
    that is kvserve's alone."""

    name = "kvserve"

    def __init__(self, threads: int, **options: object) -> None:
        command = [sys.executable, "-m", "kvserve.bench.kvserve_worker", json.dumps(options), "--threads", str(threads)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self._read()
        self.name = ready["name"]
        self.load_s = ready["load_s"]
        self.decode_bytes_per_token = ready["decode_bytes_per_token"]
        self.kv_summary = ready["kv_summary"]

    def generate(self, ids: Sequence[int], new_tokens: int) -> float:
        return self._ask({"op": "generate", "ids": list(ids), "new_tokens": new_tokens})["seconds"]

    def decode(self, ids: Sequence[int], new_tokens: int) -> float:
        return self._ask({"op": "decode", "ids": list(ids), "new_tokens": new_tokens})["seconds"]

    def batch(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> float:
        return self.batch_phases(prompts, new_tokens)[0]


class LlamaCppSpeed(WorkerProcess):
    """llama.cpp in a worker process speaking JSON lines (see ``llamacpp_worker.py``)."""

    name = "llama.cpp"

    def __init__(
        self, python: str, model: Path, threads: int, seq_len: int, max_seqs: int, n_ctx: int | None = None
    ) -> None:
        if n_ctx:  # one pool of n_ctx cells shared by all sequences: a context the size kvserve's KV memory holds
            command = [python, str(WORKER), str(model), "--threads", str(threads), "--n-ctx", str(n_ctx)]
            command += ["--max-seqs", str(max_seqs)]
        else:
            # One KV stream per sequence (--split-kv): each attends over its own cells only, llama.cpp's
            # faster setting for independent sequences; n_ctx is divided among the streams.
            command = [python, str(WORKER), str(model), "--threads", str(threads), "--n-ctx", str(seq_len * max_seqs)]
            command += ["--max-seqs", str(max_seqs), "--split-kv"]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self._read()
        self.load_s = ready["load_s"]
        self.version = ready.get("llama_cpp", "?")
        self.system_info = ready.get("system_info", "")
        self.n_ctx, self.kv_unified = ready.get("n_ctx"), ready.get("kv_unified")
        self.decode_bytes_per_token = gguf_decode_bytes(model)

    def generate(self, ids: Sequence[int], new_tokens: int) -> float:
        return self._generate(ids, new_tokens)["seconds"]

    def decode(self, ids: Sequence[int], new_tokens: int) -> float:
        answer = self._generate(ids, new_tokens)
        return answer["seconds"] - answer["first_token_s"]

    def _generate(self, ids: Sequence[int], new_tokens: int) -> dict:
        answer = self._ask({"op": "generate", "ids": list(ids), "new_tokens": new_tokens})
        _check_lengths(self.name, [answer["tokens"]], new_tokens)
        return answer

    def batch(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> float:
        return self.batch_phases(prompts, new_tokens)[0]

    def batch_phases(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> tuple[float, float]:
        answer = self._ask({"op": "batch", "prompts": [list(p) for p in prompts], "new_tokens": new_tokens})
        _check_lengths(self.name, answer["tokens"], new_tokens)
        return answer["seconds"], answer["first_token_s"]


class TransformersSpeed:
    """Hugging Face transformers on the same GGUF (dequantised), equal-length prompts so no padding."""

    name = "transformers"

    def __init__(self, model: Path, dtype: torch.dtype, device: str = "cpu") -> None:
        with extra_imports("bench", "the transformers peer (--peers without it skips it)"):
            from transformers import AutoModelForCausalLM

        start = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(model.parent, gguf_file=model.name, dtype=dtype)
        self.model = self.model.to(device).eval()
        self.device = torch.device(device)
        self.load_s = time.perf_counter() - start
        embed = self.model.get_input_embeddings().weight
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        tied = self.model.get_output_embeddings().weight is embed
        self.decode_bytes_per_token = params if tied else params - embed.numel() * embed.element_size()

    def generate(self, ids: Sequence[int], new_tokens: int) -> float:
        return self.batch([ids], new_tokens)

    def decode(self, ids: Sequence[int], new_tokens: int) -> float:
        clock = FirstTokenClock()
        seconds = self._generate([ids], new_tokens, clock)
        return seconds - clock.first_token_s

    def batch(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> float:
        return self._generate(prompts, new_tokens)

    @torch.inference_mode()
    def _generate(
        self, prompts: Sequence[Sequence[int]], new_tokens: int, clock: FirstTokenClock | None = None
    ) -> float:
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("transformers is measured on equal-length prompts (no padding)")
        ids = torch.tensor([list(p) for p in prompts], device=self.device)
        sync = synchronizer(self.device)
        sync()
        start = time.perf_counter()
        if clock is not None:
            clock.start = start
        out = self.model.generate(
            input_ids=ids, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
            streamer=clock,
        )  # fmt: skip
        sync()
        seconds = time.perf_counter() - start
        _check_lengths(self.name, out[:, ids.shape[1] :].tolist(), new_tokens)
        return seconds

    def close(self) -> None:
        del self.model


class FirstTokenClock:
    """A transformers streamer that notes when the first new token arrives: ``generate`` puts the prompt first,
    then each step's token (after its step, so the time includes it)."""

    def __init__(self) -> None:
        self.start = 0.0
        self.first_token_s = 0.0
        self._puts = 0

    def put(self, value: torch.Tensor) -> None:
        self._puts += 1
        if self._puts == 2:
            self.first_token_s = time.perf_counter() - self.start

    def end(self) -> None:
        if self._puts < 2:
            raise RuntimeError("transformers streamed no new token")


def synchronizer(device: torch.device | str) -> Callable[[], None]:
    """What waits for the device's queued work before a clock is read (nothing on the CPU)."""
    device = torch.device(device)
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _check_lengths(engine: str, outputs: Sequence[Sequence[int]], expected: int) -> None:
    """A short run would inflate the measured speed."""
    for tokens in outputs:
        if len(tokens) != expected:
            raise RuntimeError(f"{engine} produced {len(tokens)} tokens, expected {expected}")


def measure(
    engine: SpeedEngine,
    prompt_ids: Sequence[int],
    prefill_lengths: Sequence[int],
    decode_tokens: int,
    batch_prompts: Sequence[Sequence[int]],
    batch_sizes: Sequence[int],
    batch_new_tokens: int,
    repeats: int,
    log: Callable[[str], None],
    long_contexts: Sequence[int] = (),
) -> SpeedResult:
    result = SpeedResult(engine.name, engine.load_s, decode_bytes_per_token=engine.decode_bytes_per_token)
    log(f"  {engine.name}: loaded in {engine.load_s:.2f} s")
    engine.generate(prompt_ids[:16], 4)  # warm-up

    def median(run: Callable[[], float], times: int = repeats) -> float:
        return statistics.median(run() for _ in range(times))

    for n in prefill_lengths:
        result.prefill_s[n] = median(lambda n=n: engine.generate(prompt_ids[:n], 1))
        log(f"  {engine.name}: prefill {n} tokens {result.prefill_s[n] * 1000:.0f} ms")
    # Decode speed = N / the time from the first token to the (N + 1)-th, after a short prompt. Timed inside one
    # run: a difference of two runs' times swings with the prefill's noise, which after thousands of tokens
    # is larger than the decode itself.
    short = prompt_ids[:32]
    result.decode_tokens_per_s = decode_tokens / median(lambda: engine.decode(short, decode_tokens + 1))
    log(f"  {engine.name}: batch-1 decode {result.decode_tokens_per_s:.1f} tokens/s")
    for n in long_contexts:  # the same after n tokens of context: attention's share of a step grows with n
        context = prompt_ids[:n]
        seconds = median(lambda c=context: engine.decode(c, decode_tokens + 1))
        result.long_decode_tokens_per_s[n] = decode_tokens / seconds
        log(f"  {engine.name}: batch-1 decode after {n} tokens {result.long_decode_tokens_per_s[n]:.1f} tokens/s")
    phases = getattr(engine, "batch_phases", None)  # the batch's decode timed apart from its prefill, where known
    for b in batch_sizes:
        if phases is None:
            seconds = median(lambda b=b: engine.batch(batch_prompts[:b], batch_new_tokens), max(1, repeats // 2))
        else:
            runs = [phases(batch_prompts[:b], batch_new_tokens) for _ in range(max(1, repeats // 2))]
            seconds = statistics.median(total for total, _ in runs)
            decode_s = statistics.median(total - first for total, first in runs)
            result.batch_decode_tokens_per_s[b] = b * (batch_new_tokens - 1) / decode_s
        result.batch_tokens_per_s[b] = b * batch_new_tokens / seconds
        decode = f", decode {result.batch_decode_tokens_per_s[b]:.1f}" if b in result.batch_decode_tokens_per_s else ""
        log(f"  {engine.name}: {b} sequences, {result.batch_tokens_per_s[b]:.1f} output tokens/s end to end{decode}")
    peak = getattr(engine, "peak_rss_bytes", None)
    result.peak_rss_bytes = peak() if peak is not None else None
    if result.peak_rss_bytes is not None:
        log(f"  {engine.name}: peak resident set {result.peak_rss_bytes / 2**30:.2f} GiB")
    return result


def process_peak_rss(pid: int) -> int | None:
    """Process ``pid``'s resident high-water mark in bytes (``VmHWM`` of ``/proc/PID/status``), or None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def kv_memory_for_tokens(model: ModelConfig, tokens: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of kvserve KV memory that hold ``tokens`` tokens of full context (whole blocks, as its log counts
    them): the same context as a llama.cpp ``n_ctx`` of ``tokens``."""
    from kvserve.config import EngineConfig
    from kvserve.core.kv_plan import plan_kv

    config = EngineConfig(kv_cache_dtype=kv_cache_dtype, swap_space=0)
    plan = plan_kv(config, model, dtype)
    blocks = -(-tokens * model.num_layers // (config.block_size * plan.block_layers))
    return blocks * plan.block_bytes


# ----- roofline -----


@dataclass
class Roofline:
    copy_gb_per_s: float  # read + write bytes per second of a large tensor copy
    matmul_gflop_per_s: float  # a square matmul in matmul_dtype (2048, or smaller where the dtype is emulated)
    matmul_dtype: str  # the activations' dtype of the kvserve run: its prefill is held to this rate


def measure_roofline(dtype: torch.dtype = torch.bfloat16, repeats: int = 10, device: str = "cpu") -> Roofline:
    """The copy bandwidth and matmul rate of the device the engines run on."""
    sync = synchronizer(device)
    src = torch.ones(64 * 2**20, device=device)  # 256 MiB, far beyond the caches
    dst = torch.empty_like(src)
    copy_s = fastest_run(lambda: (dst.copy_(src), sync()), repeats)
    n = 8192 if torch.device(device).type == "cuda" else _matmul_size(dtype)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    mm_s = fastest_run(lambda: (a @ b, sync()), repeats)
    name = str(dtype).removeprefix("torch.")
    return Roofline(2 * src.numel() * 4 / copy_s / 1e9, 2 * n**3 / mm_s / 1e9, name)


def fastest_run(fn: Callable[[], object], repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` runs (after one warm-up): a peak, robust to a busy moment on a
    shared host."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _matmul_size(dtype: torch.dtype, largest: int = 2048, enough_s: float = 0.05) -> int:
    """The side of the peak-rate matmul: 2048, or the first power of two from 256 whose matmul takes ``enough_s``
    (a CPU without AMX or avx512_bf16 emulates bfloat16 at ~1 GFLOP/s: 2048 would take half a minute a run)."""
    n = 256
    while n < largest:
        a = torch.randn(n, n).to(dtype)
        start = time.perf_counter()
        a @ a
        if time.perf_counter() - start >= enough_s:
            return n
        n *= 2
    return largest


def prefill_flops(config: ModelConfig, n: int) -> float:
    """Matmul FLOPs of a causal prefill of n tokens, logits for the last token only."""
    h, layers = config.hidden_size, config.num_layers
    mlp = [
        config.num_experts_per_tok * config.moe_intermediate_size + config.shared_expert_intermediate_size
        if i in config.sparse_layers
        else config.intermediate_size
        for i in range(layers)
    ]  # a sparse layer's token runs its experts' MLPs (and a shared one)
    per_token = h * (config.q_size + 2 * config.kv_size) + config.q_size * h + 3 * h * sum(mlp) / layers
    attention = 2 * 2 * (n * (n + 1) / 2) * config.num_heads * config.head_dim  # QK^T and PV, causal half
    return 2 * n * per_token * layers + attention * layers + 2 * config.vocab_size * h


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a batch-1 decode step reads: int4 / Q8_0 projections in their code form, GGUF blocks as
    the file holds them, dense ones
    whole, norms, and the LM head (a tied head reads the whole embedding matrix); one embedding row only. Of a
    mixture of experts' stacked experts, the share one token routes to (``num_experts_per_tok`` of ``num_experts``)."""
    total = 0
    config = model.config
    for module in model.modules():
        if isinstance(module, (Experts, BlockExperts)):
            parts = module.code_tensors() if isinstance(module, BlockExperts) else (module.gate_up, module.down)
            stacked = sum(t.numel() * t.element_size() for t in parts)
            total += stacked * config.num_experts_per_tok // config.num_experts
            continue
        if isinstance(module, GGUFLinear):
            tensors = [*module.code_tensors(), module.bias]
        elif isinstance(module, QuantLinear):
            tensors = [*module.code_tensors(), module.bias]
        elif isinstance(module, Q8Linear) and module.planes is None:  # else its planes are a QuantLinear
            tensors = module.code_tensors()
        elif isinstance(module, (Linear, RMSNorm)):
            tensors = [module.weight, getattr(module, "bias", None)]
        else:
            continue
        total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    if "lm_head" not in model._modules:  # tied: the head is the embedding matrix
        total += model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def gguf_decode_bytes(path: Path) -> int:
    """Bytes of a GGUF file's tensors that llama.cpp reads per decoded token (a tied embedding is the head; of
    stacked experts, the share one token routes to)."""
    from kvserve.models.gguf_file import open_gguf

    reader = open_gguf(path)
    arch = reader.fields["general.architecture"].contents()
    count = reader.fields.get(f"{arch}.expert_count")
    share = reader.fields[f"{arch}.expert_used_count"].contents() / count.contents() if count else 1.0
    tensors = {t.name: int(t.n_bytes) * (share if "_exps." in t.name else 1) for t in reader.tensors}
    embed = tensors.get("token_embd.weight", 0)
    return int(sum(tensors.values()) - (embed if "output.weight" in tensors else 0))


def find_llamacpp_python(explicit: str | None) -> str:
    """An interpreter that can import ``llama_cpp``: ``explicit``, else this one, else a clear error."""
    candidates = [explicit] if explicit else [sys.executable]
    for python in candidates:
        probe = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True)
        if probe.returncode == 0:
            return python
    raise RuntimeError(
        f"no llama_cpp module for {candidates[0]}: install llama-cpp-python (pip install llama-cpp-python), "
        "pass --llamacpp-python PATH to an interpreter that has it, or --peers without llamacpp"
    )
