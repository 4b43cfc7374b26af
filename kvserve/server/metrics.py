"""Prometheus metrics with vLLM's names under a ``kvserve:`` prefix, in a registry of their own.

Gauges and the engine-wide counters (prefix cache, preemptions) are refreshed by the engine thread
after every step from the scheduler's queues and ``LLMEngine.kv_usage()``; token counters and latency
histograms are fed per request at its first token, at each new token and when it finishes.
prometheus-client is thread-safe, so ``/metrics`` renders while the engine thread writes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvserve.server.metric_prefix import PREFIX

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
    80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0,
)  # fmt: skip


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine thread reads after a step: queue lengths and cumulative engine counters."""

    num_running: int
    num_waiting: int
    num_swapped: int
    kv_usage: float  # used device blocks / all device blocks, 0..1
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    prompt_cache_modules: int = 0  # Prompt Cache modules stored
    prompt_cache_bytes: int = 0  # their KV in their tier
    prompt_cache_encoded_tokens: int = 0  # cumulative: tokens prefilled to encode modules (contexts included)
    prompt_cache_evictions: int = 0  # cumulative
    kv_offload_bytes_fetched: int = 0  # cumulative: offloaded KV moved to the device (kv_offload)
    kv_offload_bytes_stored: int = 0  # cumulative: new KV moved to the slower tier
    kv_request_sequences: int = 0  # sequences of requests holding KV blocks (0 once nothing runs or waits)
    kv_leaked_blocks: int | None = None  # audited only while idle (None: not audited this time)
    faults_injected: int = 0  # cumulative: faults raised at kvserve.platform.faults points (KVSERVE_FAULTS)


class ServerMetrics:
    """Every metric carries a ``model_name`` label; ``render()`` is the ``/metrics`` body."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._last = EngineSnapshot(0, 0, 0, 0.0, 0, 0, 0)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=self.registry)
            return metric.labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_requests_swapped = gauge("num_requests_swapped", "Requests preempted to the host tier.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV cache usage: used blocks / all blocks (1 = 100%).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that produced a first token.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.num_preemptions = counter("num_preemptions", "Preemptions of running requests.")
        self.prompt_cache_modules = gauge("prompt_cache_modules", "Prompt Cache modules stored (encoded or not).")
        self.prompt_cache_bytes = gauge("prompt_cache_bytes", "Bytes of Prompt Cache module KV in its tier.")
        self.prompt_cache_encoded_tokens = counter(
            "prompt_cache_encoded_tokens", "Tokens prefilled to encode Prompt Cache modules (their contexts included)."
        )
        self.prompt_cache_evictions = counter("prompt_cache_evictions", "Prompt Cache modules evicted (LRU).")
        self.kv_offload_bytes_fetched = counter(
            "kv_offload_fetched_bytes", "Bytes of offloaded KV fetched from the slower tier to the device."
        )
        self.kv_offload_bytes_stored = counter(
            "kv_offload_stored_bytes", "Bytes of new KV stored from the device to the slower tier."
        )
        self.kv_request_sequences = gauge(
            "kv_request_sequences", "Sequences of requests holding KV blocks (Prompt Cache modules not counted)."
        )
        self.kv_leaked_blocks = gauge(
            "kv_leaked_blocks",
            "KV blocks whose reference count differs from the block tables holding them (audited when idle; 0).",
        )
        self.faults_injected = counter("faults_injected", "Faults raised by KVSERVE_FAULTS fault injection.")
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first generated token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between successive outputs of a request.", ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from arrival to finish, for requests that were not aborted or failed.",
            E2E_BUCKETS,
        )  # fmt: skip
        self._success = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.", ["model_name", "finished_reason"],
            registry=self.registry,
        )  # fmt: skip
        self._model_name = model_name

    # ----- engine thread -----

    def observe_engine(self, snap: EngineSnapshot) -> None:
        """Set the gauges and add what the cumulative engine counters grew by since the last call."""
        self.num_requests_running.set(snap.num_running)
        self.num_requests_waiting.set(snap.num_waiting)
        self.num_requests_swapped.set(snap.num_swapped)
        self.kv_cache_usage_perc.set(snap.kv_usage)
        last = self._last
        self.prefix_cache_queries.inc(max(0, snap.prefix_query_tokens - last.prefix_query_tokens))
        self.prefix_cache_hits.inc(max(0, snap.prefix_hit_tokens - last.prefix_hit_tokens))
        self.num_preemptions.inc(max(0, snap.num_preemptions - last.num_preemptions))
        self.prompt_cache_modules.set(snap.prompt_cache_modules)
        self.prompt_cache_bytes.set(snap.prompt_cache_bytes)
        self.prompt_cache_encoded_tokens.inc(
            max(0, snap.prompt_cache_encoded_tokens - last.prompt_cache_encoded_tokens)
        )
        self.prompt_cache_evictions.inc(max(0, snap.prompt_cache_evictions - last.prompt_cache_evictions))
        self.kv_offload_bytes_fetched.inc(max(0, snap.kv_offload_bytes_fetched - last.kv_offload_bytes_fetched))
        self.kv_offload_bytes_stored.inc(max(0, snap.kv_offload_bytes_stored - last.kv_offload_bytes_stored))
        self.kv_request_sequences.set(snap.kv_request_sequences)
        if snap.kv_leaked_blocks is not None:
            self.kv_leaked_blocks.set(snap.kv_leaked_blocks)
        self.faults_injected.inc(max(0, snap.faults_injected - last.faults_injected))
        self._last = snap

    def on_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        self.time_to_first_token.observe(ttft)
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_tokens(self, num_new: int, since_last: float | None) -> None:
        self.generation_tokens.inc(num_new)
        if since_last is not None:
            self.inter_token_latency.observe(since_last)

    def on_finish(self, e2e: float, finish_reason: str) -> None:
        if finish_reason not in ("abort", "error"):
            self.e2e_request_latency.observe(e2e)
        self._success.labels(self._model_name, finish_reason).inc()

    def watch_parallel_prefill(self, read: Callable[[], object]) -> None:
        """Export the parallel prefill group's state (``read``: the engine's ``parallel_prefill.state``)."""
        from kvserve.server.prefill_metrics import PrefillGroupCollector

        self.registry.register(PrefillGroupCollector(read, self._model_name))

    def watch_tensor_parallel(self, group: object) -> None:
        """Export the tensor-parallel group's state (``group``: the engine's ``tensor_parallel``)."""
        from kvserve.server.tensor_parallel_metrics import TensorParallelCollector

        self.registry.register(TensorParallelCollector(group, self._model_name))

    # ----- HTTP side -----

    def render(self) -> bytes:
        return generate_latest(self.registry)
