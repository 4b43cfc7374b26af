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

``chaos=True`` (``--chaos``) adds what can go wrong under a server: I/O faults injected at the tiers
(``KVSERVE_FAULTS``, see ``kvserve/platform/faults.py``: swap copies, the offload disk tier, the Prompt Cache module
directory), a KV memory small enough that requests are preempted to the swap space, Prompt Cache modules
persisted to a ``--prompt-cache-dir``, a second prefill worker killed, ``hangup`` clients that drop a
non-streamed request mid-way, and a restart of the server (traffic paused and drained, the same module
directory) with the first Prompt Cache request's TTFT compared with the warm server's. A request hit by a
fault must end with a clear error that names it; the KV pool is audited once each server is idle (no
request sequence left, no block whose reference count disagrees with the block tables).
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
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from kvserve.bench.sse import sse_lines
from kvserve.eval.data import AUSTEN
from kvserve.platform import faults

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
# --chaos: faults at every tier point (the disk tier's only fire with --kv-offload disk in the server's arguments),
# a 48 MiB KV memory (about 2,200 SmolLM2 tokens) so that the clients' prompts preempt each other to the swap space.
CHAOS_FAULTS = "swap=0.05,kv-disk=0.002,module-dir-write=0.3,module-dir-read=0.3"
CHAOS_SERVER_ARGS = ("--preemption-mode", "swap", "--kv-cache-memory", "48MiB", "--swap-space", "256MiB")
CHAOS_KIND_WEIGHTS = {"hangup": 1}
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
    chaos: bool = False  # faults, swap preemption, persisted modules, a restart and hang-ups (see the docstring)
    restart_at: float = 0.5  # chaos: fraction of the duration at which the server restarts; negative: never
    faults: str = CHAOS_FAULTS  # chaos: the server's KVSERVE_FAULTS

    @property
    def kind_weights(self) -> dict[str, int]:
        return {**KIND_WEIGHTS, **CHAOS_KIND_WEIGHTS} if self.chaos else dict(KIND_WEIGHTS)

    @property
    def kill_times(self) -> list[float]:
        """Fractions of the duration at which a prefill worker is killed: one per server life under chaos."""
        if self.kill_worker_at < 0 or self.prefill_parallel < 2:
            return []
        if not self.chaos or self.restart_at < 0:
            return [self.kill_worker_at]
        first = self.kill_worker_at * self.restart_at
        return [first, self.restart_at + (1 - self.restart_at) * self.kill_worker_at]


@dataclass
class Outcome:
    kind: str
    status: int  # HTTP status; 0 when the connection failed
    ok: bool  # what this kind must get (200 and a well-formed end, or the right refusal)
    engine_requests: int = 0  # accepted by the engine: each must end exactly once on the server
    detail: str = ""
    uncertain: int = 0  # hung up before the answer: the engine may or may not have accepted it
    fault: bool = False  # ended with the clear error of an injected fault (chaos)


@dataclass
class Probes:
    health: list[tuple[float, float, int]] = field(default_factory=list)  # (t, seconds, status)
    rss: list[tuple[float, float, float]] = field(default_factory=list)  # (t, MiB of the server, of its workers)
    events: list[tuple[float, str]] = field(default_factory=list)
    restarts: list[tuple[float, float]] = field(default_factory=list)  # (from, to): the server was down on purpose
    engine_requests: int = 0  # sent by the soak itself (the restart's TTFT requests): each ends once too


