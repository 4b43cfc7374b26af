"""The policies' own logic on hand-made tensors, without a cache or a model: slot scores from attention
(PyramidInfer's ensemble of recent queries, H2O's accumulated attention), decode-time score updates per
policy, attention with its weights, and InfiniGen's row selection, each against a written-out reference."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.attention.decode import paged_decode, paged_decode_reference
from kvserve.attention.paged import attend_prefill
from kvserve.policies import HeavyHitters, InfiniGen, LocalWindow, PyramidInfer
from kvserve.policies.base import update_scores
from kvserve.policies.scoring import SCORE_CHUNK, attend_voting_rows, column_sums, head_column_sums

H, HKV, D = 4, 2, 8  # GQA: query heads 0, 1 read KV head 0; 2, 3 read KV head 1


def _weights(q: torch.Tensor, keys: torch.Tensor, held: int) -> torch.Tensor:
    """Reference: (m, n) attention of each query row over the candidates it sees, mean over heads, by loops."""
    m, n = q.shape[0], keys.shape[0]
    out = torch.zeros(m, n)
    for j in range(m):
        visible = held + j + 1
        for h in range(H):
            logits = torch.tensor([float(q[j, h] @ keys[c, h // (H // HKV)]) / math.sqrt(D) for c in range(visible)])
            out[j, :visible] += torch.softmax(logits, 0) / H
    return out


def _case(m: int, held: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, H, D, generator=g), torch.randn(held + m, HKV, D, generator=g)


@pytest.mark.slow
@pytest.mark.parametrize(("m", "held"), [(1, 0), (5, 0), (6, 7), (SCORE_CHUNK + 3, 2)])
def test_column_sums_are_the_weighted_attention_each_candidate_receives(m, held) -> None:
    q, keys = _case(m, held)
    first = m // 3
    row_weights = torch.linspace(1, 2, m - first)
    expected = row_weights @ _weights(q, keys, held)[first:]
    assert torch.allclose(column_sums(q, keys, held, first, row_weights), expected, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(("m", "held", "first"), [(1, 0, 0), (7, 0, 3), (6, 9, 0), (SCORE_CHUNK + 5, 3, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_voting_rows_attend_and_score_from_one_softmax(m, held, first, dtype) -> None:
    """The voting rows' output is causal attention (SDPA's within rounding) and their scores are the same
    weighted column sums as scoring alone: across chunk boundaries, after cached slots, in both dtypes."""
    q, keys = _case(m, held, seed=m + held)
    q, values = 3 * q, torch.randn_like(keys)  # larger logits: peaked weights, where rounding them would show
    q, keys, values = q.to(dtype), keys.to(dtype), values.to(dtype)
    row_weights = torch.linspace(1, 2, m - first)
    out, sums = attend_voting_rows(q, keys, values, held, first, row_weights)
    # Against float32 attention over the same (rounded) inputs: in bfloat16 only the output's own rounding differs,
    # the logits and weights stay float32.
    expected = attend_prefill(q.float(), keys.float(), values.float(), held)[first:]
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype and out.shape == (m - first, H, D)
    assert torch.allclose(out.float(), expected, atol=tolerance)
    assert torch.allclose(sums, head_column_sums(q, keys, held, first, row_weights), atol=1e-6)
    if dtype == torch.float32:
        assert torch.allclose(sums.mean(dim=1), row_weights @ _weights(q, keys, held)[first:], atol=1e-5)


def test_pyramid_scores_by_its_recent_queries_weighted_towards_the_newest() -> None:
    q, keys = _case(10, 4)
    policy = PyramidInfer(budget=0.5, recent_ratio=0.2)
    num_tokens = 14
    recent = policy.recent_count(num_tokens)  # S_r: the last ceil(0.2 * 14) = 3 queries vote
    weights = torch.linspace(1.0, policy.distance_weight, recent)
    expected = (weights / weights.sum()) @ _weights(q, keys, 4)[-recent:]
    previous = torch.full((4,), 100.0)  # S_r ranks afresh: earlier scores do not count
    assert recent == 3
    assert torch.allclose(policy.prefill_scores(q, keys, 4, num_tokens, previous), expected, atol=1e-5)


def test_h2o_scores_add_every_query_to_the_cached_slots_scores() -> None:
    q, keys = _case(6, 3)
    previous = torch.tensor([0.5, 1.0, 2.0])
    expected = _weights(q, keys, 3).sum(0)
    expected[:3] += previous
    assert torch.allclose(HeavyHitters().prefill_scores(q, keys, 3, 9, previous), expected, atol=1e-5)


def test_positional_policies_score_nothing() -> None:
    q, keys = _case(4, 0)
    assert LocalWindow().prefill_scores(q, keys, 0, 4, None) is None


def test_decode_scores_update_each_sequence_by_its_own_policy() -> None:
    pyramid, h2o = PyramidInfer(decode_decay=0.75), HeavyHitters()
    scores = torch.tensor([[4.0, 8.0], [4.0, 8.0], [1.0, 1.0]])
    step = torch.tensor([[0.0, 4.0], [2.0, 2.0], [1.0, 0.0]])
    got = update_scores([pyramid, h2o, pyramid], scores, step)
    expected = torch.tensor([[3.0, 7.0], [6.0, 10.0], [1.0, 0.75]])
    assert torch.allclose(got, expected)


@pytest.mark.parametrize("attend", [paged_decode, paged_decode_reference], ids=["kernel", "reference"])
def test_decode_attention_weights_are_the_probabilities_averaged_over_heads(attend) -> None:
    """What H2O and PyramidInfer fold into their scores while decoding, written out by hand."""
    g = torch.Generator().manual_seed(3)
    batch, length = 3, 7
    q = torch.randn(batch, H, D, generator=g)
    kh, vh = torch.randn(batch, HKV, length, D, generator=g), torch.randn(batch, HKV, length, D, generator=g)
    lengths = torch.tensor([7, 4, 1])
    # Each row's keys as one block of `length` slots: (B, length, Hkv, D), table [[0], [1], [2]].
    k_cache, v_cache = kh.transpose(1, 2).contiguous(), vh.transpose(1, 2).contiguous()
    tables = torch.arange(batch, dtype=torch.int32).view(batch, 1)
    starts = torch.zeros(batch, dtype=torch.int32)
    out, weights = attend(q, k_cache, v_cache, tables, starts, lengths.int(), want_weights=True)
    for b in range(batch):
        n = int(lengths[b])
        k_rep = kh[b, :, :n].repeat_interleave(H // HKV, 0)  # (H, n, D)
        v_rep = vh[b, :, :n].repeat_interleave(H // HKV, 0)
        probs = torch.softmax((q[b][:, None, :] @ k_rep.transpose(1, 2))[:, 0] / math.sqrt(D), -1)  # (H, n)
        assert torch.allclose(out[b], (probs[:, None, :] @ v_rep)[:, 0], atol=1e-5)
        assert torch.allclose(weights[b, :n], probs.mean(0), atol=1e-6)
        assert torch.all(weights[b, n:] == 0)


def test_infinigen_rows_allowed_follow_speculation_among_earlier_rows() -> None:
    g = torch.Generator().manual_seed(5)
    m, held, r, group = 3, 5, 4, H // HKV
    partial_q = torch.randn(m, HKV, group, r, generator=g)
    partial_k = torch.randn(HKV, held + m, r, generator=g)
    everything = InfiniGen(alpha=1e9).rows_allowed(1, partial_q, partial_k, held, D)
    for j in range(m):  # alpha that admits every logit: all earlier rows and itself, nothing later
        assert everything[j].tolist() == [[c <= held + j for c in range(held + m)]] * HKV
    only_best = InfiniGen(alpha=0.0).rows_allowed(1, partial_q, partial_k, held, D)
    for j in range(m):
        for head in range(HKV):
            logits = partial_q[j, head] @ partial_k[head, : held + j].T  # (G, earlier rows)
            best = {int(i) for i in logits.argmax(-1)}  # each query head's best earlier row
            picked = set(torch.nonzero(only_best[j, head, : held + j]).flatten().tolist())
            assert picked <= best and picked  # the mean count over heads keeps at least one of them
            assert only_best[j, head, held + j] and not only_best[j, head, held + j + 1 :].any()
