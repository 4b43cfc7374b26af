"""KV policies in the engine over a tiny random checkpoint: prefill compression against a straightforward
reference of PyramidInfer's Algorithm 1 (and of H2O / local window), lossless at budget 1, blocks returned
to the pool, decode eviction bounds, per-request policies in one batch, errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.kv.sizing import kv_block_bytes
from kvserve.models import LoadedModel, load_model
from kvserve.models.layers import RotaryEmbedding
from kvserve.policies import KVPolicy, make_policy
from kvserve.policies.base import SCORES_ACCUMULATED, SCORES_RECENT
from kvserve.sampling.sampling_params import SamplingParams
from tests.tiny_models import TinySpec, torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixture

SPEC = TinySpec(num_heads=4, num_kv_heads=2, num_layers=6, max_position_embeddings=512, seed=11)
BLOCK = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("policies"), SPEC)


@pytest.fixture(scope="module")
def loaded(folder) -> LoadedModel:
    return load_model(folder, dtype=torch.float32)


def make_engine(folder, loaded, kv_policy="pyramid", kv_budget=0.5, num_layer_blocks=4096, **options) -> LLMEngine:
    """An engine whose pool holds ``num_layer_blocks`` one-layer blocks of 4 tokens (or as many bytes)."""
    cfg = loaded.config
    layer_block = kv_block_bytes(1, cfg.num_kv_heads, cfg.head_dim, 4, BLOCK)
    config = EngineConfig(
        model=str(folder), dtype="float32", block_size=BLOCK, kv_cache_memory=num_layer_blocks * layer_block,
        swap_space=0, kv_policy=kv_policy, kv_budget=kv_budget, **options,
    )  # fmt: skip
    return LLMEngine(config, loaded)


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 290, (n,), generator=g).tolist()


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def drain(engine: LLMEngine, ids: list[str]) -> dict:
    done = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return {i: done[i] for i in ids}


# ----- the reference: Algorithm 1 written out with contiguous tensors -----


@torch.inference_mode()
def reference_prefill(loaded: LoadedModel, ids: list[int], policy: KVPolicy) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: (positions kept, their keys (k, Hkv, D)) for a whole-prompt prefill under ``policy``.

    Each layer attends causally over the rows still present; if they exceed the layer's target the
    policy's scores rank the older ones (PyramidInfer: S_r's ensemble attention; H2O: attention summed
    over every query), the recent window stays, and for PyramidInfer the dropped rows leave the hidden
    states before the MLP.
    """
    model, cfg = loaded.model, loaded.config
    n, heads, kv_heads, d = len(ids), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = model.embed_tokens(torch.tensor(ids))
    positions = torch.arange(n)
    result = []
    for layer_index, layer in enumerate(model.layers):
        r = x.shape[0]
        qkv = layer.self_attn.qkv_proj(layer.input_layernorm(x))
        rope = model.rotary.table(positions, x.dtype)
        q = RotaryEmbedding.apply(qkv[:, : heads * d].view(r, heads, d), rope)
        k = RotaryEmbedding.apply(qkv[:, heads * d : (heads + kv_heads) * d].view(r, kv_heads, d), rope)
        v = qkv[:, (heads + kv_heads) * d :].view(r, kv_heads, d)
        group = heads // kv_heads
        kh, vh = k.repeat_interleave(group, 1).transpose(0, 1), v.repeat_interleave(group, 1).transpose(0, 1)
        logits = q.transpose(0, 1) @ kh.transpose(1, 2) / math.sqrt(d)  # (H, r, r)
        causal = torch.ones(r, r, dtype=torch.bool).tril()
        attn = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        out = (attn @ vh).transpose(0, 1).reshape(r, -1)
        x = x + layer.self_attn.o_proj(out)
        target = policy.slots_after(layer_index, cfg.num_layers, 0, n, n, BLOCK)
        kept = torch.arange(r)
        if r > target:
            mean = attn.mean(dim=0)  # (r queries, r keys)
            if policy.scores == SCORES_RECENT:  # S_r: the last rows, weighted towards the newest
                w = min(policy.recent_count(n), r)
                scores = policy.query_weights(w) @ mean[r - w :]
            elif policy.scores == SCORES_ACCUMULATED:
                scores = mean.sum(dim=0)
            else:
                scores = None
            kept = policy.select(scores, r, target, n)
        result.append((positions[kept], k[kept]))
        if policy.drops_rows:
            x, positions = x[kept], positions[kept]
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return result


