"""InfiniGen's pieces on their own: skewing keeps attention scores exact (random heads and every head of a
tiny model), the cached skewing file, the rehearsal's partial query against the model's own, speculation
counts and picks on hand-made logits and against a reference on random ones, pool victims on a hand
trace, INT4 quantisation error and size, and the option errors of the policies and of EngineConfig."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.attention.backend import AttentionMetadata
from kvserve.config import EngineConfig
from kvserve.models import LoadedModel, load_model
from kvserve.models.layers import RotaryEmbedding
from kvserve.policies import make_policy
from kvserve.policies.infinigen import InfiniGen, Rehearsal, partial_logits, speculate
from kvserve.policies.infinigen_state import choose_victims
from kvserve.policies.quant import Int4KV, dequantize_int4, quantize_int4
from kvserve.policies.skewing import SKEWING_DIR_ENV, _Recorder, compute_skewing, skew_head, skewing_for
from tests.tiny_models import TinySpec, torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixture

SPEC = TinySpec(num_heads=4, num_kv_heads=2, num_layers=3, head_dim=32, max_position_embeddings=256, seed=21)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> LoadedModel:
    return load_model(write_tiny_model(tmp_path_factory.mktemp("infinigen"), SPEC), dtype=torch.float32)


def token_ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 290, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def record(loaded: LoadedModel, ids: list[int]) -> _Recorder:
    """Every layer's rotated queries (n, H, D) and keys (n, Hkv, D) for ``ids``."""
    cfg = loaded.config
    recorder = _Recorder(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, len(ids), torch.float32)
    metadata = AttentionMetadata(seq_ids=(0,), query_lens=(len(ids),), context_lens=(0,))
    loaded.model(torch.tensor(ids), torch.arange(len(ids)), recorder, metadata)
    return recorder


# ----- skewing -----


def test_skew_head_is_orthogonal_and_keeps_scores() -> None:
    g = torch.Generator().manual_seed(0)
    d = 32
    spectrum = torch.logspace(1, -2, d)  # anisotropic: a few directions carry most of the magnitude
    basis, _ = torch.linalg.qr(torch.randn(d, d, generator=g))
    queries = torch.randn(96, d, generator=g) * spectrum @ basis.T
    keys = torch.randn(40, d, generator=g) * spectrum.flip(0) @ basis.T + 0.5
    a, ranking = skew_head(queries, keys)
    assert a.shape == (d, d) and ranking.shape == (d,) and ranking.dtype == torch.long
    torch.testing.assert_close(a.T @ a, torch.eye(d), atol=1e-5, rtol=0)
    torch.testing.assert_close((queries @ a) @ (keys @ a).T, queries @ keys.T, atol=1e-4, rtol=1e-5)
    assert sorted(ranking.tolist()) == list(range(d))
    magnitude = (queries @ a).abs().sum(0) + (keys @ a).abs().sum(0)
    assert torch.all(magnitude[ranking][:-1] >= magnitude[ranking][1:])  # most important first
    # The skewed queries put their magnitude up front: the first column carries the top singular value.
    assert (queries @ a)[:, 0].norm() == pytest.approx(float(torch.linalg.svdvals(queries)[0]), rel=1e-4)


