"""``kvserve generate`` runs one request: its engine's KV pool holds that request's blocks (prompt and max_tokens),
not the server's 1 GiB, and it has no host tier for swapping. The request runs to max_tokens in that pool, with the
same greedy text as in a large pool: over one KV group, over window groups (Gemma 3) and over per-layer groups (a
compressing policy)."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.core.kv_plan import one_request_config, plan_kv
from kvserve.models.loader import load_model
from kvserve.sampling.sampling_params import SamplingParams
from tests.tiny_models import TinySpec, torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixture

PROMPT = "the quick brown fox jumps over the lazy dog, " * 2
MAX_TOKENS = 40
SPECS = {
    "llama": TinySpec(seed=5),
    "gemma3": TinySpec(
        arch="gemma3", num_heads=4, num_kv_heads=2, head_dim=16, num_layers=6, tie_word_embeddings=True,
        extra={"sliding_window": 8, "query_pre_attn_scalar": 16, "hidden_activation": "gelu_pytorch_tanh"},
    ),
}  # fmt: skip
CASES = [("llama", {}), ("llama", {"batch_invariant": True}), ("llama", {"kv_policy": "h2o"}), ("gemma3", {})]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    return {name: str(write_tiny_model(tmp_path_factory.mktemp(name), spec)) for name, spec in SPECS.items()}


def run(config: EngineConfig, loaded) -> tuple[list[int], int, int]:
    """The greedy tokens of PROMPT (max_tokens of them, EOS ignored), and the engine's device and host blocks."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    with LLMEngine(config, loaded) as engine:
        engine.add_request(PROMPT, params)
        outputs = []
        while engine.has_unfinished_requests():
            outputs = engine.step() or outputs
        return list(outputs[0].outputs[0].token_ids), engine.plan.num_blocks, engine.plan.num_host_blocks


@pytest.mark.parametrize(("name", "options"), CASES, ids=[f"{n}-{'-'.join(o) or 'full'}" for n, o in CASES])
def test_one_request_runs_in_a_pool_sized_for_it(models, name, options):
    base = EngineConfig(model=models[name], dtype="float32", kv_cache_memory="16MiB", swap_space="16MiB", **options)
    loaded = load_model(base.model, torch.float32, batch_invariant=base.batch_invariant)
    num_tokens = len(loaded.tokenizer.encode(PROMPT)) + MAX_TOKENS
    sized = one_request_config(base, loaded.config, loaded.dtype, num_tokens)
    plan = plan_kv(base, loaded.config, loaded.dtype)
    groups = len(plan.groups(loaded.config.num_layers))
    assert sized.swap_space == 0
    assert sized.kv_cache_memory == groups * (-(-num_tokens // base.block_size) + 1) * plan.block_bytes
    expected, _, _ = run(base, loaded)
    tokens, num_blocks, num_host_blocks = run(sized, loaded)
    assert tokens == expected and len(tokens) == MAX_TOKENS
    assert num_blocks == sized.kv_cache_memory // plan.block_bytes and num_host_blocks == 0


def test_the_pool_is_never_larger_than_kv_cache_memory(models):
    loaded = load_model(models["llama"], torch.float32)
    config = EngineConfig(model=models["llama"], dtype="float32", kv_cache_memory="64KiB")
    sized = one_request_config(config, loaded.config, loaded.dtype, 10_000)
    assert sized.kv_cache_bytes == 64 * 1024 and sized.swap_space_bytes == 0
