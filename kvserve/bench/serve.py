"""Serving benchmark: an asyncio load generator for any OpenAI-compatible server (kvserve, vLLM, llama.cpp).

Every request streams (``stream: true`` with ``stream_options.include_usage``), asks for exactly its
output length (``max_tokens`` with ``ignore_eos: true``, greedy), and is timed on the client:

- TTFT: from sending the request to the first chunk with non-empty text;
- ITL (inter-token latency): the gaps between successive chunks with non-empty text;
- TPOT (time per output token): ``(e2e - ttft) / (output_tokens - 1)``, per request;
- e2e: from sending the request to the end of its stream.

Output tokens come from the server's ``usage`` when it sends one, otherwise from the number of text
chunks. Arrivals follow a Poisson process at the request rate (exponential gaps, seeded), or all at
time 0 for an infinite rate; an optional concurrency cap holds requests back until a slot frees, and
a request's clock starts when it is sent, not when it arrived.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
import numpy as np

from kvserve.bench.sse import sse_lines
from kvserve.bench.workload import TraceRequest
from kvserve.text.tokenizer import Tokenizer

ENDPOINTS = {"completions": "/completions", "chat": "/chat/completions"}


@dataclass(frozen=True)
class ServeRequest:
    prompt: str  # text, detokenised from the workload's token ids so any server can take it
    prompt_len: int  # tokens in the workload (the server's own count comes back in usage)
    output_len: int  # max_tokens, generated in full because EOS is ignored


@dataclass(frozen=True)
class ServeTarget:
    """Where the requests go and how they are shaped."""

    base_url: str  # ends in /v1
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    request_timeout_s: float = 600.0
    extra_body: dict = field(default_factory=dict)

    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINTS[self.endpoint]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, request: ServeRequest) -> dict:
        body: dict = {
            "model": self.model,
            "max_tokens": request.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        return {**body, **self.extra_body}


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    expected_output_tokens: int
    output_tokens: int = 0
    server_prompt_tokens: int | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def build_requests(tokenizer: Tokenizer, workload: Sequence[TraceRequest]) -> list[ServeRequest]:
    """Token-id prompts as text; the server tokenises them again (close to, not always exactly, the same length)."""
    return [
        ServeRequest(tokenizer.decode(r.prompt_ids, skip_special_tokens=True), len(r.prompt_ids), r.output_len)
        for r in workload
    ]


def arrival_times(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process at ``request_rate`` per second, or all 0."""
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 or inf, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(request_rate)
    return times


async def send_request(client: httpx.AsyncClient, target: ServeTarget, request: ServeRequest) -> RequestResult:
    result = RequestResult(ok=False, prompt_len=request.prompt_len, expected_output_tokens=request.output_len)
    chunks = 0
    usage_tokens = None
    last = start = time.perf_counter()
    try:
        async with client.stream("POST", target.url(), json=target.body(request), headers=target.headers()) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:300]}"
                return result
            async for line in sse_lines(resp):
                event = _parse_sse_line(line)
                if event is None:
                    continue
                if event == "[DONE]":
                    break
                if "error" in event:
                    result.error = f"error in stream: {json.dumps(event['error'])[:300]}"
                    return result
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                    result.server_prompt_tokens = event["usage"].get("prompt_tokens")
                if _chunk_text(event, target.endpoint):
                    now = time.perf_counter()
                    if result.ttft_s is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, OSError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    finally:
        result.e2e_s = time.perf_counter() - start
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    result.ok = chunks > 0
    if not result.ok:
        result.error = "the stream carried no text"
    return result


def _parse_sse_line(line: str) -> dict | str | None:
    if not line.startswith("data:"):
        return None  # blank separators, comments (":"), "event:" lines
    data = line[len("data:") :].strip()
    if data == "[DONE]":
        return data
    return json.loads(data) if data else None


def _chunk_text(event: dict, endpoint: str) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def run_load(
    target: ServeTarget,
    requests: Sequence[ServeRequest],
    request_rate: float,
    concurrency: int | None = None,
    seed: int = 0,
    log: Callable[[str], None] = lambda line: None,
) -> tuple[list[RequestResult], float]:
    """Sends every request at its arrival time; returns the results in request order and the wall time."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {concurrency}")
    arrivals = arrival_times(len(requests), request_rate, seed)
    limit = concurrency or len(requests)
    semaphore = asyncio.Semaphore(limit)
    done = 0
    every = max(1, len(requests) // 10)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    timeout = httpx.Timeout(target.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start = time.perf_counter()

        async def one(request: ServeRequest, at: float) -> RequestResult:
            nonlocal done
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            async with semaphore:
                result = await send_request(client, target, request)
            done += 1
            if done % every == 0 or done == len(requests):
                log(f"  {done}/{len(requests)} requests done, {time.perf_counter() - start:.1f} s")
            return result

        results = await asyncio.gather(*(one(r, at) for r, at in zip(requests, arrivals, strict=True)))
        duration = time.perf_counter() - start
    return list(results), duration


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict:
    """Aggregate metrics of one run; latencies in milliseconds, as mean / p50 / p99 over requests (ITL: over gaps)."""
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "prompt_tokens": sum(r.prompt_len for r in ok),
        "server_prompt_tokens": sum(r.server_prompt_tokens or 0 for r in ok) or None,
        "output_tokens": output_tokens,
        "expected_output_tokens": sum(r.expected_output_tokens for r in ok),
        "short_requests": sum(r.output_tokens < r.expected_output_tokens for r in ok),
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_token_throughput": output_tokens / duration_s if duration_s > 0 else 0.0,
        "ttft_ms": _stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": _stats([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": _stats([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": _stats([r.e2e_s for r in ok]),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    return summary


def _stats(seconds: Sequence[float]) -> dict[str, float | None]:
    if not seconds:
        return {"mean": None, "p50": None, "p99": None}
    ms = np.asarray(seconds, dtype=np.float64) * 1000
    return {"mean": float(ms.mean()), "p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))}


async def first_model_id(base_url: str, api_key: str | None) -> str:
    """The first model the server lists at ``GET /models``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/models"
    try:
        async with httpx.AsyncClient(timeout=30.0) as client:
            resp = await client.get(url, headers=headers)
            resp.raise_for_status()
            models = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise ValueError(f"could not list the models at {url} ({exc}); is the server up? Or pass --model NAME") from exc
    if not models:
        raise ValueError(f"{base_url}/models lists no model; pass --model NAME")
    return models[0]["id"]


def table(runs: Sequence[dict]) -> str:
    """A markdown table, one row per request rate."""
    lines = [
        "| rate (req/s) | conc. | done | failed | req/s | out tok/s | TTFT mean / p50 / p99 (ms) | "
        "TPOT mean / p50 / p99 (ms) | ITL mean / p50 / p99 (ms) | e2e mean / p50 / p99 (ms) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in runs:
        s = run["summary"]
        lines.append(
            f"| {run['request_rate']:g} | {run['concurrency'] or '-'} | {s['completed']} | {s['failed']} | "
            f"{s['request_throughput']:.2f} | {s['output_token_throughput']:.1f} | {_fmt(s['ttft_ms'])} | "
            f"{_fmt(s['tpot_ms'])} | {_fmt(s['itl_ms'])} | {_fmt(s['e2e_ms'])} |"
        )
    return "\n".join(lines) + "\n"


def _fmt(stats: dict[str, float | None]) -> str:
    if stats["mean"] is None:
        return "-"
    return " / ".join(f"{stats[k]:.0f}" if stats[k] >= 10 else f"{stats[k]:.1f}" for k in ("mean", "p50", "p99"))