def test_compute_skewing_keeps_every_heads_scores(loaded) -> None:
    cfg = loaded.config
    ids = token_ids(80)
    skewing = compute_skewing(loaded.model, ids)
    d, group = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    assert skewing.matrices.shape == (cfg.num_layers, cfg.num_kv_heads, d, d)
    assert skewing.ranking.shape == (cfg.num_layers, cfg.num_kv_heads, d)
    recorder = record(loaded, token_ids(50, seed=1))  # other tokens than the sample: orthogonality is all it takes
    for layer in range(cfg.num_layers):
        q, k = recorder.queries[layer], recorder.keys[layer]
        for head in range(cfg.num_kv_heads):
            a = skewing.matrices[layer, head]
            torch.testing.assert_close(a.T @ a, torch.eye(d), atol=1e-5, rtol=0)
            assert sorted(skewing.ranking[layer, head].tolist()) == list(range(d))
            heads = q[:, head * group : (head + 1) * group]  # (n, G, D)
            scores = torch.einsum("ngd,md->gnm", heads, k[:, head])
            skewed = torch.einsum("ngd,md->gnm", heads @ a, k[:, head] @ a)
            torch.testing.assert_close(skewed, scores, atol=1e-4 * float(scores.abs().max()), rtol=0)
    # partial(r): each head's r top-ranked columns of A, in ranking order.
    partial = skewing.partial(5)
    assert partial.shape == (cfg.num_layers, cfg.num_kv_heads, d, 5)
    for layer, head in ((0, 0), (2, 1)):
        columns = skewing.ranking[layer, head, :5]
        assert torch.equal(partial[layer, head], skewing.matrices[layer, head][:, columns])


def test_skewing_is_cached_by_model_in_the_given_folder(loaded, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(SKEWING_DIR_ENV, str(tmp_path / "env"))
    first, file = skewing_for(loaded)
    assert file.parent == tmp_path / "env" and file.is_file()
    again, same = skewing_for(loaded)
    assert same == file and torch.equal(again.matrices, first.matrices) and torch.equal(again.ranking, first.ranking)
    other, elsewhere = skewing_for(loaded, directory=tmp_path / "dir")
    assert elsewhere.parent == tmp_path / "dir" and elsewhere.name == file.name
    torch.testing.assert_close(other.matrices, first.matrices)
    torch.save({"format": -1}, file)  # a file of another format is recomputed, not trusted
    recomputed, _ = skewing_for(loaded)
    torch.testing.assert_close(recomputed.matrices, first.matrices)
    assert sorted(p.name for p in (tmp_path / "env").iterdir()) == [file.name]  # no temporary left over


def test_rehearsal_predicts_the_layers_own_skewed_query(loaded) -> None:
    """With every skewed dimension kept, the rehearsal's partial query is the layer's rotated query times A
    (its columns in ranking order); its partial keys likewise."""
    cfg = loaded.config
    skewing = compute_skewing(loaded.model, token_ids(60))
    skew = skewing.partial(cfg.head_dim)
    rehearsal = Rehearsal(loaded.model, skew)
    assert rehearsal.partial_dims == cfg.head_dim
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, cfg.hidden_size, generator=g)
    positions = torch.tensor([0, 3, 4, 9, 20, 21, 50])
    rope = loaded.model.rotary.table(positions, torch.float32)
    group = cfg.num_heads // cfg.num_kv_heads
    with torch.inference_mode():
        for layer in range(cfg.num_layers):
            qkv = loaded.model.layers[layer].self_attn.qkv_proj(x)
            q = RotaryEmbedding.apply(qkv[:, : cfg.q_size].view(7, cfg.num_heads, cfg.head_dim), rope)
            expected = q.view(7, cfg.num_kv_heads, group, cfg.head_dim) @ skew[layer]
            torch.testing.assert_close(rehearsal.partial_query(layer, x, rope), expected, atol=1e-4, rtol=1e-4)
            k = torch.randn(5, cfg.num_kv_heads, cfg.head_dim, generator=g)
            expected_k = torch.einsum("nhd,hde->nhe", k, skew[layer])
            torch.testing.assert_close(rehearsal.partial_key(layer, k), expected_k, atol=1e-5, rtol=1e-5)


def test_partial_logits_scale_by_the_full_head_dim() -> None:
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(3, 2, 5, generator=g), torch.randn(3, 7, 5, generator=g)
    logits = partial_logits(q.to(torch.bfloat16), k.to(torch.bfloat16), head_dim=64)
    assert logits.dtype == torch.float32 and logits.shape == (3, 2, 7)
    expected = q.to(torch.bfloat16).float() @ k.to(torch.bfloat16).float().transpose(1, 2) / 8
    torch.testing.assert_close(logits, expected, atol=0.05, rtol=0.02)