# ----- the server -----


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SoakServer:
    """``kvserve serve`` as a child process on a fixed loopback port, its log in a file (a pipe nobody reads
    would fill and block the server in a long run). ``restart()`` stops it and starts it again on the port."""

    def __init__(self, opts: SoakOptions, workdir: Path, log: Callable[[str], None]) -> None:
        self.opts, self.workdir, self.log = opts, workdir, log
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.lives = 0
        self.proc: subprocess.Popen | None = None
        # Set while the server serves, cleared from the moment it is stopped: a worker is killed only while the
        # server serves (a worker killed while the model loads fails the start-up, which is another test).
        self.serving = threading.Event()
        self.lock = threading.Lock()  # held by a kill and by a stop, so neither runs into the other

    @property
    def pid(self) -> int:
        return self.proc.pid

    def args(self) -> list[str]:
        opts = self.opts
        args = [sys.executable, "-m", "kvserve", "serve", "--port", str(self.port), "--log-level", "warning"]
        args += ["--prefill-parallel", str(opts.prefill_parallel), "--max-request-bytes", str(opts.max_request_bytes)]
        if opts.model:
            args += ["--model", opts.model]
        if opts.threads:
            args += ["--threads", str(opts.threads)]
        if opts.chaos:
            args += [*CHAOS_SERVER_ARGS, "--prompt-cache-dir", str(self.workdir / "modules")]
        return args + list(opts.extra_server_args)

    def start(self) -> None:
        args, env = self.args(), dict(os.environ)
        if self.opts.chaos:
            env[faults.ENV], env[faults.ENV + "_SEED"] = self.opts.faults, str(self.opts.seed + self.lives)
        self.lives += 1
        self.log_path = self.workdir / f"server-{self.lives}.log"
        self.log(
            f"starting: {' '.join(args[1:])}" + (f" with {faults.ENV}={self.opts.faults}" if self.opts.chaos else "")
        )
        with open(self.log_path, "w") as log_file:
            self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log_file, text=True, env=env)
        self.wait_healthy()

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"kvserve serve exited with {self.proc.returncode} during start-up:\n{self.log_path.read_text()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.serving.set()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"kvserve serve was not healthy within {timeout_s:.0f} s")

    def register_schema(self) -> float:
        """POST the soak's schema; seconds it took (its modules encode, or load from the module directory)."""
        sent = time.monotonic()
        httpx.post(self.url + "/v1/schemas", json={"pml": SCHEMA}, timeout=300).raise_for_status()
        return time.monotonic() - sent

    def stop(self) -> list[int]:
        """Ctrl-C the server; the pids of its processes still alive 30 s later (then killed)."""
        with self.lock:
            self.serving.clear()
            if self.proc is None or self.proc.poll() is not None:
                return []
            return stop_server(self.proc)

    def log_lines(self, marker: str) -> int:
        """Lines of every life's server log that contain ``marker``."""
        return sum(
            marker in line for path in sorted(self.workdir.glob("server-*.log")) for line in path.open(errors="replace")
        )


def stop_server(proc: subprocess.Popen) -> list[int]:
    """Ctrl-C the server; the pids of its processes still alive 30 s later (then killed)."""
    family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    proc.send_signal(signal.SIGINT)
    _, alive = psutil.wait_procs(family, timeout=30)
    for p in alive:
        p.kill()
    return [p.pid for p in alive]


