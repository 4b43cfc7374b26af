"""``kvserve serve`` as a user runs it: a subprocess on a tiny model, driven over HTTP, stopped with Ctrl-C."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_health(process: subprocess.Popen, port: int, timeout_s: float = 90.0) -> None:
    """Until ``kvserve serve`` answers /health with 200; fails with its stderr if it exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, process.communicate()[1]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "kvserve serve did not come up"
        time.sleep(0.1)


def interrupt(process: subprocess.Popen) -> str:
    """Ctrl-C ``kvserve serve`` and return its stderr; killed (and the test failed) if it does not stop in 30 s."""
    process.send_signal(signal.SIGINT)
    try:
        return process.communicate(timeout=30)[1]
    except subprocess.TimeoutExpired:
        process.kill()
        raise


@pytest.mark.slow
def test_serve_command_serves_and_stops_cleanly(tiny_folder):
    port = free_port()
    command = [
        sys.executable, "-m", "kvserve", "serve", "--model", str(tiny_folder), "--port", str(port),
        "--threads", "1", "--api-key", "sk-cli", "--max-queue", "8", "--served-model-name", "tiny-cli",
        "--kv-cache-memory", "8MiB", "--block-size", "8", "--max-num-seqs", "4", "--log-level", "warning",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_health(process, port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-cli", max_retries=0)
        assert client.models.list().data[0].id == "tiny-cli"
        response = client.completions.create(model="tiny-cli", prompt="hello", max_tokens=5, temperature=0)
        assert response.usage.completion_tokens <= 5 and response.choices[0].finish_reason in ("stop", "length")
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0) as bad:
            try:
                bad.models.list()
                raise AssertionError("a wrong API key was accepted")
            except openai.AuthenticationError:
                pass
        # n above --max-num-seqs can never run
        try:
            client.completions.create(model="tiny-cli", prompt="hello", max_tokens=5, n=5)
            raise AssertionError("n > max_num_seqs was accepted")
        except openai.BadRequestError as exc:
            assert exc.body["param"] == "n" and "max-num-seqs" in exc.body["message"]
    finally:
        stderr = interrupt(process)
    assert process.returncode == 0, stderr
    assert f"serving tiny-cli at http://127.0.0.1:{port}/v1" in stderr
    assert "KV cache:" in stderr and "blocks x 8 tokens" in stderr


@pytest.mark.slow
def test_serve_with_several_keys_gives_each_its_own_copy_of_the_schema_files(tiny_folder, tmp_path, monkeypatch):
    schema = tmp_path / "s.xml"
    schema.write_text(
        '<schema name="s"><module name="doc">the cat sat on the mat and then it ran off</module></schema>'
    )
    keys = tmp_path / "keys"
    keys.write_text("# tenant B\nsk-b\n")
    monkeypatch.setenv("KVSERVE_API_KEY", "sk-env-ignored")  # the options give keys: the environment's is not one
    port = free_port()
    command = [
        sys.executable, "-m", "kvserve", "serve", "--model", str(tiny_folder), "--port", str(port),
        "--threads", "1", "--api-key", "sk-a", "--api-key-file", str(keys), "--schema", str(schema),
        "--kv-cache-memory", "8MiB", "--block-size", "8", "--max-num-seqs", "4", "--log-level", "warning",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_health(process, port)
        url = f"http://127.0.0.1:{port}/v1/schemas/s"
        assert httpx.delete(url, headers={"Authorization": "Bearer sk-b"}).status_code == 200  # B's copy only
        assert httpx.get(url, headers={"Authorization": "Bearer sk-b"}).status_code == 404
        assert httpx.get(url, headers={"Authorization": "Bearer sk-a"}).status_code == 200
        assert httpx.get(url, headers={"Authorization": "Bearer sk-env-ignored"}).status_code == 401
    finally:
        stderr = interrupt(process)
    assert process.returncode == 0, stderr
    assert "one of 2 API keys required" in stderr and "sk-a" not in stderr and "sk-b" not in stderr