# ----- speculation -----

# R=1, Hkv=2, G=2, n=6: two query heads per KV head.
LOGITS = torch.tensor(
    [
        [
            [[5.0, 4.0, 1.0, 0.0, 3.0, -2.0], [0.0, 1.0, 6.0, 2.0, 0.0, 0.0]],  # KV head 0
            [[1.0, 1.0, 1.0, 9.0, 1.0, 1.0], [2.0, 3.0, 1.0, 0.0, 7.0, 6.5]],  # KV head 1
        ]
    ]
)


def picked(selection, row: int) -> list[list[int]]:
    """Each KV head's chosen candidates of ``row``, sorted."""
    k = int(selection.counts[row])
    assert selection.chosen[row].tolist() == [True] * k + [False] * (selection.chosen.shape[1] - k)
    return [sorted(selection.index[row, h, :k].tolist()) for h in range(selection.index.shape[1])]


def test_speculate_counts_are_the_truncated_mean_over_heads() -> None:
    # alpha 1.5: per query head, logits within 1.5 of its peak: {5, 4}, {6}, {9}, {7, 6.5} -> 2, 1, 1, 2;
    # mean 1.5 -> 1. Each KV head takes its best candidate by the max over its query heads:
    # head 0 maxima [5, 4, 6, 2, 3, 0] -> candidate 2; head 1 maxima [2, 3, 1, 9, 7, 6.5] -> candidate 3.
    s = speculate(LOGITS, None, 1.5)
    assert s.counts.tolist() == [1] and picked(s, 0) == [[2], [3]]
    # alpha 3: {5, 4, 3}, {6}, {9}, {7, 6.5} -> 3 + 1 + 1 + 2 = 7, mean 1.75 -> 1 still.
    assert speculate(LOGITS, None, 3.0).counts.tolist() == [1]
    # alpha 4: {5, 4, 1, 3}, {6, 2}, {9}, {7, 6.5, 3} -> 4 + 2 + 1 + 3 = 10, mean 2.5 -> 2:
    # head 0 takes [2 (6), 0 (5)], head 1 [3 (9), 4 (7)].
    s = speculate(LOGITS, None, 4.0)
    assert s.counts.tolist() == [2] and picked(s, 0) == [[0, 2], [3, 4]]
    # alpha large: everything.
    s = speculate(LOGITS, None, 1e9)
    assert s.counts.tolist() == [6] and picked(s, 0) == [list(range(6))] * 2
    # alpha 0: every maximum is unique, so each query head counts 1.
    s = speculate(LOGITS, None, 0.0)
    assert s.counts.tolist() == [1] and picked(s, 0) == [[2], [3]]
    assert s.index.shape == (1, 2, 1) and s.chosen.shape == (1, 1)


def test_speculate_masks_invalid_candidates_and_rows_pick_their_own_count() -> None:
    # Row 0: the logits above. Row 1: the same, but only candidates 0..2 valid (a shorter sequence).
    logits = torch.cat((LOGITS, LOGITS))
    valid = torch.tensor([[True] * 6, [True, True, True, False, False, False]])
    s = speculate(logits, valid, 4.0)
    # Row 1 over {0, 1, 2} only: per query head within 4 of its peak: [5, 4, 1] -> 3, [0, 1, 6] -> 1,
    # [1, 1, 1] -> 3, [2, 3, 1] -> 3; mean 2.5 -> 2.
    assert s.counts.tolist() == [2, 2]
    assert picked(s, 0) == [[0, 2], [3, 4]]
    # Row 1's KV head maxima over {0, 1, 2}: head 0 [5, 4, 6] -> 2 and 0; head 1 [2, 3, 1] -> 1 and 0.
    assert picked(s, 1) == [[0, 2], [0, 1]]
    # Everything wanted: row 1's count stops at its 3 valid candidates, row 0 takes all 6.
    s = speculate(logits, valid, 1e9)
    assert s.counts.tolist() == [6, 3]
    assert picked(s, 0) == [list(range(6))] * 2 and picked(s, 1) == [[0, 1, 2]] * 2
    # Rows with different counts each take their own best (the first count entries of their index; in no
    # promised order). alpha 2: row 0 counts 3, 1, 1, 2 -> 1; row 1 (3 valid) 2, 1, 3, 3 -> 2.
    s = speculate(logits, valid, 2.0)
    assert s.counts.tolist() == [1, 2] and s.index.shape == (2, 2, 2)
    assert picked(s, 0) == [[2], [3]] and picked(s, 1) == [[0, 2], [0, 1]]
    s = speculate(torch.cat((LOGITS * 0.1, LOGITS)), None, 4.0)  # row 0 compressed: every logit within 4
    assert s.counts.tolist() == [6, 2] and s.index.shape == (2, 2, 6)
    assert picked(s, 0) == [list(range(6))] * 2 and picked(s, 1) == [[0, 2], [3, 4]]