def cached_keys(engine: LLMEngine, seq_id: int, layer: int, count: int) -> torch.Tensor:
    cache = engine.runner.cache
    table = engine.kv.block_table(seq_id, layer)
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(count)])
    return cache.k.view(-1, cache.num_kv_heads, cache.head_dim)[slots]


@pytest.mark.parametrize(("name", "budget"), [("pyramid", 0.5), ("pyramid", 0.3), ("h2o", 0.4), ("local", 0.5)])
def test_prefill_compression_matches_the_reference(folder, loaded, name, budget) -> None:
    engine = make_engine(folder, loaded, kv_policy=name, kv_budget=budget)
    ids = prompt_ids(150)
    engine.add_request(ids, greedy(2))
    engine.step()  # the whole prompt in one step, then one token sampled
    ((_, seq),) = engine._seqs.values()
    reference = reference_prefill(loaded, ids, engine.kv_policy)
    held = seq.group_slots
    assert held == [len(pos) for pos, _ in reference]
    if name == "pyramid":  # layer 0 keeps everything, deeper layers less
        assert held[-1] < held[0] == len(ids)
    else:
        assert max(held) < len(ids)
    for layer, (_, keys) in enumerate(reference):
        torch.testing.assert_close(cached_keys(engine, seq.seq_id, layer, held[layer]), keys, rtol=1e-4, atol=1e-5)
    if name == "local":  # the sinks and the most recent tokens, nothing else
        positions = reference[0][0].tolist()
        assert positions[:4] == [0, 1, 2, 3] and positions[4:] == list(range(150 - len(positions) + 4, 150))
    if name == "pyramid":  # kept sets nest: a deeper layer keeps a subset of the shallower one's tokens
        for (shallow, _), (deep, _) in zip(reference, reference[1:], strict=False):
            assert set(deep.tolist()) <= set(shallow.tolist())


def test_budget_one_is_token_identical_to_the_full_cache(folder, loaded) -> None:
    prompts = [prompt_ids(n, seed=n) for n in (40, 90, 7)]
    outputs = {}
    for name in ("full", "pyramid", "h2o", "local"):
        engine = make_engine(folder, loaded, kv_policy=name, kv_budget=1.0)
        ids = [engine.add_request(p, greedy(24)) for p in prompts]
        outputs[name] = [o.outputs[0].token_ids for o in drain(engine, ids).values()]
    assert outputs["pyramid"] == outputs["full"]
    assert outputs["h2o"] == outputs["full"]
    assert outputs["local"] == outputs["full"]


def test_compression_returns_blocks_and_decode_stays_within_budget(folder, loaded) -> None:
    engine = make_engine(folder, loaded, kv_policy="h2o", kv_budget=0.25)
    ids = prompt_ids(200)
    engine.add_request(ids, greedy(60))
    engine.step()
    ((_, seq),) = engine._seqs.values()
    layers, policy = loaded.config.num_layers, engine.kv_policy
    blocks = sum(math.ceil(n / BLOCK) for n in seq.group_slots)
    assert engine.kv_usage().used_blocks == blocks  # every block past the kept slots went back
    assert blocks <= layers * math.ceil(math.ceil(0.25 * 200) / BLOCK)
    for _ in range(59):
        engine.step()
        if seq.finished:
            break
        for layer, held in enumerate(seq.group_slots):
            assert held <= policy.capacity(layer, layers, seq.num_computed_tokens) + BLOCK
            assert engine.kv.num_slots(seq.seq_id, layer) == held
    assert engine.kv_usage().used_blocks == 0  # all freed when it finished


