"""SnapKV and PyramidKV in the engine over a tiny random checkpoint: per-head prefill selection against a
written-out reference of the paper's algorithm (window votes, GQA mean, average pool, per-head top-k), the
PyramidKV schedule, lossless at budget 1, decoding within budget, chunked prefill, errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.models import LoadedModel, load_model
from kvserve.models.layers import RotaryEmbedding
from kvserve.policies import PyramidKV, SnapKV, make_policy
from kvserve.policies.layer_schedule import pyramidkv_schedule
from tests.policies.test_compressed_engine_tiny import BLOCK, SPEC, cached_keys, drain, greedy, make_engine, prompt_ids
from tests.tiny_models import torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixture


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("snapkv"), SPEC)


@pytest.fixture(scope="module")
def loaded(folder) -> LoadedModel:
    return load_model(folder, dtype=torch.float32)


def pooled(scores: list[float], kernel: int) -> list[float]:
    """Average of each score with its neighbours within kernel // 2, over the neighbours that exist."""
    half = kernel // 2
    out = []
    for i in range(len(scores)):
        window = scores[max(0, i - half) : i + half + 1]
        out.append(sum(window) / len(window))
    return out


@torch.inference_mode()
def reference_snapkv(loaded: LoadedModel, ids: list[int], policy: SnapKV) -> list[list[list[int]]]:
    """Per layer, per KV head: the positions a whole-prompt prefill keeps, in position order.

    Every layer computes every row (SnapKV drops no rows). Where the prompt exceeds the layer's target, the
    last ``window`` queries' attention (softmax over the whole causal row) is summed per query head, averaged
    over the query heads of each KV head, pooled, and each KV head keeps its window plus its top older tokens.
    """
    model, cfg = loaded.model, loaded.config
    n, heads, kv_heads, d = len(ids), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    group = heads // kv_heads
    x = model.embed_tokens(torch.tensor(ids))
    rope = model.rotary.table(torch.arange(n), x.dtype)
    result = []
    for layer_index, layer in enumerate(model.layers):
        qkv = layer.self_attn.qkv_proj(layer.input_layernorm(x))
        q = RotaryEmbedding.apply(qkv[:, : heads * d].view(n, heads, d), rope)
        k = RotaryEmbedding.apply(qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d), rope)
        v = qkv[:, (heads + kv_heads) * d :].view(n, kv_heads, d)
        kh, vh = k.repeat_interleave(group, 1).transpose(0, 1), v.repeat_interleave(group, 1).transpose(0, 1)
        logits = q.transpose(0, 1) @ kh.transpose(1, 2) / math.sqrt(d)  # (H, n, n)
        attn = torch.softmax(logits.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")), dim=-1)
        x = x + layer.self_attn.o_proj((attn @ vh).transpose(0, 1).reshape(n, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        target = policy.slots_after(layer_index, cfg.num_layers, 0, n, n, BLOCK)
        if n <= target:
            result.append([list(range(n))] * kv_heads)
            continue
        recent = min(policy.window, target // 2)
        votes = attn[:, n - min(policy.window, n) :].sum(dim=1)  # (H, n)
        per_head = []
        for h in range(kv_heads):
            scores = pooled(votes[h * group : (h + 1) * group].mean(dim=0).tolist(), policy.kernel_size)
            older = sorted(range(n - recent), key=lambda i: -scores[i])[: target - recent]
            per_head.append(sorted(older) + list(range(n - recent, n)))
        result.append(per_head)
    return result


def kept_positions(engine, seq_id: int, layer: int, count: int, all_keys: torch.Tensor) -> list[list[int]]:
    """Which prompt positions each KV head holds in ``layer``'s first ``count`` slots, found by key equality
    with the full keys ``all_keys`` (n, Hkv, D) of that layer."""
    cached = cached_keys(engine, seq_id, layer, count)  # (count, Hkv, D)
    out = []
    for h in range(cached.shape[1]):
        distance = torch.cdist(cached[:, h].float(), all_keys[:, h].float())  # (count, n)
        out.append(distance.argmin(dim=1).tolist())
    return out


def full_keys(folder, loaded: LoadedModel, ids: list[int]) -> list[torch.Tensor]:
    """Every layer's keys (n, Hkv, D) of a lossless prefill of ``ids``, in position order."""
    engine = make_engine(folder, loaded, kv_policy="snapkv", kv_budget=1.0)
    engine.add_request(ids, greedy(2))
    engine.step()
    ((_, seq),) = engine._seqs.values()
    return [cached_keys(engine, seq.seq_id, layer, len(ids)) for layer in range(loaded.config.num_layers)]


@pytest.mark.parametrize(("name", "budget"), [("snapkv", 0.5), ("snapkv", 0.3), ("pyramidkv", 0.4)])
def test_prefill_selection_matches_the_written_out_reference(folder, loaded, name, budget) -> None:
    ids = prompt_ids(150, seed=3)
    engine = make_engine(folder, loaded, kv_policy=name, kv_budget=budget)
    engine.add_request(ids, greedy(2))
    engine.step()  # the whole prompt in one step
    ((_, seq),) = engine._seqs.values()
    policy = engine.kv_policy
    reference = reference_snapkv(loaded, ids, policy)
    assert seq.group_slots == [len(heads[0]) for heads in reference]
    keys = full_keys(folder, loaded, ids)
    differ = False
    for layer, heads in enumerate(reference):
        got = kept_positions(engine, seq.seq_id, layer, seq.group_slots[layer], keys[layer])
        assert got == heads, f"layer {layer}"
        differ |= heads[0] != heads[1]
    assert differ  # heads do keep different tokens in the same slots
    if name == "pyramidkv":
        assert seq.group_slots[0] > seq.group_slots[-1]


def test_budget_one_is_token_identical_to_the_full_cache(folder, loaded) -> None:
    prompts = [prompt_ids(n, seed=n) for n in (40, 90, 7)]
    outputs = {}
    for name in ("full", "snapkv", "pyramidkv"):
        engine = make_engine(folder, loaded, kv_policy=name, kv_budget=1.0)
        ids = [engine.add_request(p, greedy(24)) for p in prompts]
        outputs[name] = [o.outputs[0].token_ids for o in drain(engine, ids).values()]
    assert outputs["snapkv"] == outputs["full"]
    assert outputs["pyramidkv"] == outputs["full"]


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv"])
def test_chunked_prefill_and_decoding_stay_within_budget(folder, loaded, name) -> None:
    engine = make_engine(folder, loaded, kv_policy=name, kv_budget=0.5, max_num_batched_tokens=48)
    ids = [engine.add_request(prompt_ids(130, seed=s), greedy(40)) for s in (1, 2)]
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        for _, seq in engine._seqs.values():
            for layer, held in enumerate(seq.group_slots):
                capacity = engine.kv_policy.capacity(layer, loaded.config.num_layers, seq.num_computed_tokens)
                assert held <= capacity + BLOCK
    assert all(len(done[i].outputs[0].token_ids) == 40 for i in ids)


def test_pyramidkv_schedule_falls_linearly_to_budget_over_beta() -> None:
    for budget in (0.25, 0.5, 0.75):
        schedule = pyramidkv_schedule(30, budget)
        assert sum(schedule) / 30 == pytest.approx(budget, abs=1e-6)
        assert all(a >= b for a, b in zip(schedule, schedule[1:], strict=False))
        assert max(schedule) <= 1
    unclamped = pyramidkv_schedule(30, 0.25, beta=20)
    assert unclamped[-1] == pytest.approx(0.25 / 20)
    steps = [a - b for a, b in zip(unclamped, unclamped[1:], strict=False)]
    assert max(steps) - min(steps) < 1e-9  # a straight line
    assert pyramidkv_schedule(30, 0.75)[0] == 1.0  # clamped: the first layers keep everything
    assert make_policy("pyramid", 0.5, layer_schedule="pyramidkv").retention(30) == pyramidkv_schedule(30, 0.5)
    assert make_policy("pyramid", 0.5, layer_schedule="uniform").retention(4) == (0.5,) * 4


def test_per_head_selection_of_hand_made_scores() -> None:
    policy = SnapKV(budget=0.5, window=2, kernel_size=1)
    scores = torch.tensor([[9.0, 0.0], [0.0, 9.0], [5.0, 1.0], [1.0, 5.0], [0.0, 0.0], [0.0, 0.0]])  # (6, Hkv=2)
    kept = policy.select(scores, 6, 4, 6)  # 2 window slots, 2 best older per head
    assert kept.T.tolist() == [[0, 2, 4, 5], [1, 3, 4, 5]]
    assert policy.select(torch.tensor([3.0, 1.0, 2.0, 0.0, 0.0, 0.0]), 6, 4, 6).tolist() == [0, 2, 4, 5]
    smoothed = SnapKV(budget=0.5, window=1, kernel_size=3).pool(torch.tensor([[0.0], [3.0], [0.0], [0.0]]))
    assert smoothed[:, 0].tolist() == pytest.approx([1.5, 1.0, 1.0, 0.0])


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"window": 0}, "window must be an integer >= 1, got 0"),
        ({"kernel_size": 4}, "kernel_size must be an odd integer >= 1, got 4"),
        ({"layer_schedule": "cone"}, "layer_schedule must be one of"),
        ({"pyramid_beta": 0.5}, "pyramid_beta must be >= 1, got 0.5"),
    ],
)
def test_bad_options_name_the_value(knobs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SnapKV(budget=0.5, **knobs)


def test_engine_options_reach_the_policy(folder) -> None:
    config = EngineConfig(model=str(folder), kv_policy="pyramidkv", observation_window=8, layer_schedule="uniform")
    policy = make_policy(config.kv_policy, config.kv_budget, **config.kv_policy_knobs)
    assert isinstance(policy, PyramidKV) and policy.window == 8 and policy.retention(3) == (0.5,) * 3
    with pytest.raises(ValueError, match="layer_schedule must be one of"):
        EngineConfig(model=str(folder), kv_policy="snapkv", layer_schedule="cone")
