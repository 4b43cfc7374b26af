"""A two-"node" tensor-parallel launch on loopback: node 1 is a separate ``kvserve serve --node-rank 1`` process
started with the multi-node flags, node 0 the engine with the same flags; together they generate what one
process does, and node 1 exits cleanly when the engine closes."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.sampling.sampling_params import SamplingParams
from tests.composition.conftest import run, tokens
from tests.tiny_models import TinySpec, write_tiny_model

SPEC = TinySpec(num_heads=4, num_kv_heads=2, num_layers=2, seed=5)
PROMPTS = [torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (19, 27)]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 4])
def test_two_nodes_on_loopback_generate_what_one_process_does(tmp_path, size) -> None:
    folder = write_tiny_model(tmp_path / "model", SPEC)
    options = dict(model=str(folder), dtype="float32", kv_cache_memory="2MiB", block_size=4)
    with LLMEngine(EngineConfig(**options)) as single:
        reference = tokens(run(single, PROMPTS, GREEDY))

    port = _free_port()
    flags = ["--tensor-parallel-size", str(size), "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(port)]  # fmt: skip
    node1 = subprocess.Popen(
        [sys.executable, "-m", "kvserve", "serve", "--model", str(folder), "--dtype", "float32",
         "--kv-cache-memory", "2MiB", "--block-size", "4", *flags, "--node-rank", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        config = EngineConfig(
            **options, tensor_parallel_size=size, nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port
        )
        with LLMEngine(config) as engine:
            assert len(engine.tensor_parallel.workers) == size // 2 - 1  # node 0's own workers
            assert tokens(run(engine, PROMPTS, GREEDY)) == reference
        log, _ = node1.communicate(timeout=60)
        assert node1.returncode == 0, log
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
