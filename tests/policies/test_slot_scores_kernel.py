"""The compiled fold of a decode step's attention into the compressed cache's slot scores
(``csrc/slot_scores.cpp``) against the same fold written out with torch ops: bit-identical scores, shared slots
ending as the last row's, partial blocks and empty rows, and refusals that name the problem."""

from __future__ import annotations

import pytest
import torch

from kvserve.platform.cpu_kernels import cpu_kernels_available
from kvserve.policies import make_policy

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="kvserve's CPU kernels did not build here")

BLOCK = 16


def reference(scores: torch.Tensor, tables, ends, weights, coefficients) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's new scores from the old ones (a * s + b * w in float32, as ``KVPolicy.update``), then written
    back in row order; returns (the rows' new scores, zero past each end; the slot scores after)."""
    old, after = scores.clone(), scores.clone()
    out = torch.zeros_like(weights)
    for r in range(tables.shape[0]):
        end = int(ends[r])
        slots = (tables[r].long()[:, None] * BLOCK + torch.arange(BLOCK)).view(-1)[:end]
        a, b = (float(c) for c in coefficients[r])
        out[r, :end] = torch.tensor(a, dtype=torch.float32) * old[slots] + torch.tensor(b) * weights[r, :end]
    for r in range(tables.shape[0]):
        end = int(ends[r])
        slots = (tables[r].long()[:, None] * BLOCK + torch.arange(BLOCK)).view(-1)[:end]
        after[slots] = out[r, :end]
    return out, after


def case(seed: int, rows: int = 7, width: int = 5, blocks: int = 40):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(blocks * BLOCK, generator=gen)
    tables = torch.randint(0, blocks, (rows, width), generator=gen, dtype=torch.int32)
    tables[1, :2] = tables[0, :2]  # two rows share blocks (a shared prefix)
    ends = torch.randint(0, width * BLOCK + 1, (rows,), generator=gen, dtype=torch.int32)
    ends[0], ends[1], ends[2] = width * BLOCK, 2 * BLOCK - 3, 0  # a full table, a partial block, an empty row
    weights = torch.rand(rows, width * BLOCK + 3, generator=gen)  # wider than the tables, as paged_decode pads
    policies = [make_policy("h2o", 0.5), make_policy("pyramid", 0.5), make_policy("snapkv", 0.5)]
    coefficients = torch.tensor([policies[r % 3].score_update() for r in range(rows)], dtype=torch.float32)
    return scores, tables, ends, weights, coefficients


@pytest.mark.parametrize("seed", range(4))
def test_fold_is_the_written_out_fold_bit_for_bit(seed: int) -> None:
    scores, tables, ends, weights, coefficients = case(seed)
    expected_out, expected_scores = reference(scores, tables, ends, weights, coefficients)
    out = torch.ops.kvserve.fold_slot_scores(scores, tables, ends, weights, coefficients, BLOCK)
    assert torch.equal(out, expected_out)
    assert torch.equal(scores, expected_scores)


def test_coefficients_are_each_policys_update() -> None:
    """The fold's (a, b) reproduce ``KVPolicy.update`` exactly: H2O accumulates, the others average."""
    gen = torch.Generator().manual_seed(0)
    s, w = torch.rand(7 * BLOCK, generator=gen), torch.rand(100, generator=gen)
    for name in ("h2o", "pyramid", "snapkv", "pyramidkv"):
        policy = make_policy(name, 0.5)
        a, b = policy.score_update()
        scores = s.clone()
        tables = torch.arange(7, dtype=torch.int32)[None]  # slots 0..111, the first 100 read
        coefficients = torch.tensor([[a, b]], dtype=torch.float32)
        ends = torch.tensor([100], dtype=torch.int32)
        out = torch.ops.kvserve.fold_slot_scores(scores, tables, ends, w[None], coefficients, BLOCK)
        assert torch.equal(out[0, :100], policy.update(s[:100], w)), name
        assert torch.equal(scores[:100], out[0, :100]) and torch.equal(scores[100:], s[100:])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.update(ends=torch.tensor([81] + [0] * 6, dtype=torch.int32)), "row 0 ends at 81, past its 80"),
        (lambda c: c["tables"].__setitem__((3, 0), 40), "reads block 40 of 40"),
        (lambda c: c.update(tables=c["tables"].long()), "tables must be \\(R, W\\) int32"),
        (lambda c: c.update(weights=c["weights"].double()), "weights must be \\(R, T\\) float32"),
        (lambda c: c.update(coefficients=c["coefficients"][:, :1]), "coefficients must be \\(R, 2\\) float32"),
    ],
)
def test_bad_inputs_are_refused_by_name(change, message: str) -> None:
    scores, tables, ends, weights, coefficients = case(0)
    ends[3] = BLOCK  # row 3 reads its first block
    inputs = {"tables": tables, "ends": ends, "weights": weights, "coefficients": coefficients}
    change(inputs)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kvserve.fold_slot_scores(
            scores, inputs["tables"], inputs["ends"], inputs["weights"], inputs["coefficients"], BLOCK
        )