def test_speculate_counts_stay_in_bounds_on_random_logits() -> None:
    g = torch.Generator().manual_seed(7)
    rows, kv_heads, group, n = 6, 3, 2, 20
    for alpha in (0.0, 0.3, 1.0, 4.0, 100.0):
        logits = torch.randn(rows, kv_heads, group, n, generator=g) * 3
        lengths = torch.randint(1, n + 1, (rows,), generator=g)
        valid = torch.arange(n)[None, :] < lengths[:, None]
        s = speculate(logits, valid, alpha)
        assert torch.all((s.counts >= 1) & (s.counts <= lengths))
        masked = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
        per_head = (masked >= masked.amax(-1, keepdim=True) - alpha).sum(-1).float()  # (R, Hkv, G)
        reference = per_head.mean(dim=(1, 2)).floor().long().clamp(min=1)
        assert torch.equal(s.counts, torch.minimum(reference, lengths))
        best = masked.amax(dim=2)  # (R, Hkv, n)
        for r in range(rows):
            k = int(s.counts[r])
            for h in range(kv_heads):
                chosen = s.index[r, h, :k]
                assert len(set(chosen.tolist())) == k and torch.all(chosen < lengths[r])
                rest = torch.ones(n, dtype=torch.bool)
                rest[chosen] = False
                rest &= valid[r]
                if rest.any():  # the chosen are the head's top candidates
                    assert best[r, h, chosen].min() >= best[r, h, rest].max()


# ----- pool victims -----

# One KV head, cap 6, slots in no particular order of insertion.
INSERTED = torch.tensor([[13, 10, 15, 11, 14, 12]])


def test_fifo_evicts_the_oldest() -> None:
    zeros = torch.zeros_like(INSERTED)
    assert choose_victims("fifo", zeros, zeros, INSERTED).tolist() == [1]
    inserted = torch.tensor([[3, 1, 2], [7, 9, 8]], dtype=torch.int32)  # two heads, int32 as the pool keeps them
    assert choose_victims("fifo", torch.zeros_like(inserted), inserted, inserted).tolist() == [1, 0]


def test_counter_evicts_the_least_selected_of_the_older_half() -> None:
    # The older half (cap // 2 = 3 slots): tokens 10, 11, 12 at slots 1, 3, 5.
    counts = torch.tensor([[0, 5, 0, 2, 0, 2]])  # the newer half is never selected (counts 0) yet protected
    assert choose_victims("counter", counts, INSERTED, INSERTED).tolist() == [3]  # 11 and 12 tie at 2: the older
    counts = torch.tensor([[0, 5, 0, 4, 0, 2]])
    assert choose_victims("counter", counts, INSERTED, INSERTED).tolist() == [5]  # token 12, selected least
    counts = torch.tensor([[9, 1, 9, 1, 9, 1]])
    assert choose_victims("counter", counts, INSERTED, INSERTED).tolist() == [1]  # all tie: the oldest


