"""KV-Runahead and TSP prefill with real worker processes on loopback, against single-process prefill.

A tiny random Llama (GQA) in float32: the last rank's hidden states, first-token logits and the full
KV cache it hands to its sink must equal a plain prefill's, for p = 2 and 3, even and uneven
partitions, and prompt lengths not divisible by p.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.attention import AttentionMetadata, ContiguousKVCache
from kvserve.parallel import ChunkJob, PrefillGroup, WorkerModel
from kvserve.policies.scoring import column_sums
from tests.parallel.conftest import even, prompt

ATOL = 1e-4


def reference(loaded, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Single-process prefill: final hidden states (C, hidden), keys and values (layers, C, Hkv, D)."""
    cfg = loaded.config
    cache = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, len(ids), torch.float32)
    metadata = AttentionMetadata(seq_ids=(0,), query_lens=(len(ids),), context_lens=(0,))
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache, metadata)
    return hidden, cache.k[:, 0].transpose(1, 2), cache.v[:, 0].transpose(1, 2)


class KVCollector:
    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.scores: dict[int, torch.Tensor | None] = {}

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor, scores: torch.Tensor | None) -> None:
        self.k[layer], self.v[layer], self.scores[layer] = k.clone(), v.clone(), scores


class QueryRecorder(ContiguousKVCache):
    """The single-process reference, keeping each layer's queries."""

    def forward(self, layer, q, k, v, metadata):  # noqa: ANN001, ANN201 - the backend's signature
        self.queries[layer] = q.clone()
        return super().forward(layer, q, k, v, metadata)


@pytest.fixture(scope="module", params=[2, 3], ids=["p2", "p3"])
def group(request, tiny):
    folder, loaded = tiny
    g = PrefillGroup(loaded.model, WorkerModel(str(folder), "float32", "dequant"), request.param, threads_per_proc=1)
    yield g
    g.close()
    assert all(not w.is_alive() for w in g.workers)


def uneven(n: int, p: int) -> tuple[int, ...]:
    """Earlier chunks larger, as causal attention wants: boundaries at n * sqrt(i / p)."""
    return (0, *(round(n * (i / p) ** 0.5) for i in range(1, p)), n)


@pytest.mark.slow
@pytest.mark.parametrize("length", [61, 96])
@pytest.mark.parametrize(("scheme", "split"), [("runahead", "even"), ("runahead", "uneven"), ("tsp", "even")])
def test_parallel_prefill_equals_single_process(group, tiny, scheme, split, length) -> None:
    """TSP splits evenly by definition; KV-Runahead either way."""
    _, loaded = tiny
    ids = prompt(length)
    boundaries = (even if split == "even" else uneven)(length, group.num_procs)
    sink = KVCollector()
    hidden = group.prefill(ChunkJob(scheme, tuple(ids), boundaries), sink)
    ref_hidden, ref_k, ref_v = reference(loaded, ids)
    last = boundaries[-2]
    assert hidden.shape == (length - last, loaded.config.hidden_size)
    assert torch.allclose(hidden, ref_hidden[last:], atol=ATOL)
    logits, ref_logits = loaded.model.compute_logits(hidden[-1:]), loaded.model.compute_logits(ref_hidden[-1:])
    assert torch.allclose(logits, ref_logits, atol=ATOL)
    for layer in range(loaded.config.num_layers):
        assert torch.allclose(sink.k[layer], ref_k[layer], atol=ATOL)
        assert torch.allclose(sink.v[layer], ref_v[layer], atol=ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("voters", ["all", "recent"])
@pytest.mark.parametrize("scheme", ["runahead", "tsp"])
def test_votes_added_up_over_ranks_equal_one_process_scores(group, tiny, scheme, voters) -> None:
    """A compressing policy's scores (parallel/votes.py): every rank scores the keys with its own voting queries
    and the last adds the shares up; equal to the whole prompt's column sums in one process. H2O's votes
    (every query) and PyramidInfer's (a recent window reaching into the second-to-last chunk, weighted)."""
    _, loaded = tiny
    cfg, length = loaded.config, 61
    ids = prompt(length)
    boundaries = even(length, group.num_procs)
    first = 0 if voters == "all" else boundaries[-2] - 5
    weights = torch.linspace(1.0, 2.0, length - first)
    sink = KVCollector()
    job = ChunkJob(scheme, tuple(ids), boundaries, vote_from=first, vote_weights=tuple(weights.tolist()))
    group.prefill(job, sink)
    recorder = QueryRecorder(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, length, torch.float32)
    recorder.queries = {}
    metadata = AttentionMetadata(seq_ids=(0,), query_lens=(length,), context_lens=(0,))
    with torch.inference_mode():
        loaded.model(torch.tensor(ids), torch.arange(length), recorder, metadata)
    for layer in range(cfg.num_layers):
        keys = recorder.k[layer, 0].transpose(0, 1)  # (C, Hkv, D)
        expected = column_sums(recorder.queries[layer], keys, 0, first, weights)
        assert torch.allclose(sink.scores[layer], expected, atol=ATOL)


@pytest.mark.slow
def test_bad_jobs_are_rejected(group) -> None:
    with pytest.raises(ValueError, match="do not split 10 tokens"):
        ChunkJob("runahead", tuple(range(10)), (0, 5, 5, 10))
    with pytest.raises(ValueError, match="1 vote weights for queries 4..9"):
        ChunkJob("runahead", tuple(range(10)), (0, 10), vote_from=4, vote_weights=(1.0,))
    with pytest.raises(ValueError, match="scheme must be one of"):
        ChunkJob("ring", tuple(range(10)), (0, 10))
    with pytest.raises(ValueError, match="chunks, the group"):
        group.prefill(ChunkJob("runahead", tuple(range(10)), (0, 10)))
