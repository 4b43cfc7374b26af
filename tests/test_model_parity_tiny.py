"""kvserve's Llama-family model against transformers on tiny random checkpoints (float32, CPU).

Every config is written as a Hugging Face folder, loaded by ``kvserve.models.load_model`` and by
transformers itself, and the logits are compared at every position: full prefill, incremental
decoding through the contiguous KV cache, and explicit (offset) position ids.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.attention import AttentionMetadata, ContiguousKVCache
from kvserve.models import load_model
from tests.tiny_models import (  # noqa: F401 - torch_single_thread is an autouse fixture
    VOCAB_SIZE,
    TinySpec,
    build_hf_model,
    hf_logits,
    load_hf_model,
    torch_single_thread,
    write_tiny_model,
)

ATOL = 1e-4
SEQ_LEN = 40

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
LINEAR_SCALING = {"rope_type": "linear", "factor": 2.0}

CONFIGS = {
    "mha_4_4": TinySpec(num_heads=4, num_kv_heads=4),
    "gqa_4_2": TinySpec(num_heads=4, num_kv_heads=2),
    "mqa_4_1": TinySpec(num_heads=4, num_kv_heads=1),
    # Five heads of 16 (hidden 80): a head count that is neither a power of two nor a multiple of 2.
    "odd_5_1_hd16": TinySpec(num_heads=5, num_kv_heads=1, hidden_size=80),
    # Explicit head_dim with num_heads * head_dim (128) != hidden_size (64).
    "explicit_head_dim_8_2_hd16": TinySpec(num_heads=8, num_kv_heads=2, head_dim=16),
    "tied_gqa": TinySpec(num_heads=4, num_kv_heads=2, tie_word_embeddings=True),
    "untied_mha_seed1": TinySpec(num_heads=4, num_kv_heads=4, tie_word_embeddings=False, seed=1),
    "qwen2_bias_gqa": TinySpec(arch="qwen2", num_heads=4, num_kv_heads=2, rope_theta=1_000_000.0),
    "qwen2_bias_tied_mqa": TinySpec(arch="qwen2", num_heads=4, num_kv_heads=1, tie_word_embeddings=True),
    "llama3_rope": TinySpec(num_heads=4, num_kv_heads=2, rope_scaling=LLAMA3_SCALING, rope_theta=500_000.0),
    "linear_rope": TinySpec(num_heads=4, num_kv_heads=2, rope_scaling=LINEAR_SCALING),
}


@dataclasses.dataclass
class Tiny:
    spec: TinySpec
    loaded: object  # kvserve LoadedModel
    hf: object  # transformers model


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def tiny(request, tmp_path_factory) -> Tiny:
    spec = CONFIGS[request.param]
    folder = write_tiny_model(tmp_path_factory.mktemp(request.param), spec)
    return Tiny(spec, load_model(folder, dtype=torch.float32), load_hf_model(folder))


def _ids(n: int = SEQ_LEN, seed: int = 1234) -> torch.Tensor:
    return torch.randint(0, VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(seed))


def _new_cache(loaded, num_seqs: int = 1, max_len: int = 64) -> ContiguousKVCache:
    cfg = loaded.config
    return ContiguousKVCache(cfg.num_layers, num_seqs, cfg.num_kv_heads, cfg.head_dim, max_len, torch.float32)


@torch.inference_mode()
def _step(loaded, cache, ids: torch.Tensor, positions: torch.Tensor, context_len: int, seq: int = 0) -> torch.Tensor:
    """Run ``ids`` of one sequence at ``positions`` after ``context_len`` cached tokens; logits (N, vocab)."""
    metadata = AttentionMetadata(seq_ids=(seq,), query_lens=(len(ids),), context_lens=(context_len,))
    hidden = loaded.model(ids, positions, cache, metadata)
    return loaded.model.compute_logits(hidden)


def test_config_is_read_from_hf_folder(tiny: Tiny) -> None:
    cfg, spec = tiny.loaded.config, tiny.spec
    assert cfg.architecture == spec.arch
    assert (cfg.num_heads, cfg.num_kv_heads) == (spec.num_heads, spec.num_kv_heads)
    assert cfg.head_dim == (spec.head_dim or spec.hidden_size // spec.num_heads)
    assert cfg.tie_word_embeddings == spec.tie_word_embeddings
    assert cfg.attention_bias == (spec.arch == "qwen2")
    assert cfg.rope_theta == spec.rope_theta
    if spec.rope_scaling is None:
        assert cfg.rope_scaling is None
    else:
        assert cfg.rope_scaling.rope_type == spec.rope_scaling["rope_type"]
        assert cfg.rope_scaling.factor == spec.rope_scaling["factor"]


def test_full_sequence_logits_match_hf(tiny: Tiny) -> None:
    ids = _ids()
    ours = _step(tiny.loaded, _new_cache(tiny.loaded), ids, torch.arange(SEQ_LEN), 0)
    ref = hf_logits(tiny.hf, ids)
    assert ours.shape == ref.shape == (SEQ_LEN, VOCAB_SIZE)
    assert ref.std() > 1.0, "reference logits are degenerate; the comparison would be vacuous"
    assert (ours - ref).abs().max().item() <= ATOL


def test_incremental_decoding_matches_hf(tiny: Tiny) -> None:
    """Prefill 30, then 5 single-token steps, then one 5-token chunk on top of the cache."""
    ids = _ids()
    ref = hf_logits(tiny.hf, ids)
    cache = _new_cache(tiny.loaded)
    got = [_step(tiny.loaded, cache, ids[:30], torch.arange(30), 0)]
    for pos in range(30, 35):
        got.append(_step(tiny.loaded, cache, ids[pos : pos + 1], torch.tensor([pos]), pos))
    got.append(_step(tiny.loaded, cache, ids[35:40], torch.arange(35, 40), 35))
    ours = torch.cat(got)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= ATOL


def test_two_sequences_in_one_step_match_hf(tiny: Tiny) -> None:
    """Flattened batch: a 12-token prefill of sequence 1 next to a decode step of sequence 0."""
    a, b = _ids(20, seed=5), _ids(12, seed=6)
    cache = _new_cache(tiny.loaded, num_seqs=2)
    _step(tiny.loaded, cache, a[:19], torch.arange(19), 0, seq=0)
    metadata = AttentionMetadata(seq_ids=(0, 1), query_lens=(1, 12), context_lens=(19, 0))
    with torch.inference_mode():
        hidden = tiny.loaded.model(
            torch.cat([a[19:], b]), torch.cat([torch.tensor([19]), torch.arange(12)]), cache, metadata
        )
        ours = tiny.loaded.model.compute_logits(hidden)
    assert (ours[0] - hf_logits(tiny.hf, a)[19]).abs().max().item() <= ATOL
    assert (ours[1:] - hf_logits(tiny.hf, b)).abs().max().item() <= ATOL


def test_explicit_positions_offset(tiny: Tiny) -> None:
    """Positions 7..46 with an empty cache: equals transformers with position_ids offset by 7.

    RoPE only sees relative distances, so a uniform shift must leave the logits (almost) unchanged;
    the gap test below is the one where explicit positions change the result.
    """
    ids = _ids()
    at_zero = _step(tiny.loaded, _new_cache(tiny.loaded), ids, torch.arange(SEQ_LEN), 0)
    at_seven = _step(tiny.loaded, _new_cache(tiny.loaded), ids, torch.arange(7, 7 + SEQ_LEN), 0)
    ref = hf_logits(tiny.hf, ids, position_offset=7)
    assert (at_seven - ref).abs().max().item() <= ATOL
    assert (at_seven - at_zero).abs().max().item() <= 1e-3


@pytest.mark.parametrize("incremental", [False, True], ids=["one_step", "prefill_then_chunk"])
def test_explicit_positions_with_gap(tiny: Tiny, incremental: bool) -> None:
    """Tokens 20..39 at positions 27..46: cache slots stay contiguous, rotary positions jump by 7."""
    ids = _ids()
    positions = torch.cat([torch.arange(20), torch.arange(27, 47)])
    cache = _new_cache(tiny.loaded)
    if incremental:
        first = _step(tiny.loaded, cache, ids[:20], positions[:20], 0)
        ours = torch.cat([first, _step(tiny.loaded, cache, ids[20:], positions[20:], 20)])
    else:
        ours = _step(tiny.loaded, cache, ids, positions, 0)
    contiguous = _step(tiny.loaded, _new_cache(tiny.loaded), ids, torch.arange(SEQ_LEN), 0)
    assert (ours[20:] - contiguous[20:]).abs().max().item() > 1e-2
    ref = hf_logits(tiny.hf, ids, positions=positions)
    assert (ours - ref).abs().max().item() <= ATOL


@pytest.mark.parametrize("name", ["llama3_rope", "linear_rope"])
def test_rope_scaling_changes_the_logits(name, tmp_path) -> None:
    """Guard against a vacuous pass: the scaling must change the model's output noticeably."""
    spec = CONFIGS[name]
    scaled = build_hf_model(spec)
    unscaled = build_hf_model(dataclasses.replace(spec, rope_scaling=None))
    unscaled.load_state_dict(scaled.state_dict())
    ids = _ids()
    loaded = load_model(write_tiny_model(tmp_path, spec))
    ours = _step(loaded, _new_cache(loaded), ids, torch.arange(SEQ_LEN), 0)
    assert (ours - hf_logits(scaled, ids)).abs().max().item() <= ATOL
    assert (ours - hf_logits(unscaled, ids)).abs().max().item() > 1e-2


def test_llama_attention_bias_matches_hf(tmp_path) -> None:
    """Llama with ``attention_bias: true`` has biases on q/k/v *and* o_proj (transformers' LlamaAttention)."""
    spec = TinySpec(num_heads=4, num_kv_heads=2, attention_bias=True)
    folder = write_tiny_model(tmp_path, spec)
    loaded = load_model(folder)
    ids = _ids()
    ours = _step(loaded, _new_cache(loaded), ids, torch.arange(SEQ_LEN), 0)
    assert (ours - hf_logits(load_hf_model(folder), ids)).abs().max().item() <= ATOL
