"""``kvserve bench tensor-parallel``: what splitting every layer over N processes costs and buys.

For each size, the engine runs a prefill (one prompt) and decodes (batch 1 and a larger batch); each step's
wall time is split into rank 0's time inside all-reduces and the rest, with the all-reduce calls and bytes
per step. Sizes that do not divide the model's heads or MLP are reported as skipped, with the reason.

The projection turns the measured communication volume into time on faster links with a stated model,
``time = calls x latency + 2 (p - 1) / p x bytes / bandwidth`` (a ring all-reduce moves each byte
2 (p - 1) / p times), and sets it against an ideally split compute time on one H100 (decode: the weights
streamed from HBM once per step; prefill: 2 FLOPs per weight per token at dense bfloat16 peak).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kvserve.sampling.sampling_params import SamplingParams

# (name, bandwidth bytes/s, latency per all-reduce s): stated assumptions, not measurements.
LINKS = (
    ("NVLink 4 (H100 node, NCCL)", 350e9, 10e-6),
    ("400 Gb/s between nodes", 50e9, 25e-6),
    ("100 Gb/s between nodes", 12.5e9, 25e-6),
)
H100_HBM_BYTES_S = 3.35e12
H100_BF16_FLOPS = 990e12
ACTIVATION_BYTES_ON_GPU = 2  # bfloat16 all-reduces on a GPU; here they run in float32 (4 bytes)


@dataclass(frozen=True)
class PhaseCost:
    """Median over the phase's steps, on rank 0."""

    tokens_per_step: int
    step_ms: float
    allreduce_ms: float
    allreduce_calls: float
    allreduce_bytes: float
    head_ms: float  # the LM head's part of the step (replicated: rank 0 alone computes logits)


def measure_size(llm, prompt: list[int], batch: int, decode_steps: int, repeats: int) -> dict[str, PhaseCost]:  # noqa: ANN001 - kvserve.entrypoints.llm.LLM
    """``prefill``: the prompt alone, ``decode b=1`` and ``decode b=BATCH``: a short prompt's next tokens."""
    engine = llm.engine
    group = engine.tensor_parallel
    stats = group.stats if group is not None else None

    def steps(prompts: list[list[int]], max_tokens: int, skip_first: bool) -> list[tuple[float, tuple]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        for ids in prompts:
            engine.add_request(ids, params)
        timed, first = [], True
        while engine.has_unfinished_requests():
            before = stats.snapshot() if stats is not None else None
            start = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - start
            comm = stats.since(before) if stats is not None else None
            if not (skip_first and first):
                timed.append((elapsed, (comm.seconds, comm.calls, comm.bytes) if comm is not None else (0.0, 0, 0)))
            first = False
        return timed

    steps([prompt[:64]], 4, False)  # warm-up
    head_ms = {rows: _head_ms(engine.loaded.model, engine.loaded.dtype, rows, repeats) for rows in (1, batch)}
    phases = {
        "prefill": (lambda: steps([prompt], 1, False), len(prompt)),
        "decode b=1": (lambda: steps([prompt[:32]], decode_steps + 1, True), 1),
        f"decode b={batch}": (lambda: steps([prompt[i : i + 32] for i in range(batch)], decode_steps + 1, True), batch),
    }
    result = {}
    for name, (run, tokens) in phases.items():
        timed = [step for _ in range(repeats) for step in run()]
        result[name] = PhaseCost(
            tokens,
            statistics.median(t for t, _ in timed) * 1e3,
            statistics.median(c[0] for _, c in timed) * 1e3,
            statistics.median(c[1] for _, c in timed),
            statistics.median(c[2] for _, c in timed),
            head_ms[1] if tokens == len(prompt) else head_ms[tokens],  # a prefill samples one row
        )
    return result


def _head_ms(model, dtype: torch.dtype, rows: int, repeats: int) -> float:  # noqa: ANN001 - LlamaForCausalLM
    """The replicated LM head's time for ``rows`` rows on rank 0 (what a vocabulary-parallel head would split)."""
    hidden = torch.randn(rows, model.config.hidden_size, dtype=dtype)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            model.compute_logits(hidden)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def run(
    make_llm: Callable[[int], object],
    sizes: list[int],
    refusal: Callable[[int], str | None],
    prompt: list[int],
    batch: int,
    decode_steps: int,
    repeats: int,
    log: Callable[[str], None],
) -> dict:
    """Every size's phase costs, or the reason it was skipped."""
    costs: dict[int, dict[str, dict]] = {}
    skipped: dict[int, str] = {}
    for size in sizes:
        reason = refusal(size)
        if reason is not None:
            skipped[size] = reason
            log(f"size {size}: skipped ({reason})")
            continue
        log(f"size {size}: starting {size} process(es)")
        llm = make_llm(size)
        try:
            measured = measure_size(llm, prompt, batch, decode_steps, repeats)
        finally:
            llm.close()
        costs[size] = {name: asdict(cost) for name, cost in measured.items()}
        log(f"size {size}: " + ", ".join(f"{n} {c['step_ms']:.1f} ms" for n, c in costs[size].items()))
    return {"costs": costs, "skipped": skipped}


def parameter_count(config) -> int:  # noqa: ANN001 - kvserve.models.config.ModelConfig
    """Weights of the model (embedding, an untied head, the layers' projections; norms left out)."""
    embedding = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    attention = config.hidden_size * (2 * config.q_size + 2 * config.kv_size)
    mlp = 3 * config.hidden_size * config.intermediate_size
    return embedding + config.num_layers * (attention + mlp)


# A Llama-3-70B-shaped model: per all-reduce bytes grow with the hidden size, calls with the layers.
LARGE_MODEL = {"name": "Llama-3-70B-shaped", "parameters": 70.6e9, "hidden": 8192, "layers": 80}


def projection(results: dict, full_parameters: int, scale: tuple[float, float] = (1.0, 1.0)) -> list[dict]:
    """Per measured size > 1 and phase, the all-reduce time on each link and the speed-up it leaves on H100s.
    ``scale``: (bytes, calls) multipliers that carry the measured volumes over to a larger model."""
    rows = []
    weight_bytes = 2 * full_parameters  # bfloat16
    for size, phases in results["costs"].items():
        if int(size) == 1:
            continue
        p = int(size)
        for phase, cost in phases.items():
            if cost["tokens_per_step"] > 64:  # prefill: compute-bound
                one_gpu_s = 2 * full_parameters * cost["tokens_per_step"] / H100_BF16_FLOPS
            else:  # decode: the weights stream from HBM once per step
                one_gpu_s = weight_bytes / H100_HBM_BYTES_S
            gpu_bytes = cost["allreduce_bytes"] * ACTIVATION_BYTES_ON_GPU / 4 * scale[0] * scale[1]
            calls = cost["allreduce_calls"] * scale[1]
            for link, bandwidth, latency in LINKS:
                comm_s = calls * latency + 2 * (p - 1) / p * gpu_bytes / bandwidth
                rows.append({
                    "size": p, "phase": phase, "link": link, "comm_us": comm_s * 1e6,
                    "one_gpu_us": one_gpu_s * 1e6, "speedup": one_gpu_s / (one_gpu_s / p + comm_s),
                })  # fmt: skip
    return rows
