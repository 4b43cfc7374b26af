"""``kvserve bench serve`` against a fake OpenAI-compatible SSE server with known chunks and delays."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvserve.bench import serve
from kvserve.entrypoints.cli import main
from tests.tiny_models import write_tokenizer

FIRST_DELAY = 0.08  # seconds before the first text chunk
GAP = 0.02  # seconds between text chunks


class FakeOpenAIHandler(BaseHTTPRequestHandler):
    """Streams ``max_tokens`` chunks "t0", "t1", ... after an empty first chunk; prompts starting "FAIL" get a 500."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):
        pass

    def do_GET(self):
        if self.path != "/v1/models":
            self._send_json(404, {"error": {"message": "not found"}})
            return
        self._send_json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def do_POST(self):
        fake = self.server.fake
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        fake.record(body)
        chat = self.path == "/v1/chat/completions"
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if prompt.startswith("FAIL"):
            self._send_json(500, {"error": {"message": "induced failure", "type": "server_error"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        fake.enter()
        try:
            n = body["max_tokens"]
            self._event(self._chunk(chat, "", role=True))  # carries no text: must not count as the first token
            time.sleep(FIRST_DELAY)
            for i in range(n):
                if i:
                    time.sleep(GAP)
                self._event(self._chunk(chat, f"t{i}"))
            if fake.send_usage:
                usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
                self._event({"id": "x", "object": "chunk", "choices": [], "usage": usage})
            self._write(b"data: [DONE]\n\n")
            self._write(b"")  # the last chunk of the chunked encoding
        finally:
            fake.leave()

    @staticmethod
    def _chunk(chat: bool, text: str, role: bool = False) -> dict:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else {"content": text}
            return {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
        return {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": text}]}

    def _event(self, payload: dict) -> None:
        self._write(f"data: {json.dumps(payload)}\n\n".encode())

    def _write(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _send_json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class FakeState:
    def __init__(self, send_usage: bool) -> None:
        self.send_usage = send_usage
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()

    def record(self, body: dict) -> None:
        with self._lock:
            self.bodies.append(body)

    def enter(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1


def start_fake(send_usage: bool = True) -> tuple[ThreadingHTTPServer, FakeState]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAIHandler)
    server.daemon_threads = True
    server.fake = FakeState(send_usage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.fake


@pytest.fixture
def fake_server():
    servers = []

    def make(send_usage: bool = True) -> tuple[str, FakeState]:
        server, state = start_fake(send_usage)
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/v1", state

    yield make
    for server in servers:
        server.shutdown()
        server.server_close()


def requests(prompts: list[str], output_len: int) -> list[serve.ServeRequest]:
    return [serve.ServeRequest(p, prompt_len=3, output_len=output_len) for p in prompts]


def test_completions_stream_is_timed_and_counted(fake_server):
    base_url, fake = fake_server()
    target = serve.ServeTarget(base_url, "fake-model")
    results, duration = asyncio.run(serve.run_load(target, requests(["a", "b", "c", "d"], 5), math.inf, 2))

    assert all(r.ok for r in results), [r.error for r in results]
    for r in results:
        assert r.output_tokens == 5 and r.server_prompt_tokens == 7
        assert r.ttft_s >= FIRST_DELAY
        assert len(r.itl_s) == 4
        assert sum(r.itl_s) >= 4 * GAP * 0.9
        assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 4)
        assert r.e2e_s >= r.ttft_s + sum(r.itl_s) - 1e-9
    assert fake.max_in_flight <= 2  # the concurrency cap holds
    assert duration >= 2 * (FIRST_DELAY + 4 * GAP)  # two waves of two

    body = fake.bodies[0]
    assert body["max_tokens"] == 5 and body["ignore_eos"] is True and body["temperature"] == 0
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "fake-model"
    assert sorted(b["prompt"] for b in fake.bodies) == ["a", "b", "c", "d"]  # arrival order between the two is free

    summary = serve.summarize(results, duration)
    assert summary["completed"] == 4 and summary["failed"] == 0
    assert summary["output_tokens"] == 20 and summary["short_requests"] == 0
    assert summary["request_throughput"] == pytest.approx(4 / duration)
    assert summary["output_token_throughput"] == pytest.approx(20 / duration)
    assert summary["ttft_ms"]["p50"] >= FIRST_DELAY * 1000
    assert summary["ttft_ms"]["p99"] >= summary["ttft_ms"]["p50"]
    assert summary["itl_ms"]["mean"] >= GAP * 1000 * 0.5


def test_failures_are_counted_and_reported(fake_server):
    base_url, _ = fake_server()
    target = serve.ServeTarget(base_url, "fake-model")
    batch = requests(["ok 1", "FAIL 1", "ok 2", "FAIL 2", "ok 3"], 2)
    results, duration = asyncio.run(serve.run_load(target, batch, 200.0, seed=3))

    assert [r.ok for r in results] == [True, False, True, False, True]
    assert "HTTP 500" in results[1].error and "induced failure" in results[1].error
    summary = serve.summarize(results, duration)
    assert summary["completed"] == 3 and summary["failed"] == 2
    assert summary["output_tokens"] == 6
    assert any("HTTP 500" in e for e in summary["errors"])


def test_unreachable_server_fails_every_request():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = serve.ServeTarget(f"http://127.0.0.1:{port}/v1", "m")
    results, duration = asyncio.run(serve.run_load(target, requests(["a", "b"], 3), math.inf))
    summary = serve.summarize(results, duration)
    assert summary["failed"] == 2 and summary["completed"] == 0
    assert summary["ttft_ms"]["mean"] is None and summary["output_token_throughput"] == 0


def test_chat_without_usage_counts_text_chunks(fake_server):
    base_url, fake = fake_server(send_usage=False)
    target = serve.ServeTarget(base_url, "fake-model", endpoint="chat")
    results, _ = asyncio.run(serve.run_load(target, requests(["hello"], 3), math.inf))

    (r,) = results
    assert r.ok and r.output_tokens == 3 and r.server_prompt_tokens is None
    assert r.ttft_s >= FIRST_DELAY  # the role-only first delta does not count as the first token
    assert fake.bodies[0]["messages"] == [{"role": "user", "content": "hello"}]


def test_arrivals_are_poisson_and_seeded():
    times = serve.arrival_times(2000, 10.0, seed=1)
    assert times[0] == 0 and times == sorted(times)
    assert times == serve.arrival_times(2000, 10.0, seed=1)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.1)
    assert serve.arrival_times(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="request-rate"):
        serve.arrival_times(3, 0.0, seed=0)


@pytest.mark.slow
def test_cli_sweep_writes_report_and_plot(fake_server, tmp_path, capsys):
    base_url, fake = fake_server()
    write_tokenizer(tmp_path)
    out = tmp_path / "report"
    code = main([
        "bench", "serve", "--base-url", base_url, "--tokenizer", str(tmp_path), "--workload", "synthetic",
        "--num-requests", "3", "--input-len", "12", "--output-len", "2", "--sweep-rates", "100,inf",
        "--concurrency", "2", "--output", str(out),
    ])  # fmt: skip
    assert code == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["model"] == "fake-model" and report["label"] == "fake-model"  # from GET /v1/models
    assert [run["request_rate"] for run in report["runs"]] == [100.0, "inf"]
    for run in report["runs"]:
        assert run["summary"]["completed"] == 3 and run["summary"]["output_tokens"] == 6
    assert report["workload"]["prompt_tokens"] == 36 and "nproc" in report["machine"]
    assert len(fake.bodies) == 6 and all(isinstance(b["prompt"], str) and b["prompt"] for b in fake.bodies)
    assert out.with_suffix(".png").stat().st_size > 1000
    assert "| 100 | 2 | 3 | 0 |" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_compare_with_another_report_draws_both(fake_server, tmp_path):
    base_url, _ = fake_server()
    write_tokenizer(tmp_path)
    common = ["bench", "serve", "--base-url", base_url, "--tokenizer", str(tmp_path), "--workload", "synthetic",
              "--num-requests", "2", "--input-len", "8", "--output-len", "2"]  # fmt: skip
    assert main([*common, "--label", "peer", "--output", str(tmp_path / "peer")]) == 0
    assert not (tmp_path / "peer.png").exists()  # one rate, one server: nothing to plot
    assert main([*common, "--label", "ours", "--compare-with", str(tmp_path / "peer.json"),
                 "--output", str(tmp_path / "ours")]) == 0  # fmt: skip
    assert (tmp_path / "ours.png").stat().st_size > 1000
    assert main([*common, "--compare-with", str(tmp_path / "missing.json")]) == 2