def test_lru_evicts_the_least_recently_selected_of_the_older_half() -> None:
    last_used = torch.tensor([[13, 20, 15, 25, 14, 20]])  # 10 and 12 last selected by row 20; the newer half idle
    assert choose_victims("lru", torch.zeros_like(INSERTED), last_used, INSERTED).tolist() == [1]
    last_used = torch.tensor([[13, 22, 15, 25, 14, 20]])
    assert choose_victims("lru", torch.zeros_like(INSERTED), last_used, INSERTED).tolist() == [5]
    # Two heads at once, the second with cap 6 but a different order.
    inserted = torch.cat((INSERTED, torch.tensor([[20, 21, 22, 23, 24, 25]])))
    last = torch.cat((last_used, torch.tensor([[30, 29, 28, 23, 24, 25]])))  # older half: 20, 21, 22
    assert choose_victims("lru", torch.zeros_like(inserted), last, inserted).tolist() == [5, 2]
    assert choose_victims("counter", torch.zeros_like(inserted), last, inserted).tolist() == [1, 0]


def test_victims_of_small_pools() -> None:
    one = torch.tensor([[4]])
    for eviction in ("fifo", "counter", "lru"):
        assert choose_victims(eviction, torch.tensor([[7]]), one, one).tolist() == [0]
    inserted = torch.tensor([[5, 3, 4]])  # cap 3: the older "half" is the single oldest slot
    counts = torch.tensor([[0, 9, 0]])
    assert choose_victims("counter", counts, inserted, inserted).tolist() == [1]
    assert choose_victims("lru", counts, torch.tensor([[1, 9, 2]]), inserted).tolist() == [1]


# ----- INT4 -----


@pytest.mark.parametrize(("dtype", "group"), [(torch.float32, 64), (torch.bfloat16, 64), (torch.float32, 16)])
def test_int4_round_trip_error_and_size(dtype, group) -> None:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 2, 64, generator=g) * torch.linspace(0.1, 4, 64)).to(dtype)
    packed, scales = quantize_int4(x, group)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 2, 32)
    assert scales.dtype == dtype and scales.shape == (5, 2, 64 // group, 2)
    back = dequantize_int4(packed, scales, dtype)
    assert back.shape == x.shape and back.dtype == dtype
    groups = x.float().unflatten(-1, (-1, group))
    step = (groups.amax(-1) - groups.amin(-1)) / 15  # (5, 2, 64 / g)
    error = (back.float() - x.float()).abs().unflatten(-1, (-1, group)).amax(-1)
    slack = 0.0 if dtype == torch.float32 else 2 * 2**-8  # bfloat16 rounds the scale, minimum and result
    magnitude = groups.abs().amax(-1)
    assert torch.all(error <= step / 2 * (1 + 1e-5) + slack * magnitude + 1e-6)
    # Bytes per (token, head) row: D / 2 codes and (scale, minimum) per group.
    size = packed[0, 0].numel() + scales[0, 0].numel() * scales.element_size()
    assert size == 64 // 2 + (64 // group) * 2 * torch.empty((), dtype=dtype).element_size()


def test_int4_packs_two_codes_per_byte_low_first() -> None:
    x = torch.tensor([[0.0, 15.0, 1.0, 2.0, 15.0, 0.0, 7.0, 8.0]])  # on the grid: min 0, scale 1
    packed, scales = quantize_int4(x, 8)
    assert packed.tolist() == [[0xF0, 0x21, 0x0F, 0x87]]
    assert scales.tolist() == [[[1.0, 0.0]]]
    assert torch.equal(dequantize_int4(packed, scales, torch.float32), x)
    constant = torch.full((1, 4), 2.5)  # a constant group: no division by zero, exact
    assert torch.equal(dequantize_int4(*quantize_int4(constant, 4), torch.float32), constant)


# ----- options -----


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"alpha": -1.0}, "infinigen_alpha must be 'auto' or a finite number >= 0 (or one per layer), got -1.0"),
        ({"alpha": float("inf")}, "got inf"),
        ({"partial_ratio": 0.0}, "infinigen_partial_ratio must be in (0, 1], got 0.0"),
        ({"partial_ratio": 1.5}, "infinigen_partial_ratio must be in (0, 1], got 1.5"),
        ({"pool_limit": 0.0}, "kv_pool_limit must be in (0, 1], got 0.0"),
        ({"pool_eviction": "random"}, "kv_pool_eviction must be one of ['counter', 'lru', 'fifo'], got 'random'"),
        ({"budget": 0.5}, "kv_budget must be 1, got 0.5"),
    ],
)
def test_infinigen_rejects_bad_options(knobs, message) -> None:
    with pytest.raises(ValueError) as error:
        InfiniGen(**knobs)
    assert message in str(error.value)


