"""Tensor parallelism on a tiny random Llama (4 query heads, 2 KV heads, float32) with real worker processes:
sizes 2 and 4 (4 replicates each KV head on two ranks) against one process, through chunked prefill, prefix
hits, preemption by swap and by recompute, n > 1, beams, Prompt Cache and a compression policy; and what
happens when a rank dies or hangs."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.errors import TensorParallelError, UnsupportedModelError
from kvserve.models import load_model
from kvserve.models.sharding import TensorShard
from kvserve.policies.skewing import SKEWING_DIR_ENV
from kvserve.sampling.sampling_params import SamplingParams
from tests.composition.conftest import PML, SCHEMA, run
from tests.tiny_models import TinySpec, torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixture

# Head dim 64: INT4 KV quantises in groups of 64.
SPEC = TinySpec(num_heads=4, num_kv_heads=2, head_dim=64, num_layers=3, max_position_embeddings=512, seed=31)
D = SPEC.head_dim
BLOCK = 4
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
# One block of the tiny model: 3 layers x 2 KV heads x head dim x (k, v) x float32 x 4 tokens.
BLOCK_BYTES = 3 * 2 * D * 2 * 4 * BLOCK
PROMPTS = [torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (37, 23, 30)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tp") / "model", SPEC)


def engine(folder, size: int, **options) -> LLMEngine:
    options = {"dtype": "float32", "kv_cache_memory": "2MiB", "swap_space": "2MiB", "block_size": BLOCK, **options}
    return LLMEngine(EngineConfig(model=str(folder), tensor_parallel_size=size, **options))


def generate(folder, size: int, prompts, params=GREEDY, schema: str | None = None, **options):
    """Outputs of ``prompts`` (run one after another, then all at once) and the engine's preemption count."""
    with engine(folder, size, **options) as e:
        if schema is not None:
            e.register_schema(schema)
            e.encode_modules()
        outputs = [run(e, [p], params)[0] for p in prompts] + run(e, prompts, params)
        return outputs, e.scheduler.num_preemptions


def assert_same(reference, got, tolerance: float = 1e-4) -> None:
    """Token-identical, with every logprob (float32) within ``tolerance``."""
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in reference]
    for a, b in zip(reference, got, strict=True):
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            for la, lb in zip(ca.logprobs or [], cb.logprobs or [], strict=True):
                assert la.keys() == lb.keys()
                assert list(lb.values()) == pytest.approx(list(la.values()), abs=tolerance)


SCENARIOS = {
    "chunked prefill + prefix hits": {"max_num_batched_tokens": 8},
    # 14 blocks hold the longest prompt and its output alone, not the three together.
    "preemption by recompute": {"kv_cache_memory": 14 * BLOCK_BYTES, "preemption_mode": "recompute"},
    "preemption by swap": {"kv_cache_memory": 14 * BLOCK_BYTES, "preemption_mode": "swap"},
    "h2o at half the KV": {"kv_policy": "h2o", "kv_budget": 0.5},
    "pyramid at half the KV": {"kv_policy": "pyramid", "kv_budget": 0.5},
    "snapkv at half the KV": {"kv_policy": "snapkv", "kv_budget": 0.5},
    "offload to the host tier": {"kv_offload": "host", "kv_policy": "full"},
    "INT4 offload": {"kv_offload": "host", "kv_policy": "int4"},
    # Rank 0 of the one-process run writes the skewing file; the ranks of size 2 read their heads' share.
    "InfiniGen": {"kv_offload": "disk", "kv_policy": "infinigen"},
    # Rows are quantized per (token, KV head): each rank's heads quantize as they do in one process, up to a code
    # rounded the other way where the ranks' summed projections differ in their last bit (logprobs within 5e-3 for
    # int8; an int4 code is a 17x coarser step, so 2e-2: 5.6e-3 measured on an AVX2 EPYC).
    "int8 KV cache, chunked": {"kv_cache_dtype": "int8", "max_num_batched_tokens": 8},
    "int4 KV cache": {"kv_cache_dtype": "int4"},
}


