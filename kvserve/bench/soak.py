"""Soak test: minutes of mixed, partly hostile traffic against a real ``kvserve serve`` on loopback.

The server runs as a child process (``--prefill-parallel 2`` by default, so a prefill worker can be
killed mid-way). Client tasks send, until the deadline or the request cap:

- ``stream`` / ``chat_stream``: streamed completions and chat; ``complete``: non-streamed, n = 2;
- ``cancel``: a stream closed by the client after its first text chunk;
- ``bad``: requests the server must refuse with a 4xx (a bad sampling value, an unknown role, a
  token id outside the vocabulary); ``oversized``: a body over ``--max-request-bytes`` (413);
- ``pml``: a Prompt Cache prompt over a schema registered at start; ``long``: a prompt long enough
  for parallel prefill.

Beside them a probe times ``GET /health`` every 100 ms and another samples the server's resident
memory every second. At the end the client's count of accepted engine requests is compared with the
server's ``request_success`` counter (every accepted request must end exactly once, cancelled ones
as ``abort``), the queue gauges must be back at 0, and once the server is stopped none of its
processes may be left.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from kvserve.bench.sse import sse_lines
from kvserve.eval.data import AUSTEN

SCHEMA = """<schema name="soak">
  <system>You answer questions about trips.</system>
  <module name="plan">Plan <param name="days" len="4"/> days in <union><module name="paris">Paris, with its museums
  and cafes</module><module name="rome">Rome, with its ruins and churches</module></union>.</module>