def test_infinigen_sizes() -> None:
    policy = InfiniGen(partial_ratio=0.3, pool_limit=0.5)
    assert policy.partial_dims(64) == 20 and InfiniGen(partial_ratio=0.001).partial_dims(64) == 1
    assert policy.pool_slots(10) == 5 and policy.pool_slots(11) == 6
    assert InfiniGen(pool_limit=0.01).pool_slots(10) == 1 and InfiniGen().pool_slots(37) == 37
    assert make_policy("infinigen", alpha=2.0, recent_ratio=0.3).alpha == 2.0  # knobs of others ignored
    assert make_policy("infinigen").budget == 1 and make_policy("int4").budget == 1
    assert Int4KV().groups(128) == 2
    with pytest.raises(ValueError, match="do not divide the head dim 48"):
        Int4KV().groups(48)
    with pytest.raises(ValueError, match="group_size must be an even integer >= 2, got 3"):
        Int4KV(group_size=3)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_policy": "int4"}, "kv_policy='int4' fetches from an offloaded cache"),
        ({"kv_offload": "host", "kv_policy": "h2o", "kv_pool_limit": 0.5}, "kv_pool_limit evicts by InfiniGen's"),
        ({"kv_offload": "host", "kv_pool_limit": 0.5}, "it needs kv_policy='infinigen', got 'full'"),
        ({"kv_offload": "host", "kv_policy": "int4", "kv_pool_limit": 0.5}, "got 'int4'"),
        ({"kv_pool_limit": 0.5}, "kv_pool_limit=0.5 limits an offloaded cache"),
        ({"kv_offload": "ssd"}, "kv_offload must be one of ['none', 'host', 'disk'], got 'ssd'"),
        ({"kv_offload": "disk", "preemption_mode": "swap"}, "preemption_mode='swap' does not apply"),
        ({"kv_offload": "host", "kv_offload_path": "/tmp"}, "kv_offload is 'host'"),
        ({"kv_offload": "host", "kv_policy": "infinigen", "infinigen_alpha": -2}, "got -2"),
        ({"kv_offload": "host", "kv_policy": "infinigen", "kv_pool_eviction": "lfu"}, "got 'lfu'"),
    ],
)
def test_engine_config_rejects_bad_offload_options(options, message) -> None:
    with pytest.raises(ValueError) as error:
        EngineConfig(**options)
    assert message in str(error.value)


def test_engine_config_accepts_offload_options(tmp_path: Path) -> None:
    config = EngineConfig(
        kv_offload="disk", kv_offload_path=str(tmp_path), kv_policy="infinigen", infinigen_alpha=2,
        infinigen_partial_ratio=0.5, kv_pool_limit=0.25, kv_pool_eviction="fifo",
    )  # fmt: skip
    policy = make_policy(config.kv_policy, config.kv_budget, **config.kv_policy_knobs)
    assert policy == InfiniGen(alpha=2, partial_ratio=0.5, pool_limit=0.25, pool_eviction="fifo")
    assert EngineConfig(kv_offload="host", kv_policy="int4").infinigen_alpha == "auto"
