"""Ada-KV in the engine over a tiny random checkpoint: the heads' budgets and kept tokens against a written-out
reference of the paper's allocation (SnapKV's votes ranked across the layer's heads, with the safeguard), decoding
over the packed heads against attention masked head by head, lossless at budget 1, the memory of SnapKV at the same
budget, chunked prefill and decoding within budget, errors."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from kvserve.attention.head_budgets import head_candidates, pack, packed_slots
from kvserve.config import EngineConfig
from kvserve.models import LoadedModel, load_model
from kvserve.models.layers import RotaryEmbedding
from kvserve.policies import AdaKV, make_policy
from tests.policies.test_compressed_engine_tiny import BLOCK, SPEC, cached_keys, drain, greedy, make_engine, prompt_ids
from tests.policies.test_snapkv_tiny import full_keys, pooled
from tests.tiny_models import torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixture


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("adakv"), SPEC)


@pytest.fixture(scope="module")
def loaded(folder) -> LoadedModel:
    return load_model(folder, dtype=torch.float32)


def allocate(votes: list[list[float]], keep: int, policy: AdaKV) -> list[list[int]]:
    """Ada-KV's allocation written out: per KV head its votes (pooled below) over n positions; each head keeps the
    window, its safeguarded best, then the layer's best (score, head) pairs until Hkv * keep are kept."""
    n, heads = len(votes[0]), len(votes)
    recent = min(policy.window, max(1, keep // 2))
    older, share = n - recent, keep - recent
    floor = min(int(policy.safeguard * share), older)
    scores = [pooled(v[:older], policy.kernel_size) for v in votes]
    safe = [sorted(range(older), key=lambda i, s=s: -s[i])[:floor] for s in scores]
    pairs = [(h, i) for h in range(heads) for i in safe[h]]
    others = [(h, i) for h in range(heads) for i in range(older) if i not in safe[h]]
    rest = sorted(others, key=lambda p: -scores[p[0]][p[1]])
    pairs += rest[: heads * share - len(pairs)]
    return [sorted(i for g, i in pairs if g == h) + list(range(older, n)) for h in range(heads)]


@torch.inference_mode()
def reference(loaded: LoadedModel, ids: list[int], kept: list[list[list[int]]] | None, prompt: int, policy: AdaKV):
    """Logits of every position of ``ids`` (n, vocab) and, per layer and KV head, the prompt positions a whole-prompt
    prefill keeps. With ``kept`` given, queries past the prompt attend per KV head only to ``kept[layer][head]`` and
    the positions after the prompt (a decode over the packed heads); prompt rows attend causally in full."""
    model, cfg = loaded.model, loaded.config
    n, heads, kv_heads, d = len(ids), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    group = heads // kv_heads
    x = model.embed_tokens(torch.tensor(ids))
    rope = model.rotary.table(torch.arange(n), x.dtype)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    chosen = []
    for layer_index, layer in enumerate(model.layers):
        qkv = layer.self_attn.qkv_proj(layer.input_layernorm(x))
        q = RotaryEmbedding.apply(qkv[:, : heads * d].view(n, heads, d), rope)
        k = RotaryEmbedding.apply(qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d), rope)
        v = qkv[:, (heads + kv_heads) * d :].view(n, kv_heads, d)
        kh, vh = k.repeat_interleave(group, 1).transpose(0, 1), v.repeat_interleave(group, 1).transpose(0, 1)
        mask = causal[None].repeat(heads, 1, 1)  # (H, n, n)
        if kept is not None:
            for h in range(heads):
                visible = torch.zeros(n, dtype=torch.bool)
                visible[kept[layer_index][h // group]] = True
                visible[prompt:] = True
                mask[h, prompt:] &= visible
        logits = q.transpose(0, 1) @ kh.transpose(1, 2) / math.sqrt(d)  # (H, n, n)
        attn = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
        x = x + layer.self_attn.o_proj((attn @ vh).transpose(0, 1).reshape(n, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        target = policy.slots_after(layer_index, cfg.num_layers, 0, prompt, prompt, BLOCK)
        votes = attn[:, prompt - min(policy.window, prompt) : prompt, :prompt].sum(dim=1)  # (H, prompt)
        per_head = [votes[h * group : (h + 1) * group].mean(dim=0).tolist() for h in range(kv_heads)]
        chosen.append(allocate(per_head, target, policy) if prompt > target else [list(range(prompt))] * kv_heads)
    return model.lm_head(model.norm(x)), chosen


def packed_positions(engine, seq, layer: int, keys: torch.Tensor) -> list[list[int]]:
    """Per KV head, the prompt positions ``layer`` holds packed, found by key equality with the full keys."""
    counts = seq.group_heads[layer]
    cached = cached_keys(engine, seq.seq_id, layer, seq.group_slots[layer])
    heads = head_candidates(cached, cached[:0], counts)
    return [torch.cdist(h.float(), keys[:, i].float()).argmin(dim=1).tolist() for i, h in enumerate(heads)]


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0.5, 0.3])
def test_prefill_allocation_matches_the_written_out_reference(folder, loaded, budget) -> None:
    ids = prompt_ids(150, seed=3)
    engine = make_engine(folder, loaded, kv_policy="adakv", kv_budget=budget)
    engine.add_request(ids, greedy(2))
    engine.step()  # the whole prompt in one step
    ((_, seq),) = engine._seqs.values()
    _, expected = reference(loaded, ids, None, len(ids), engine.kv_policy)
    keys = full_keys(folder, loaded, ids)
    uneven = False
    for layer, heads in enumerate(expected):
        assert seq.group_heads[layer] == tuple(len(h) for h in heads), f"layer {layer}"
        assert sum(seq.group_heads[layer]) == len(heads) * seq.group_slots[layer]  # SnapKV's memory
        assert packed_positions(engine, seq, layer, keys[layer]) == heads, f"layer {layer}"
        uneven |= len(set(seq.group_heads[layer])) > 1
    assert uneven  # heads do get different budgets


def test_decoding_attends_each_head_over_its_own_tokens(folder, loaded) -> None:
    ids = prompt_ids(150, seed=5)
    engine = make_engine(folder, loaded, kv_policy="adakv", kv_budget=0.5)
    rid = engine.add_request(ids, greedy(6))
    engine.step()
    ((_, seq),) = engine._seqs.values()
    _, kept = reference(loaded, ids, None, len(ids), engine.kv_policy)
    out = drain(engine, [rid])[rid].outputs[0].token_ids  # no layer outgrows its target in 6 tokens
    logits, _ = reference(loaded, ids + out, kept, len(ids), engine.kv_policy)
    assert logits[len(ids) - 1 :].argmax(dim=-1).tolist()[:6] == out
    # the per-head masks matter: attending every prompt token gives other tokens on this model
    full, _ = reference(loaded, ids + out, [[list(range(len(ids)))] * 2] * len(kept), len(ids), engine.kv_policy)
    assert not torch.allclose(full[len(ids) :], logits[len(ids) :], atol=1e-4)


def test_a_later_chunk_attends_each_head_over_its_own_tokens(folder, loaded) -> None:
    ids = prompt_ids(150, seed=7)
    engine = make_engine(folder, loaded, kv_policy="adakv", kv_budget=0.5, max_num_batched_tokens=100)
    rid = engine.add_request(ids, greedy(1, prompt_logprobs=0))
    got = drain(engine, [rid])[rid].prompt_logprobs  # position p: log P(ids[p] | ids[:p])
    _, kept = reference(loaded, ids, None, 100, engine.kv_policy)  # what the first chunk of 100 packs
    logits, _ = reference(loaded, ids, kept, 100, engine.kv_policy)
    expected = torch.log_softmax(logits, dim=-1)
    for p in range(100, 150):  # rows of the second chunk, over the packed heads and their own keys
        assert got[p][ids[p]] == pytest.approx(expected[p - 1, ids[p]].item(), abs=1e-4), f"position {p}"


def test_budget_one_is_token_identical_to_the_full_cache(folder, loaded) -> None:
    prompts = [prompt_ids(n, seed=n) for n in (40, 90, 7)]
    outputs = {}
    for name in ("full", "adakv"):
        engine = make_engine(folder, loaded, kv_policy=name, kv_budget=1.0)
        ids = [engine.add_request(p, greedy(24)) for p in prompts]
        outputs[name] = [o.outputs[0].token_ids for o in drain(engine, ids).values()]
    assert outputs["adakv"] == outputs["full"]


@pytest.mark.slow
def test_an_offloaded_slab_packs_and_decodes_as_the_device_one(folder, loaded) -> None:
    prompts = [prompt_ids(n, seed=n) for n in (130, 70)]
    outputs = {}
    for offload in ("none", "host"):
        engine = make_engine(folder, loaded, kv_policy="adakv", kv_budget=0.4, kv_offload=offload)
        ids = [engine.add_request(p, greedy(40)) for p in prompts]
        outputs[offload] = [o.outputs[0].token_ids for o in drain(engine, ids).values()]
        if offload == "host":
            assert engine.runner.cache.bytes_moved()["fetched"] > 0
    assert outputs["host"] == outputs["none"]


def test_with_one_kv_head_adakv_is_snapkv(tmp_path) -> None:
    mqa = write_tiny_model(tmp_path, dataclasses.replace(SPEC, num_kv_heads=1))
    model = load_model(mqa, dtype=torch.float32)
    prompts = [prompt_ids(n, seed=n) for n in (130, 60)]
    outputs = {}
    for name in ("snapkv", "adakv"):
        engine = make_engine(mqa, model, kv_policy=name, kv_budget=0.4, max_num_batched_tokens=48)
        ids = [engine.add_request(p, greedy(30)) for p in prompts]
        outputs[name] = [o.outputs[0].token_ids for o in drain(engine, ids).values()]
    assert outputs["adakv"] == outputs["snapkv"]


# 130 tokens at 0.5: chunks pack, decodes evict among the later slots; 20 at 0.1: the layer's minimum is all packed,
# so a decode past it allocates the heads anew by its own attention.
@pytest.mark.slow
@pytest.mark.parametrize(("prompt", "budget"), [(130, 0.5), (20, 0.1)])
def test_chunked_prefill_and_decoding_stay_within_budget(folder, loaded, prompt, budget) -> None:
    engine = make_engine(folder, loaded, kv_policy="adakv", kv_budget=budget, max_num_batched_tokens=48)
    ids = [engine.add_request(prompt_ids(prompt, seed=s), greedy(60)) for s in (1, 2)]
    done, packed = {}, False
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        for _, seq in engine._seqs.values():
            for layer, held in enumerate(seq.group_slots):
                capacity = engine.kv_policy.capacity(layer, loaded.config.num_layers, seq.num_computed_tokens)
                assert held <= capacity + BLOCK
                heads = seq.group_heads[layer] if seq.group_heads else ()
                assert packed_slots(heads) <= held
                packed |= bool(heads)
    assert packed
    assert all(len(done[i].outputs[0].token_ids) == 60 for i in ids)


def test_hand_made_scores_move_budget_to_the_spread_head() -> None:
    concentrated = torch.tensor([9.0, 0.0, 0.3, 0.0, 0.0, 0.1, 0.0, 1.0])
    spread = torch.tensor([1.0, 1.1, 1.2, 1.3, 0.9, 0.0, 0.0, 1.0])
    policy = AdaKV(budget=0.5, window=1, kernel_size=1, safeguard=0.0)
    kept = policy.select_heads([concentrated, spread], 4)  # each head its window, then 6 older by score
    assert [k.tolist() for k in kept] == [[0, 7], [0, 1, 2, 3, 4, 7]]
    guarded = AdaKV(budget=0.5, window=1, kernel_size=1, safeguard=0.67).select_heads([concentrated, spread], 4)
    assert [k.tolist() for k in guarded] == [[0, 2, 7], [0, 1, 2, 3, 7]]  # each head's best 2 first, then the best
    snap = make_policy("snapkv", 0.5, window=1, kernel_size=1).select(torch.stack((concentrated, spread), 1), 8, 4, 8)
    assert snap.T.tolist() == [[0, 2, 5, 7], [1, 2, 3, 7]]  # SnapKV: 3 older in each head


def test_packing_round_trips() -> None:
    kept = [torch.arange(8.0).view(4, 2), torch.arange(8.0, 12.0).view(2, 2), torch.arange(12.0, 18.0).view(3, 2)]
    slots = pack(kept)  # 9 entries of 3 heads: 3 slots
    assert slots.shape == (3, 3, 2)
    new = torch.full((1, 3, 2), -1.0)
    back = head_candidates(slots, new, (4, 2, 3))
    assert [b.tolist() for b in back] == [k.tolist() + [[-1.0, -1.0]] for k in kept]
    assert packed_slots((4, 2, 3)) == 3 and packed_slots(()) == 0
    with pytest.raises(ValueError, match="10 entries over 3 KV heads"):
        pack([torch.zeros(5, 2), torch.zeros(3, 2), torch.zeros(2, 2)])


@pytest.mark.parametrize(("knobs", "message"), [({"safeguard": 1.5}, "safeguard must be in \\[0, 1\\], got 1.5")])
def test_bad_options_name_the_value(knobs, message) -> None:
    with pytest.raises(ValueError, match=message):
        make_policy("adakv", 0.5, **knobs)


def test_engine_options_reach_the_policy(folder) -> None:
    config = EngineConfig(model=str(folder), kv_policy="adakv", adakv_safeguard=0.5, observation_window=8)
    policy = make_policy(config.kv_policy, config.kv_budget, **config.kv_policy_knobs)
    assert isinstance(policy, AdaKV) and policy.safeguard == 0.5 and policy.window == 8
    with pytest.raises(ValueError, match="safeguard must be in"):
        EngineConfig(model=str(folder), kv_policy="adakv", adakv_safeguard=-0.1)