</schema>"""
PML_PROMPT = '<prompt schema="soak"><plan days="{days}"><{city}/></plan><user>What should I see first?</user></prompt>'
# How often each kind is sent; hostile kinds are a minority, as on a public endpoint.
KIND_WEIGHTS = {
    "stream": 5, "chat_stream": 3, "complete": 3, "cancel": 2, "bad": 2, "oversized": 1, "pml": 2, "long": 1,
}  # fmt: skip
BAD_BODIES = (
    {"prompt": "Hello", "max_tokens": 8, "temperature": -1.0},
    {"prompt": "Hello", "max_tokens": 8, "stop_token_ids": [10**9]},
    {"messages": [{"role": "wizard", "content": "Hello"}], "max_tokens": 8},
    {"prompt": "Hello", "max_tokens": -3},
)


@dataclass(frozen=True)
class SoakOptions:
    model: str | None = None
    duration_s: float = 600.0
    max_requests: int = 100_000  # bounds the count as the duration bounds the time
    concurrency: int = 8
    prefill_parallel: int = 2
    kill_worker_at: float = 0.5  # fraction of the duration; negative: never
    max_request_bytes: int = 1 << 20
    threads: int | None = None
    seed: int = 0
    extra_server_args: tuple[str, ...] = ()


@dataclass
class Outcome:
    kind: str
    status: int  # HTTP status; 0 when the connection failed
    ok: bool  # what this kind must get (200 and a well-formed end, or the right refusal)
    engine_requests: int = 0  # accepted by the engine: each must end exactly once on the server
    detail: str = ""


@dataclass
class Probes:
    health: list[tuple[float, float, int]] = field(default_factory=list)  # (t, seconds, status)
    rss: list[tuple[float, float, float]] = field(default_factory=list)  # (t, MiB of the server, of its workers)
    events: list[tuple[float, str]] = field(default_factory=list)


# ----- the server -----


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(opts: SoakOptions, port: int, log: Callable[[str], None]) -> subprocess.Popen:
    args = [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), "--log-level", "warning"]
    args += ["--prefill-parallel", str(opts.prefill_parallel), "--max-request-bytes", str(opts.max_request_bytes)]
    if opts.model:
        args += ["--model", opts.model]
    if opts.threads:
        args += ["--threads", str(opts.threads)]
    args += list(opts.extra_server_args)
    log("starting: " + " ".join(args[1:]))
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvserve serve exited with {proc.returncode} during start-up:\n{proc.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"kvserve serve was not healthy within {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen) -> list[int]:
    """Ctrl-C the server; the pids of its processes still alive 30 s later (then killed)."""
    family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    proc.send_signal(signal.SIGINT)
    _, alive = psutil.wait_procs(family, timeout=30)
    for p in alive:
        p.kill()
    return [p.pid for p in alive]


def worker_pids(server_pid: int) -> list[int]:
    """The server's spawned prefill workers (multiprocessing children running ``spawn_main``)."""
    children = psutil.Process(server_pid).children(recursive=True)
    return [c.pid for c in children if any("spawn_main" in part for part in _cmdline(c))]


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def scrape(url: str) -> dict[str, float]:
    """/metrics samples by name, labels other than model_name in braces, summed over nothing."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


# ----- the traffic -----


class Traffic:
    """One client's requests of every kind against ``base`` (``.../v1``)."""

    def __init__(self, client: httpx.AsyncClient, base: str, opts: SoakOptions, rng: random.Random) -> None:
        self.client, self.base, self.opts, self.rng = client, base, opts, rng
        self.text = AUSTEN.read_text(errors="replace")

    async def send(self, kind: str) -> Outcome:
        try:
            return await getattr(self, "_" + kind)()
        except httpx.HTTPError as exc:
            return Outcome(kind, 0, False, detail=f"{type(exc).__name__}: {exc}")

    def _snippet(self, chars: int) -> str:
        start = self.rng.randrange(0, len(self.text) - chars)
        return self.text[start : start + chars]

    async def _stream(self, kind: str = "stream", cancel: bool = False) -> Outcome:
        body: dict = {"max_tokens": self.rng.randint(8, 48), "stream": True, "stream_options": {"include_usage": True}}
        if kind == "chat_stream":
            body["messages"] = [{"role": "user", "content": self._snippet(200)}]
        else:
            body["prompt"] = self._snippet(self.rng.randint(40, 600))
        path = "/chat/completions" if kind == "chat_stream" else "/completions"
        async with self.client.stream("POST", self.base + path, json=body) as response:
            if response.status_code != 200:
                return Outcome(kind, response.status_code, False, detail=(await response.aread()).decode()[:200])
            finishes, done, errors = Counter(), 0, []
            async for line in sse_lines(response):
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done += 1
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event["error"].get("message", ""))
                for choice in event.get("choices", []):
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if cancel and text:
                        return Outcome("cancel", 200, True, engine_requests=1)  # closing the stream cancels it
                    if choice.get("finish_reason") is not None:
                        finishes[choice["index"]] += 1
        ok = done == 1 and not errors and list(finishes.values()) == [1]
        return Outcome(kind, 200, ok, 1, "" if ok else f"done={done} finishes={dict(finishes)} errors={errors[:2]}")

    async def _chat_stream(self) -> Outcome:
        return await self._stream("chat_stream")

    async def _cancel(self) -> Outcome:
        outcome = await self._stream(cancel=True)
        outcome.kind = "cancel"  # a stream that finished before its first text still counts, as a miss
        return outcome

    async def _complete(self, kind: str = "complete", prompt: str | None = None, n: int = 2) -> Outcome:
        body = {"prompt": prompt or self._snippet(300), "max_tokens": self.rng.randint(4, 32), "n": n}
        if n > 1:
            body["temperature"] = 0.8
        response = await self.client.post(self.base + "/completions", json=body)
        if response.status_code != 200:
            return Outcome(kind, response.status_code, False, detail=response.text[:200])
        choices = response.json()["choices"]
        ok = sorted(c["index"] for c in choices) == list(range(n)) and all(c["finish_reason"] for c in choices)
        return Outcome(kind, 200, ok, 1, "" if ok else f"choices={choices!r:.200}")

    async def _pml(self) -> Outcome:
        prompt = PML_PROMPT.format(days=self.rng.randint(1, 9), city=self.rng.choice(("paris", "rome")))
        return await self._complete("pml", prompt, n=1)

    async def _long(self) -> Outcome:
        return await self._complete("long", self._snippet(7000), n=1)  # ~1,700 tokens, a new prefix each time

    async def _bad(self) -> Outcome:
        body = self.rng.choice(BAD_BODIES)
        path = "/chat/completions" if "messages" in body else "/completions"
        response = await self.client.post(self.base + path, json=body)
        ok = response.status_code == 400 and bool(response.json().get("error", {}).get("message"))
        accepted = int(response.status_code == 200)  # wrongly accepted: it still has to end once
        return Outcome("bad", response.status_code, ok, accepted, "" if ok else f"{body} -> {response.text[:200]}")

    async def _oversized(self) -> Outcome:
        body = {"prompt": "a " * (self.opts.max_request_bytes // 2 + 1024), "max_tokens": 1}
        response = await self.client.post(self.base + "/completions", json=body)
        status = response.status_code
        return Outcome("oversized", status, status == 413, int(status == 200), detail=response.text[:200])


async def run_traffic(base: str, opts: SoakOptions, probes: Probes, log: Callable[[str], None]) -> list[Outcome]:
    """Clients send weighted random kinds until the deadline or the request cap."""
    rng = random.Random(opts.seed)
    kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
    outcomes: list[Outcome] = []
    start = time.monotonic()
    deadline = start + opts.duration_s

    async def client_loop(index: int) -> None:
        timeout = httpx.Timeout(300.0, connect=10.0)
        async with httpx.AsyncClient(timeout=timeout) as client:
            traffic = Traffic(client, base, opts, random.Random(opts.seed * 1000 + index))
            while time.monotonic() < deadline and len(outcomes) < opts.max_requests:
                outcomes.append(await traffic.send(rng.choices(kinds, weights)[0]))

    async def progress() -> None:
        while time.monotonic() < deadline:
            await asyncio.sleep(min(10.0, max(0.1, deadline - time.monotonic())))
            failed = sum(not o.ok for o in outcomes)
            log(f"  {time.monotonic() - start:5.0f} s: {len(outcomes)} requests, {failed} not as expected")

    clients = [asyncio.ensure_future(client_loop(i)) for i in range(opts.concurrency)]
    ticker = asyncio.ensure_future(progress())
    await asyncio.gather(*clients)
    ticker.cancel()
    return outcomes


# ----- probes beside the traffic -----


def probe_loop(url: str, server_pid: int, probes: Probes, stop: threading.Event, start: float) -> None:
    """``GET /health`` every 100 ms and the server's memory every second, until ``stop`` is set."""
    family_rss_at = 0.0
    with httpx.Client(timeout=10.0) as client:
        while not stop.wait(0.1):
            sent = time.monotonic()
            try:
                status = client.get(url + "/health").status_code
            except httpx.HTTPError:
                status = 0
            probes.health.append((sent - start, time.monotonic() - sent, status))
            if sent - family_rss_at >= 1.0:
                family_rss_at = sent
                probes.rss.append((sent - start, *_rss_mib(server_pid)))


def _rss_mib(pid: int) -> tuple[float, float]:
    """Resident MiB of the server process and of its workers together (a restarted worker is new)."""
    try:
        server = psutil.Process(pid)
        workers = sum(p.memory_info().rss for p in server.children(recursive=True))
        return server.memory_info().rss / 2**20, workers / 2**20
    except psutil.Error:
        return float("nan"), float("nan")


def kill_worker_later(server_pid: int, delay_s: float, probes: Probes, start: float, stop: threading.Event) -> None:
    """SIGKILL one prefill worker after ``delay_s`` (the engine must notice, keep serving and restart it)."""
    if stop.wait(delay_s):
        return
    pids = worker_pids(server_pid)
    if not pids:
        probes.events.append((time.monotonic() - start, "no prefill worker to kill"))
        return
    os.kill(pids[0], signal.SIGKILL)
    probes.events.append((time.monotonic() - start, f"killed prefill worker {pids[0]}"))


# ----- the run and its report -----


def run_soak(opts: SoakOptions, log: Callable[[str], None]) -> dict:
    """Start the server, send the traffic with the probes running, check every request ended once, stop."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(opts, port, log)
    try:
        wait_healthy(proc, url)
        schema = httpx.post(url + "/v1/schemas", json={"pml": SCHEMA}, timeout=120)
        schema.raise_for_status()
        probes, stop = Probes(), threading.Event()
        start = time.monotonic()
        threads = [threading.Thread(target=probe_loop, args=(url, proc.pid, probes, stop, start), daemon=True)]
        if opts.kill_worker_at >= 0 and opts.prefill_parallel > 1:
            delay = opts.kill_worker_at * opts.duration_s
            threads.append(threading.Thread(target=kill_worker_later, args=(proc.pid, delay, probes, start, stop)))
        for t in threads:
            t.start()
        outcomes = asyncio.run(run_traffic(url + "/v1", opts, probes, log))
        elapsed = time.monotonic() - start
        metrics = _settled_metrics(url)
        stop.set()
        for t in threads:
            t.join()
    finally:
        leftover = stop_server(proc) if proc.poll() is None else []
    return summarize(opts, outcomes, probes, metrics, leftover, elapsed)


def _settled_metrics(url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """/metrics once nothing runs or waits any more (aborts are processed between steps)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape(url)
        busy = _metric(metrics, "kvserve:num_requests_running") + _metric(metrics, "kvserve:num_requests_waiting")
        if busy == 0 or time.monotonic() > deadline:
            return metrics
        time.sleep(0.5)


def _metric(metrics: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in metrics.items() if k == prefix or k.startswith(prefix + "{"))


def summarize(
    opts: SoakOptions, outcomes: list[Outcome], probes: Probes, metrics: dict, leftover: list[int], elapsed: float
) -> dict:
    accepted = sum(o.engine_requests for o in outcomes)
    ended = _metric(metrics, "kvserve:request_success_total")
    latencies = sorted(s for _, s, _ in probes.health)
    server_rss = [m for _, m, _ in probes.rss]
    quarter = max(1, len(server_rss) // 4)
    return {
        "options": asdict(opts),
        "elapsed_s": elapsed,
        "requests": len(outcomes),
        "by_kind": _by_kind(outcomes),
        "unexpected": [asdict(o) for o in outcomes if not o.ok][:20],
        "num_unexpected": sum(not o.ok for o in outcomes),
        "engine_requests_accepted": accepted,
        "engine_requests_ended": ended,
        "ended_by_reason": {k: v for k, v in metrics.items() if k.startswith("kvserve:request_success_total")},
        "exactly_once": accepted == ended,
        "left_running_or_waiting": _metric(metrics, "kvserve:num_requests_running")
        + _metric(metrics, "kvserve:num_requests_waiting"),
        "prefill_metrics": {k: v for k, v in metrics.items() if "prefill" in k},
        "health": {
            "probes": len(latencies),
            "not_200": sum(s != 200 for _, _, s in probes.health),
            "p50_ms": 1000 * latencies[len(latencies) // 2] if latencies else None,
            "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))] if latencies else None,
            "max_ms": 1000 * latencies[-1] if latencies else None,
        },
        "server_rss_mib": {  # the engine's process; workers are restarted, so they are plotted, not compared
            "second_quarter": _median(server_rss[quarter : 2 * quarter]),
            "last_quarter": _median(server_rss[-quarter:]),
            "max": max(server_rss, default=None),
        },
        "events": probes.events,
        "processes_left_after_stop": leftover,
        "timeline": {"health": probes.health, "rss": probes.rss},
    }


def _by_kind(outcomes: list[Outcome]) -> dict[str, dict]:
    out = {}
    for kind in KIND_WEIGHTS:
        mine = [o for o in outcomes if o.kind == kind]
        statuses = dict(Counter(str(o.status) for o in mine))
        out[kind] = {"sent": len(mine), "as_expected": sum(o.ok for o in mine), "statuses": statuses}
    return out


def _median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


def soak_table(report: dict) -> str:
    r = report["results"]
    h, rss = r["health"], r["server_rss_mib"]
    lines = [
        f"# Soak: {r['requests']} requests in {r['elapsed_s']:.0f} s against `kvserve serve` on loopback",
        "",
        f"`{report['command']}` on {report['date']}: {report['machine']['cpu']}, {report['machine']['nproc']} CPUs, "
        f"torch {report['machine']['torch']}; model {report['model']}, {r['options']['concurrency']} clients, "
        f"prefill_parallel {r['options']['prefill_parallel']}.",
        "",
        "| kind | sent | as expected | statuses |",
        "| --- | ---: | ---: | --- |",
    ]
    for kind, k in r["by_kind"].items():
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(k["statuses"].items()))
        lines.append(f"| {kind} | {k['sent']} | {k['as_expected']} | {statuses} |")
    lines += [
        "",
        f"- Every accepted request ended exactly once: **{r['exactly_once']}** ({r['engine_requests_accepted']} "
        f"accepted by the engine, {r['engine_requests_ended']:.0f} ended on the server: "
        + ", ".join(f"{k.split('=')[-1].rstrip('}')} {v:.0f}" for k, v in r["ended_by_reason"].items())
        + f"); running or waiting at the end: {r['left_running_or_waiting']:.0f}.",
        f"- `/health` every 100 ms: p50 {h['p50_ms']:.1f} ms, **p99 {h['p99_ms']:.1f} ms** (goal < 100), "
        f"max {h['max_ms']:.1f} ms, {h['not_200']} of {h['probes']} not 200.",
        f"- Server process memory (RSS, median): {rss['second_quarter']:.0f} MiB in the second quarter, "
        f"{rss['last_quarter']:.0f} MiB in the last, max {rss['max']:.0f} MiB.",
        f"- Events: {'; '.join(f'{t:.0f} s {e}' for t, e in r['events']) or 'none'}; prefill metrics at the end: "
        + (", ".join(f"`{k}` {v:g}" for k, v in r["prefill_metrics"].items()) or "none")
        + ".",
        f"- Processes left after stopping the server: {', '.join(map(str, r['processes_left_after_stop'])) or 'none'}.",
    ]
    return "\n".join(lines) + "\n"
