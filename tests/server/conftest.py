"""Fixtures for the HTTP server tests: a tiny random model and a real uvicorn server on a loopback port.

Each server runs in a background thread of the test process (so a test may look at its engine), bound
to a socket on a free port, and is stopped the way uvicorn stops on Ctrl-C.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.models import LoadedModel, load_model
from kvserve.server.api import build_app
from kvserve.server.async_engine import AsyncEngine
from kvserve.server.metrics import ServerMetrics
from tests.tiny_models import TinySpec, torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixture

# A context long enough to hold a request busy for a while (the queue-full test needs one).
TINY_SPEC = TinySpec(num_heads=4, num_kv_heads=2, max_position_embeddings=1024, seed=7)
TINY_NAME = "tiny"
TINY_OPTIONS = dict(dtype="float32", kv_cache_memory="16MiB", swap_space=0, block_size=16, max_num_seqs=64)


@dataclass
class RunningServer:
    url: str
    engine: AsyncEngine
    server: uvicorn.Server
    thread: threading.Thread
    name: str
    api_key: str | None = None

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def client(self, **options) -> openai.OpenAI:
        options.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "unused", **options)

    def async_client(self, **options) -> openai.AsyncOpenAI:
        options.setdefault("max_retries", 0)
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "unused", **options)

    def metrics(self) -> dict[str, float]:
        """/metrics by sample name; labels other than model_name go in braces; histogram buckets left out."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                assert sample.labels.get("model_name") == self.name
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in ("model_name", "le"))
                if "le" not in sample.labels:
                    out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return out

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(
    engine: LLMEngine, name: str = TINY_NAME, api_key: str | None = None, max_queue: int | None = None
) -> RunningServer:
    async_engine = AsyncEngine(engine, ServerMetrics(name), max_queue=max_queue)
    app = build_app(async_engine, name, api_key=api_key, model_aliases=[str(engine.config.model)])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"the server at {url} did not come up")
        time.sleep(0.05)
    return RunningServer(url, async_engine, server, thread, name, api_key)


def wait_until(condition, timeout: float = 20.0) -> None:
    """Poll ``condition()`` until it holds (the engine thread updates state between steps)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the server")
        time.sleep(0.02)


def tiny_engine(folder: Path, loaded: LoadedModel, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), **{**TINY_OPTIONS, **options}), loaded)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("server-tiny"), TINY_SPEC)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_folder) -> LoadedModel:
    return load_model(tiny_folder)


@pytest.fixture(scope="module")
def tiny_server(tiny_folder, tiny_loaded) -> Iterator[RunningServer]:
    """The default tiny server: no API key, no queue bound."""
    running = start_server(tiny_engine(tiny_folder, tiny_loaded))
    yield running
    running.stop()