def test_pyramid_prefill_computes_fewer_rows_in_deeper_layers(folder, loaded) -> None:
    engine = make_engine(folder, loaded, kv_policy="pyramid", kv_budget=0.4)
    rows_per_layer = []
    for layer in loaded.model.layers:
        layer.mlp.register_forward_hook(lambda module, args, out: rows_per_layer.append(args[0].shape[0]))
    try:
        engine.add_request(prompt_ids(160), greedy(1))
        drain(engine, ["0"])
    finally:
        for layer in loaded.model.layers:
            layer.mlp._forward_hooks.clear()
    assert rows_per_layer[0] == 160 and rows_per_layer[-1] < rows_per_layer[0] / 2
    assert rows_per_layer == sorted(rows_per_layer, reverse=True)


def test_policies_chosen_per_request_in_one_batch(folder, loaded) -> None:
    prompts = [prompt_ids(120, seed=s) for s in range(4)]
    full_engine = make_engine(folder, loaded, kv_policy="full", kv_budget=None)
    ids = [full_engine.add_request(p, greedy(12)) for p in prompts]
    full = [o.outputs[0].token_ids for o in drain(full_engine, ids).values()]

    engine = make_engine(folder, loaded, kv_policy="pyramid", kv_budget=0.3)
    overrides = [dict(kv_policy="full"), {}, dict(kv_policy="local", kv_budget=0.3), dict(kv_policy="h2o")]
    ids = [engine.add_request(p, greedy(12, **o)) for p, o in zip(prompts, overrides, strict=True)]
    schedule, firsts = engine.scheduler.schedule, []
    engine.scheduler.schedule = lambda: firsts.append(schedule()) or firsts[-1]
    engine.step()  # all four prefill in one step
    assert [s.kv_policy.name for s in firsts[0].scheduled] == ["full", "pyramid", "local", "h2o"]
    held = [seq.group_slots for _, seq in sorted(engine._seqs.values(), key=lambda rs: rs[1].seq_id)]
    assert held[0] == [120] * loaded.config.num_layers  # full keeps all
    assert held[1][-1] < held[1][0]  # pyramid: fewer in deeper layers
    assert len(set(held[2])) == 1 and held[2][0] < 120  # local: one budget for every layer
    assert max(held[3]) < 120
    got = [o.outputs[0].token_ids for o in drain(engine, ids).values()]
    assert got[0] == full[0]  # the full-cache request is exact beside compressed ones
    assert all(len(tokens) == 12 for tokens in got)
    assert engine.kv_usage().used_blocks == 0


def test_lossy_policy_errors_name_the_problem(folder, loaded) -> None:
    full_engine = make_engine(folder, loaded, kv_policy="full", kv_budget=None)
    with pytest.raises(ValueError, match="per-layer KV groups"):
        full_engine.add_request([1, 2, 3], greedy(2, kv_policy="pyramid"))
    engine = make_engine(folder, loaded)
    with pytest.raises(ValueError, match="best_of"):
        engine.add_request([1, 2, 3], SamplingParams(n=2, max_tokens=2))
    with pytest.raises(ValueError, match="kv_budget must be in"):
        SamplingParams(kv_budget=1.5)
    with pytest.raises(ValueError, match="kv_policy must be one of"):
        SamplingParams(kv_policy="quest")
    with pytest.raises(ValueError, match="kv_budget must be 1"):
        SamplingParams(kv_policy="full", kv_budget=0.5)
    with pytest.raises(ValueError, match="kv_pool_limit evicts by InfiniGen's selection counts"):
        EngineConfig(kv_policy="h2o", kv_offload="host", kv_pool_limit=0.5)
    assert engine.add_request([1, 2, 3], greedy(2)) is not None  # the engine still serves