@pytest.fixture(scope="module", autouse=True)
def skewing_dir(tmp_path_factory):
    """InfiniGen's skewing goes to a temporary folder (the workers inherit the variable), never the user's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SKEWING_DIR_ENV, str(tmp_path_factory.mktemp("skewing")))
        yield


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_size_2_generates_what_one_process_does(folder, scenario) -> None:
    options = SCENARIOS[scenario]
    reference, preempted = generate(folder, 1, PROMPTS, **options)
    got, preempted_tp = generate(folder, 2, PROMPTS, **options)
    quantized = {"int8": 5e-3, "int4": 2e-2}
    assert_same(reference, got, quantized.get(options.get("kv_cache_dtype"), 1e-4))
    assert preempted_tp == preempted
    if "preemption" in scenario:
        assert preempted > 0
    if "prefix" in scenario:
        assert got[-3].num_cached_tokens > 0  # the batch re-runs the prompts the singles cached


@pytest.mark.slow
def test_size_4_replicates_kv_heads_and_matches_one_process(folder) -> None:
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0, max_tokens=8, ignore_eos=True)
    reference, _ = generate(folder, 1, PROMPTS[:2], params)
    got, _ = generate(folder, 4, PROMPTS[:2], params)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in reference]
    for a, b in zip(reference, got, strict=True):
        assert [c.cumulative_logprob for c in b.outputs] == pytest.approx([c.cumulative_logprob for c in a.outputs])


@pytest.mark.slow
def test_infinigen_without_a_skewing_file_says_how_to_make_one(folder, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(SKEWING_DIR_ENV, str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="run `kvserve infinigen-setup`"):
        engine(folder, 2, kv_offload="host", kv_policy="infinigen")


@pytest.mark.slow
def test_sampled_n_and_prompt_cache_match_one_process(folder) -> None:
    params = SamplingParams(n=2, seed=5, max_tokens=10, ignore_eos=True, logprobs=2)
    # Under tensor parallelism modules are encoded alone (config.prompt_cache_context): so is the reference.
    reference, _ = generate(folder, 1, [PML], params, schema=SCHEMA, prompt_cache_context="none")
    got, _ = generate(folder, 2, [PML], params, schema=SCHEMA)
    assert_same(reference, got)
    assert got[0].num_cached_tokens > 0  # the modules were imported


def test_shards_hold_their_share_of_every_projection(folder) -> None:
    full = load_model(folder, torch.float32).model
    shards = [load_model(folder, torch.float32, shard=TensorShard(r, 2)) for r in range(2)]
    assert shards[0].config == load_model(folder, torch.float32).config  # the whole model's architecture
    for rank, part in enumerate(shards):
        layer, whole = part.model.layers[1], full.layers[1]
        q, k, v = whole.self_attn.qkv_proj.weight.split((4 * D, 2 * D, 2 * D))
        rows = slice(rank * 2 * D, (rank + 1) * 2 * D)  # two query heads
        kv_rows = slice(rank * D, (rank + 1) * D)  # one KV head
        assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat((q[rows], k[kv_rows], v[kv_rows])))
        assert torch.equal(layer.self_attn.o_proj.weight, whole.self_attn.o_proj.weight[:, rows])
        assert torch.equal(layer.mlp.down_proj.weight, whole.mlp.down_proj.weight[:, rank * 64 : rank * 64 + 64])
        assert part.model.config.num_kv_heads == 1 and part.model.config.intermediate_size == 64


@pytest.mark.parametrize(("size", "dimension"), [(3, "num_heads"), (8, "num_heads")])
def test_sizes_that_do_not_divide_the_model_are_refused_naming_the_dimension(folder, size, dimension) -> None:
    with pytest.raises(UnsupportedModelError, match=f"tensor_parallel_size={size}.*{dimension}"):
        load_model(folder, torch.float32, shard=TensorShard(0, size))


def test_bad_launch_options_are_refused_before_anything_starts() -> None:
    cases = {
        "multiple of nnodes": {"tensor_parallel_size": 3, "nnodes": 2, "master_port": 1234},
        "node_rank must be in 0..1": {"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 2, "master_port": 1234},
        "fixed master_port": {"tensor_parallel_size": 2, "nnodes": 2},
        "KV-Runahead": {"tensor_parallel_size": 2, "prefill_parallel": 2},
        "batch_invariant": {"tensor_parallel_size": 2, "batch_invariant": True},
        "kv_pool_limit=1 with tensor_parallel_size": {
            "tensor_parallel_size": 2,
            "kv_offload": "host",
            "kv_policy": "infinigen",
            "kv_pool_limit": 0.5,
        },
    }
    for message, options in cases.items():
        with pytest.raises(ValueError, match=message):
            EngineConfig(**options)
    refusal = EngineConfig(tensor_parallel_size=2, prompt_cache_tier="host").prompt_cache_refusal()
    assert refusal is not None and "each rank holds its own heads" in refusal


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


@pytest.mark.slow
def test_a_killed_rank_fails_the_running_request_and_the_engine_refuses_new_ones(folder) -> None:
    e = engine(folder, 2)
    pids = [w.pid for w in e.tensor_parallel.workers]
    try:
        e.add_request(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
        e.step()
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(TensorParallelError, match="lost"):
            for _ in range(200):
                e.step()
        assert "lost" in e.health_error()
        with pytest.raises(TensorParallelError, match="lost"):
            e.add_request(PROMPTS[1], GREEDY)
    finally:
        e.close()
    assert _alive(pids) == []


@pytest.mark.slow
def test_a_hung_rank_fails_the_step_within_the_timeout(folder) -> None:
    e = engine(folder, 2, tensor_parallel_timeout=3.0)
    pid = e.tensor_parallel.workers[0].pid
    try:
        run(e, [PROMPTS[0]], GREEDY)  # warm: the group works
        os.kill(pid, signal.SIGSTOP)
        e.add_request(PROMPTS[1], GREEDY)
        start = time.monotonic()
        with pytest.raises(TensorParallelError):
            while e.has_unfinished_requests():
                e.step()
        assert time.monotonic() - start < 30
        assert e.health_error() is not None
    finally:
        if _alive([pid]):
            os.kill(pid, signal.SIGCONT)
        e.close()
    assert _alive([pid]) == []


@pytest.mark.slow
def test_gemma3_with_sliding_window_groups_matches_one_process(tmp_path) -> None:
    """Gemma 3's per-head q/k norms and window KV groups (prompts three to five windows long) shard like the rest."""
    spec = TinySpec(
        arch="gemma3", num_heads=4, num_kv_heads=2, head_dim=16, num_layers=6, tie_word_embeddings=True,
        extra={"sliding_window": 8, "query_pre_attn_scalar": 16, "hidden_activation": "gelu_pytorch_tanh"},
    )  # fmt: skip
    gemma = write_tiny_model(tmp_path / "gemma3", spec)
    prompts = [p[:40] for p in PROMPTS]
    reference, _ = generate(gemma, 1, prompts, max_num_batched_tokens=16)
    got, _ = generate(gemma, 2, prompts, max_num_batched_tokens=16)
    assert_same(reference, got)