def first_token_seconds(url: str, prompt: str) -> float:
    """TTFT of one streamed completion, seen by a client: request sent to its first text."""
    body = {"prompt": prompt, "max_tokens": 4, "stream": True, "temperature": 0.0}
    sent = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {") and any(c.get("text") for c in json.loads(line[6:]).get("choices", [])):
                return time.monotonic() - sent
    raise RuntimeError("the stream ended without text")


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
        fault = bool(errors) and self.opts.chaos and all(faults.FAULT_MARK in e for e in errors)
        ok = done == 1 and (not errors or fault) and (list(finishes.values()) == [1] or fault)
        detail = "" if ok else f"done={done} finishes={dict(finishes)} errors={errors[:2]}"
        return Outcome(kind, 200, ok, 1, detail, fault=fault)

    async def _chat_stream(self) -> Outcome:
        return await self._stream("chat_stream")

    async def _cancel(self) -> Outcome:
        outcome = await self._stream(cancel=True)
        outcome.kind = "cancel"  # a stream that finished before its first text still counts, as a miss
        return outcome

    async def _complete(self, kind: str = "complete", prompt: str | None = None, n: int = 2) -> Outcome:
        prompt = prompt or self._snippet(300)
        # echo: each choice starts with this client's own prompt, so an answer given to the wrong request shows
        body = {"prompt": prompt, "max_tokens": self.rng.randint(4, 32), "n": n, "echo": True}
        if n > 1:
            body["temperature"] = 0.8
        response = await self.client.post(self.base + "/completions", json=body)
        if response.status_code == 503 and kind == "pml" and "Retry-After" in response.headers:
            # The pool was full when its module had to be loaded again: busy, never accepted by the engine.
            return Outcome(kind, 503, "no room to load module" in response.text, 0, response.text[:200])
        if response.status_code != 200:
            fault = self.opts.chaos and response.status_code >= 500 and faults.FAULT_MARK in response.text
            return Outcome(kind, response.status_code, fault, int(fault), response.text[:200], fault=fault)
        choices = response.json()["choices"]
        ok = sorted(c["index"] for c in choices) == list(range(n)) and all(c["finish_reason"] for c in choices)
        own = all(c["text"].startswith(prompt) for c in choices)
        return Outcome(kind, 200, ok and own, 1, "" if ok and own else f"own prompt echoed: {own}; {choices!r:.200}")

    async def _hangup(self) -> Outcome:
        """A non-streamed request whose client drops the connection before the answer (or gets it in time)."""
        body = {"prompt": self._snippet(300), "max_tokens": self.rng.randint(48, 128)}
        try:
            response = await self.client.post(self.base + "/completions", json=body, timeout=self.rng.uniform(0.3, 2))
        except httpx.TimeoutException:
            return Outcome("hangup", 0, True, uncertain=1)
        fault = response.status_code >= 500 and faults.FAULT_MARK in response.text
        ok = response.status_code == 200 or fault
        return Outcome("hangup", response.status_code, ok, int(ok), "" if ok else response.text[:200], fault=fault)

    async def _pml(self) -> Outcome:
        prompt = PML_PROMPT.format(days=self.rng.randint(1, 9), city=self.rng.choice(("paris", "rome")))
        return await self._complete("pml", prompt, n=1)

    async def _long(self) -> Outcome:
        # ~1,700 tokens, a new prefix each time; under chaos ~850 (at most ~960), inside the 48 MiB cache's 1,088
        chars = 3500 if self.opts.chaos else 7000
        return await self._complete("long", self._snippet(chars), n=1)

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


@dataclass
class Life:
    """One server process's part of the run: its metrics once idle, and the restart measurements."""

    start_s: float
    metrics: dict[str, float] = field(default_factory=dict)  # settled, at its end
    schema_s: float = 0.0  # registering the soak's schema (encoding, or loading persisted modules)
    first_pml_ttft_s: float | None = None  # the first Prompt Cache request of this life
    warm_pml_ttft_s: float | None = None  # the same request again at the end of the life


async def run_traffic(
    server: SoakServer, opts: SoakOptions, probes: Probes, lives: list[Life], log: Callable[[str], None], start: float
) -> list[Outcome]:
    """Clients send weighted random kinds until the deadline or the request cap; under chaos the traffic pauses,
    drains and resumes around a restart of the server."""
    rng = random.Random(opts.seed)
    weights = opts.kind_weights
    kinds = list(weights)
    outcomes: list[Outcome] = []
    deadline = start + opts.duration_s
    running = asyncio.Event()  # cleared while the server restarts
    running.set()
    in_flight = 0

    async def client_loop(index: int) -> None:
        nonlocal in_flight
        timeout = httpx.Timeout(300.0, connect=10.0)
        async with httpx.AsyncClient(timeout=timeout) as client:
            traffic = Traffic(client, server.url + "/v1", opts, random.Random(opts.seed * 1000 + index))
            while time.monotonic() < deadline and len(outcomes) < opts.max_requests:
                await running.wait()
                in_flight += 1
                try:
                    outcomes.append(await traffic.send(rng.choices(kinds, list(weights.values()))[0]))
                finally:
                    in_flight -= 1

    async def progress() -> None:
        while time.monotonic() < deadline:
            await asyncio.sleep(min(10.0, max(0.1, deadline - time.monotonic())))
            failed = sum(not o.ok for o in outcomes)
            log(f"  {time.monotonic() - start:5.0f} s: {len(outcomes)} requests, {failed} not as expected")

    async def restart_later() -> None:
        await asyncio.sleep(opts.restart_at * opts.duration_s)
        running.clear()
        while in_flight:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(restart, server, probes, lives, log, start)
        running.set()

    clients = [asyncio.ensure_future(client_loop(i)) for i in range(opts.concurrency)]
    ticker = asyncio.ensure_future(progress())
    restarter = [asyncio.ensure_future(restart_later())] if opts.chaos and opts.restart_at >= 0 else []
    try:
        await asyncio.gather(*clients, *restarter)  # a failed restart ends the soak with its error
    finally:
        ticker.cancel()
        for task in [*clients, *restarter]:
            task.cancel()
    return outcomes


RESTART_PROMPT = PML_PROMPT.format(days=5, city="rome")


def restart(server: SoakServer, probes: Probes, lives: list[Life], log: Callable[[str], None], start: float) -> None:
    """With no request in flight: the warm server's TTFT of a Prompt Cache request, its settled metrics, a stop,
    a start on the same module directory, the schema registered again and the same request's first TTFT."""
    life = lives[-1]
    life.warm_pml_ttft_s = first_token_seconds(server.url, RESTART_PROMPT)
    probes.engine_requests += 1
    life.metrics = _settled_metrics(server.url)
    down = time.monotonic() - start
    probes.events.append((down, "server restarted"))
    left = server.stop()
    if left:
        probes.events.append((time.monotonic() - start, f"processes left after the stop: {left}"))
    server.start()
    new = Life(time.monotonic() - start)
    new.schema_s = server.register_schema()
    new.first_pml_ttft_s = first_token_seconds(server.url, RESTART_PROMPT)
    probes.engine_requests += 1
    probes.restarts.append((down, time.monotonic() - start))
    lives.append(new)
    log(
        f"  restarted in {time.monotonic() - start - down:.1f} s: schema {new.schema_s:.2f} s, first Prompt Cache "
        f"TTFT {new.first_pml_ttft_s * 1000:.0f} ms (warm before the restart: {life.warm_pml_ttft_s * 1000:.0f} ms)"
    )


# ----- probes beside the traffic -----


def probe_loop(server: SoakServer, probes: Probes, stop: threading.Event, start: float) -> None:
    """``GET /health`` every 100 ms and the server's memory every second, until ``stop`` is set."""
    family_rss_at = 0.0
    with httpx.Client(timeout=10.0) as client:
        while not stop.wait(0.1):
            sent = time.monotonic()
            try:
                status = client.get(server.url + "/health").status_code
            except httpx.HTTPError:
                status = 0
            probes.health.append((sent - start, time.monotonic() - sent, status))
            if sent - family_rss_at >= 1.0:
                family_rss_at = sent
                probes.rss.append((sent - start, *_rss_mib(server.pid)))


def _rss_mib(pid: int) -> tuple[float, float]:
    """Resident MiB of the server process and of its workers together (a restarted worker is new)."""
    try:
        server = psutil.Process(pid)
        workers = sum(p.memory_info().rss for p in server.children(recursive=True))
        return server.memory_info().rss / 2**20, workers / 2**20
    except psutil.Error:
        return float("nan"), float("nan")


def kill_worker_later(server: SoakServer, delay_s: float, probes: Probes, start: float, stop: threading.Event) -> None:
    """SIGKILL one prefill worker after ``delay_s`` (the engine must notice, keep serving and restart it)."""
    if stop.wait(delay_s):
        return
    while not server.serving.wait(0.5):  # restarting: the kill waits for the next life
        if stop.is_set():
            return
    with server.lock:
        try:
            pids = worker_pids(server.pid) if server.serving.is_set() else []
        except psutil.Error:
            pids = []
        if not pids:
            probes.events.append((time.monotonic() - start, "no prefill worker to kill"))
            return
        os.kill(pids[0], signal.SIGKILL)
    probes.events.append((time.monotonic() - start, f"killed prefill worker {pids[0]}"))


# ----- the run and its report -----


def run_soak(opts: SoakOptions, log: Callable[[str], None]) -> dict:
    """Start the server, send the traffic with the probes running, check every request ended once, stop."""
    with tempfile.TemporaryDirectory(prefix="kvserve-soak-") as workdir:
        server = SoakServer(opts, Path(workdir), log)
        leftover: list[int] = []
        try:
            server.start()
            lives = [Life(0.0)]
            lives[0].schema_s = server.register_schema()
            probes, stop = Probes(), threading.Event()
            start = time.monotonic()
            threads = [threading.Thread(target=probe_loop, args=(server, probes, stop, start), daemon=True)]
            for at in opts.kill_times:
                args = (server, at * opts.duration_s, probes, start, stop)
                threads.append(threading.Thread(target=kill_worker_later, args=args, daemon=True))
            for t in threads:
                t.start()
            outcomes = asyncio.run(run_traffic(server, opts, probes, lives, log, start))
            elapsed = time.monotonic() - start
            lives[-1].metrics = _settled_metrics(server.url)
            stop.set()
            for t in threads:
                t.join()
        finally:
            leftover = server.stop()
        fault_lines = server.log_lines(faults.FAULT_MARK) if opts.chaos else 0
    return summarize(opts, outcomes, probes, lives, leftover, elapsed, fault_lines)


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
    opts: SoakOptions,
    outcomes: list[Outcome],
    probes: Probes,
    lives: list[Life],
    leftover: list[int],
    elapsed: float,
    fault_lines: int = 0,
) -> dict:
    accepted = sum(o.engine_requests for o in outcomes) + probes.engine_requests
    uncertain = sum(o.uncertain for o in outcomes)
    ended = sum(_metric(life.metrics, "kvserve:request_success_total") for life in lives)
    ended_by_reason: Counter[str] = Counter()
    for life in lives:
        ended_by_reason.update({k: v for k, v in life.metrics.items() if k.startswith("kvserve:request_success_total")})
    up = [h for h in probes.health if not any(a <= h[0] <= b for a, b in probes.restarts)]
    latencies = sorted(s for _, s, _ in up)
    return {
        "options": {**asdict(opts), "kind_weights": opts.kind_weights},
        "elapsed_s": elapsed,
        "requests": len(outcomes),
        "by_kind": _by_kind(outcomes, opts.kind_weights),
        "unexpected": [asdict(o) for o in outcomes if not o.ok][:20],
        "num_unexpected": sum(not o.ok for o in outcomes),
        "engine_requests_accepted": accepted,
        "engine_requests_uncertain": uncertain,  # hang-ups: each ended once if the engine took it
        "engine_requests_ended": ended,
        "ended_by_reason": dict(ended_by_reason),
        "exactly_once": accepted <= ended <= accepted + uncertain,
        "fault_errors": sum(o.fault for o in outcomes),
        "preemptions": sum(_metric(life.metrics, "kvserve:num_preemptions_total") for life in lives),
        "faults_injected": sum(_metric(life.metrics, "kvserve:faults_injected_total") for life in lives),
        "fault_log_lines": fault_lines,
        "left_running_or_waiting": sum(
            _metric(life.metrics, "kvserve:num_requests_running")
            + _metric(life.metrics, "kvserve:num_requests_waiting")
            for life in lives
        ),
        "kv_audit": [  # per server life, once idle: what requests still hold, blocks lost or freed twice
            {
                "request_sequences": _metric(life.metrics, "kvserve:kv_request_sequences"),
                "leaked_blocks": _metric(life.metrics, "kvserve:kv_leaked_blocks"),
                "kv_cache_usage": _metric(life.metrics, "kvserve:kv_cache_usage_perc"),
            }
            for life in lives
        ],
        "lives": [
            {
                "start_s": life.start_s,
                "schema_s": life.schema_s,
                "first_pml_ttft_s": life.first_pml_ttft_s,
                "warm_pml_ttft_s": life.warm_pml_ttft_s,
            }
            for life in lives
        ],  # fmt: skip
        "prefill_metrics": {k: v for life in lives for k, v in life.metrics.items() if "prefill" in k},
        "health": {
            "probes": len(latencies),
            "not_200": sum(s != 200 for _, _, s in up),
            "during_restarts": len(probes.health) - len(up),
            "p50_ms": 1000 * latencies[len(latencies) // 2] if latencies else None,
            "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))] if latencies else None,
            "max_ms": 1000 * latencies[-1] if latencies else None,
        },
        "server_rss_mib": _rss_halves(probes),
        "events": probes.events,
        "processes_left_after_stop": leftover,
        "timeline": {"health": probes.health, "rss": probes.rss, "restarts": probes.restarts},
    }


def _rss_halves(probes: Probes) -> dict:
    """The server process's RSS: median of the second and of the last quarter of its last life (a restart starts a
    new process, whose memory is compared with itself), and the maximum."""
    since = probes.restarts[-1][1] if probes.restarts else 0.0
    server_rss = [m for t, m, _ in probes.rss if t >= since]
    quarter = max(1, len(server_rss) // 4)
    return {
        "second_quarter": _median(server_rss[quarter : 2 * quarter]),
        "last_quarter": _median(server_rss[-quarter:]),
        "max": max((m for _, m, _ in probes.rss), default=None),
        "since_s": since,
    }


def _by_kind(outcomes: list[Outcome], weights: dict[str, int]) -> dict[str, dict]:
    out = {}
    for kind in weights:
        mine = [o for o in outcomes if o.kind == kind]
        statuses = dict(Counter(str(o.status) for o in mine))
        out[kind] = {
            "sent": len(mine), "as_expected": sum(o.ok for o in mine), "statuses": statuses,
            "fault_errors": sum(o.fault for o in mine), "hung_up": sum(o.uncertain for o in mine),
        }  # fmt: skip
    return out


def _median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


def soak_table(report: dict) -> str:
    r = report["results"]
    h, rss, chaos = r["health"], r["server_rss_mib"], r["options"].get("chaos", False)
    lines = [
        f"# Soak: {r['requests']} requests in {r['elapsed_s']:.0f} s against `kvserve serve` on loopback"
        + (" (chaos)" if chaos else ""),
        "",
        f"`{report['command']}` on {report['date']}: {report['machine']['cpu']}, {report['machine']['nproc']} CPUs, "
        f"torch {report['machine']['torch']}; model {report['model']}, {r['options']['concurrency']} clients, "
        f"prefill_parallel {r['options']['prefill_parallel']}.",
        "",
        "| kind | sent | as expected | fault errors | hung up | statuses |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for kind, k in r["by_kind"].items():
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(k["statuses"].items()))
        lines.append(
            f"| {kind} | {k['sent']} | {k['as_expected']} | {k['fault_errors']} | {k['hung_up']} | {statuses} |"
        )
    lines += [
        "",
        f"- Every accepted request ended exactly once: **{r['exactly_once']}** ({r['engine_requests_accepted']} "
        f"accepted by the engine, {r['engine_requests_uncertain']} hung up before knowing, "
        f"{r['engine_requests_ended']:.0f} ended on the server: "
        + ", ".join(f"{k.split('=')[-1].rstrip('}')} {v:.0f}" for k, v in r["ended_by_reason"].items())
        + f"); running or waiting at the end: {r['left_running_or_waiting']:.0f}.",
        f"- `/health` every 100 ms: p50 {h['p50_ms']:.1f} ms, **p99 {h['p99_ms']:.1f} ms** (goal < 100), "
        f"max {h['max_ms']:.1f} ms, {h['not_200']} of {h['probes']} not 200"
        + (f" ({h['during_restarts']} probes during the restart left out)" if h["during_restarts"] else "")
        + ".",
        f"- Server process memory (RSS, median): {rss['second_quarter']:.0f} MiB in the second quarter, "
        f"{rss['last_quarter']:.0f} MiB in the last"
        + (f" of the process started at {rss['since_s']:.0f} s" if rss["since_s"] else "")
        + f", max {rss['max']:.0f} MiB.",
        "- KV pool once idle, per server life: "
        + "; ".join(
            f"{a['request_sequences']:.0f} request sequences, {a['leaked_blocks']:.0f} leaked blocks, "
            f"usage {a['kv_cache_usage']:.1%}"
            for a in r["kv_audit"]
        )
        + ".",
    ]
    if chaos:
        lives = r["lives"]
        lines.append(
            f"- Preemptions (to the swap space): {r['preemptions']:.0f}. "
            f"Faults injected (`{r['options']['faults']}`): {r['faults_injected']:.0f}; requests that ended with "
            f"the fault's error: {r['fault_errors']}; server log lines naming a fault: {r['fault_log_lines']}."
        )
        if len(lives) > 1 and lives[1]["first_pml_ttft_s"] is not None:
            warm, first = lives[0]["warm_pml_ttft_s"], lives[1]["first_pml_ttft_s"]
            lines.append(
                f"- Restart at {lives[1]['start_s']:.0f} s on the same `--prompt-cache-dir`: schema registered in "
                f"{lives[1]['schema_s']:.2f} s (first start: {lives[0]['schema_s']:.2f} s); first Prompt Cache "
                f"request's TTFT {first * 1000:.0f} ms vs {warm * 1000:.0f} ms on the warm server "
                f"(**{first / warm:.2f}x**)."
            )
    lines += [
        f"- Events: {'; '.join(f'{t:.0f} s {e}' for t, e in r['events']) or 'none'}; prefill metrics at the end: "
        + (", ".join(f"`{k}` {v:g}" for k, v in r["prefill_metrics"].items()) or "none")
        + ".",
        f"- Processes left after stopping the server: {', '.join(map(str, r['processes_left_after_stop'])) or 'none'}.",
    ]
    return "\n".join(lines) + "\n"