def test_more_sequences_fit_at_the_same_kv_memory(folder, loaded) -> None:
    """At a fixed pool the scheduler runs more 200-token sequences side by side under PyramidInfer."""

    def peak_running(kv_policy, kv_budget) -> int:
        cfg = loaded.config
        full_blocks = cfg.num_layers * math.ceil(220 / BLOCK)  # one sequence's whole cache, in layer blocks
        engine = make_engine(folder, loaded, kv_policy, kv_budget, num_layer_blocks=3 * full_blocks)
        ids = [engine.add_request(prompt_ids(200, seed=s), greedy(20)) for s in range(12)]
        peak, done = 0, {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
            peak = max(peak, len(engine.scheduler.running))
        assert all(len(done[i].outputs[0].token_ids) == 20 for i in ids)
        return peak

    full, pyramid = peak_running("full", None), peak_running("pyramid", 0.3)
    assert full <= 3 and pyramid >= 2 * full


def test_chunked_prefill_and_scoring_a_continuation(folder, loaded) -> None:
    """A prompt split over steps compresses as it goes; score_from computes the context on its own first."""
    engine = make_engine(folder, loaded, kv_policy="pyramid", kv_budget=0.5, max_num_batched_tokens=64)
    ids = prompt_ids(200)
    (out,) = drain(engine, [engine.add_request(ids, greedy(4))]).values()
    assert len(out.outputs[0].token_ids) == 4
    # Scoring: with the full cache score_from changes nothing; under compression the context is compressed first.
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    scores = {}
    for name, budget in (("full", None), ("pyramid", 0.5)):
        engine = make_engine(folder, loaded, kv_policy=name, kv_budget=budget)
        a = engine.add_request(ids, params)
        b = engine.add_request(ids, params, score_from=150)
        done = drain(engine, [a, b])
        scores[name] = [[done[r].prompt_logprobs[p][ids[p]] for p in range(150, 200)] for r in (a, b)]
    torch.testing.assert_close(torch.tensor(scores["full"][0]), torch.tensor(scores["full"][1]), rtol=1e-4, atol=1e-4)
    assert scores["pyramid"][1] != scores["full"][1]  # the compressed context changes the scores, a little
    gap = (torch.tensor(scores["pyramid"][1]) - torch.tensor(scores["full"][1])).abs().mean()
    assert gap < 1.0
    with pytest.raises(ValueError, match="score_from"):
        engine.add_request(ids, params, score_from=200)


def test_policy_is_a_plain_value() -> None:
    policy = make_policy("pyramid", 0.5)
    assert policy == make_policy("pyramid", 0.5) and hash(policy) == hash(make_policy("pyramid", 0.5))


def test_swap_preemption_keeps_compressed_sequences_exact(folder, loaded) -> None:
    """Under memory pressure compressed sequences are swapped out and back with their scores: the tokens
    equal an unconstrained run's."""
    prompts = [prompt_ids(150, seed=s) for s in range(5)]
    roomy = make_engine(folder, loaded, kv_policy="h2o", kv_budget=0.5)
    expected = [
        o.outputs[0].token_ids for o in drain(roomy, [roomy.add_request(p, greedy(40)) for p in prompts]).values()
    ]
    cfg = loaded.config
    layer_block = kv_block_bytes(1, cfg.num_kv_heads, cfg.head_dim, 4, BLOCK)
    config = EngineConfig(
        model=str(folder), dtype="float32", block_size=BLOCK, kv_cache_memory=240 * layer_block,
        swap_space=2000 * layer_block, preemption_mode="swap", kv_policy="h2o", kv_budget=0.5,
    )  # fmt: skip
    tight = LLMEngine(config, loaded)
    got = [o.outputs[0].token_ids for o in drain(tight, [tight.add_request(p, greedy(40)) for p in prompts]).values()]
    assert tight.scheduler.num_preemptions > 0
    assert got == expected
