"""Policy arithmetic: retention schedules, capacities, the step rule, and which slots each policy keeps."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.policies import KV_POLICY_NAMES, make_policy
from kvserve.policies.pyramid import PyramidInfer, ensemble_weights, pyramid_schedule


@pytest.mark.parametrize("budget", [0.25, 0.5, 0.6, 0.75])
def test_pyramid_schedule_meets_the_budget_and_decays(budget) -> None:
    policy = PyramidInfer(budget)
    r = policy.retention(30)
    assert len(r) == 30 and math.isclose(sum(r) / 30, budget, rel_tol=1e-6)
    assert r[0] == 1.0 and all(a >= b for a, b in zip(r, r[1:], strict=False))
    assert min(r) >= policy.recent_share - 1e-9  # S_r is never dropped


def test_pyramid_reduces_less_in_the_first_half() -> None:
    """The paper's shape: about 7% cut in the first half of the layers at a 60% overall budget
    (with the authors' 20% recent window), the deep layers keeping little more than S_r."""
    r = pyramid_schedule(30, 0.6, 0.2)
    first_half_cut = 1 - sum(r[:15]) / 15
    assert 0.05 < first_half_cut < 0.15
    assert r[-1] < 0.3


def test_explicit_layer_retention() -> None:
    policy = PyramidInfer(layer_retention=(1.0, 0.5, 0.25))
    assert policy.retention(3) == (1.0, 0.5, 0.25)
    assert [policy.capacity(layer, 3, 100) for layer in range(3)] == [100, 50, 25]
    with pytest.raises(ValueError, match="3 entries; the model has 4"):
        policy.retention(4)
    with pytest.raises(ValueError, match="must not grow with depth"):
        PyramidInfer(layer_retention=(0.5, 0.8))
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        PyramidInfer(layer_retention=(1.0, 0.0))


def test_capacity_floor_and_step_rule() -> None:
    local = make_policy("local", 0.25, min_tokens=8)
    assert local.capacity(0, 4, 100) == 25
    assert local.capacity(0, 4, 20) == 8  # the floor
    assert local.capacity(0, 4, 5) == 5  # never more than the sequence
    # Nothing dropped while within capacity + slack; compressed to capacity beyond it.
    assert local.slots_after(0, 4, held=25, new=1, num_tokens=101, slack=4) == 26
    assert local.slots_after(0, 4, held=30, new=1, num_tokens=101, slack=4) == 26
    assert local.slots_after(0, 4, held=0, new=100, num_tokens=100, slack=4) == 25
    pyramid = make_policy("pyramid", 0.5)
    held = [0, 40, 60, 500]
    assert pyramid.slots_after_per_layer(held, 1, 600, 16) == [
        pyramid.slots_after(layer, 4, h, 1, 600, 16) for layer, h in enumerate(held)
    ]
    full = make_policy("full")
    assert full.lossless and full.slots_after(0, 4, 100, 7, 107, 0) == 107


def test_selection_per_policy() -> None:
    scores = torch.tensor([5.0, 0.0, 9.0, 1.0, 8.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert make_policy("local", 0.5, num_sinks=2).select(None, 10, 5, 10).tolist() == [0, 1, 7, 8, 9]
    # H2O: half recent (3 of 6), the rest the highest accumulated scores among the older ones.
    assert make_policy("h2o", 0.5).select(scores, 10, 6, 10).tolist() == [0, 2, 4, 7, 8, 9]
    # PyramidInfer: the sink, |S_r| = ceil(0.2 * 10) = 2 recent tokens, then the top-2 PvCs among the rest.
    pyramid = make_policy("pyramid", 0.5, recent_ratio=0.2, num_sinks=1)
    assert pyramid.select(scores, 10, 5, 10).tolist() == [0, 2, 4, 8, 9]


def test_ensemble_weights_favour_recent_queries() -> None:
    w = ensemble_weights(4, 1.2)
    assert torch.allclose(w.sum(), torch.tensor(1.0)) and w.tolist() == sorted(w.tolist())
    assert torch.isclose(w[-1], 1.2 * w[0])


def test_bad_policy_options_name_the_value() -> None:
    with pytest.raises(ValueError, match="kv_policy must be one of"):
        make_policy("snap")
    with pytest.raises(ValueError, match="kv_budget must be in"):
        make_policy("pyramid", 0.0)
    with pytest.raises(ValueError, match="recent_ratio"):
        make_policy("h2o", 0.5, recent_ratio=2.0)
    with pytest.raises(ValueError, match="kv_budget must be 1"):
        make_policy("full", 0.5)
    names = {"full", "pyramid", "local", "h2o", "snapkv", "pyramidkv", "adakv", "infinigen", "int4"}
    assert set(KV_POLICY_NAMES) == names
    assert make_policy("local", 0.5, recent_ratio=0.3) == make_policy("local", 0.5)  # knobs of others ignored
