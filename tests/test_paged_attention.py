"""Paged attention against the contiguous reference: exact bookkeeping, exact block moves, equal outputs.

Block tables are drawn from shuffled block ids so that no sequence's blocks are contiguous, and the
paged cache starts full of random values so that any slot read by mistake (padding, another
sequence's block) changes the result.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvserve.attention import AttentionMetadata, ContiguousKVCache, PagedAttentionMetadata, PagedKVCache
from kvserve.attention.paged_plan import make_plan
from kvserve.entrypoints.generation import Generator
from kvserve.models import load_model
from kvserve.sampling.sampling_params import SamplingParams
from tests.tiny_models import (  # noqa: F401 - torch_single_thread is an autouse fixture
    VOCAB_SIZE,
    TinySpec,
    torch_single_thread,
    write_tiny_model,
)

ATOL = 1e-5
HEAD_DIM = 8
NUM_LAYERS = 2
HEADS = {"mha_4_4": (4, 4), "gqa_6_2": (6, 2), "mqa_4_1": (4, 1)}


class Pair:
    """A paged cache and a contiguous reference run on the same steps; block tables grow on demand."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, block_size: int, num_seqs: int, max_len: int, seed: int = 0,
        consecutive: bool = False, windows: tuple[int | None, ...] = (), release: bool = False,
    ):  # fmt: skip
        self.num_heads, self.num_kv_heads, self.block_size = num_heads, num_kv_heads, block_size
        num_blocks = num_seqs * math.ceil(max_len / block_size) + 3
        self.paged = PagedKVCache(NUM_LAYERS, num_blocks, block_size, num_kv_heads, HEAD_DIM, torch.float32)
        self.paged.k.normal_(generator=torch.Generator().manual_seed(seed))
        self.paged.v.normal_(generator=torch.Generator().manual_seed(seed + 1))
        self.ref = ContiguousKVCache(NUM_LAYERS, num_seqs, num_kv_heads, HEAD_DIM, max_len, torch.float32)
        self.free = list(range(num_blocks))
        if consecutive:  # handed out in order: each sequence's blocks are consecutive ids (from block 1 on)
            self.free.reverse()
            self.free.pop()
        else:
            random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.gen = torch.Generator().manual_seed(seed + 2)
        # Sliding windows per layer; with ``release``, blocks no layer's window can see any more are
        # replaced in the tables by a trash block of large values, as a window KV group releases them.
        self.windows, self.release = windows, release
        self.trash = self.free.pop()
        self.paged.k[:, self.trash] = 1e4
        self.paged.v[:, self.trash] = -1e4

    def step(self, batch: list[tuple[int, int]]) -> float:
        """Run one step of (seq, query_len) through both caches; return the largest difference."""
        seqs = [s for s, _ in batch]
        q_lens = [n for _, n in batch]
        ctx = [self.lens.get(s, 0) for s in seqs]
        for s, c, n in zip(seqs, ctx, q_lens, strict=True):
            table = self.tables.setdefault(s, [])
            while len(table) * self.block_size < c + n:
                table.append(self.free.pop())
            self.lens[s] = c + n
        if self.release:
            for s, c in zip(seqs, ctx, strict=True):
                self._release_out_of_window(s, c)
        meta = PagedAttentionMetadata.build_grouped(
            seqs, q_lens, ctx, [[self.tables[s] for s in seqs]], self.block_size, "cpu", layer_windows=self.windows
        )
        self.last_plan = make_plan(meta)
        ref_meta = AttentionMetadata(
            seq_ids=tuple(seqs), query_lens=tuple(q_lens), context_lens=tuple(ctx), layer_windows=self.windows
        )
        worst = 0.0
        n = sum(q_lens)
        for layer in range(NUM_LAYERS):
            q = torch.randn(n, self.num_heads, HEAD_DIM, generator=self.gen)
            k = torch.randn(n, self.num_kv_heads, HEAD_DIM, generator=self.gen)
            v = torch.randn(n, self.num_kv_heads, HEAD_DIM, generator=self.gen)
            got = self.paged.forward(layer, q, k, v, meta)
            want = self.ref.forward(layer, q, k, v, ref_meta)
            assert got.shape == want.shape == (n, self.num_heads, HEAD_DIM)
            worst = max(worst, (got - want).abs().max().item())
        return worst

    def _release_out_of_window(self, seq: int, num_computed: int) -> None:
        """Blocks wholly before the widest window of a query at ``num_computed`` go to the trash block."""
        first_visible = num_computed - max(self.windows) + 1
        table = self.tables[seq]
        for j in range(max(0, first_visible) // self.block_size):
            table[j] = self.trash


@pytest.mark.parametrize("consecutive", [True, False], ids=["consecutive-blocks", "shuffled-blocks"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_single_sequence_decode_in_consecutive_or_shuffled_blocks(block_size: int, consecutive: bool) -> None:
    """One decoding sequence reads its blocks through its table wherever they lie; the same result either way."""
    pair = Pair(*HEADS["gqa_6_2"], block_size=block_size, num_seqs=1, max_len=40, consecutive=consecutive)
    assert pair.step([(0, 21)]) < ATOL
    for _ in range(6):
        assert pair.step([(0, 1)]) < ATOL


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
def test_mixed_steps_match_contiguous(heads: str, block_size: int) -> None:
    """Fresh prefills, chunked prefills and decodes, mixed and out of order, over several steps."""
    pair = Pair(*HEADS[heads], block_size=block_size, num_seqs=4, max_len=64)
    steps = [
        [(0, 13), (1, 7), (2, 1)],  # two fresh prefills, a one-token prompt
        [(0, 1), (1, 9), (2, 20), (3, 5)],  # decode, two chunked prefills, a fresh prefill
        [(0, 1), (1, 1), (2, 1), (3, 1)],  # decode only
        [(3, 1), (1, 3), (0, 1), (2, 1)],  # decodes around a chunk, sequences out of order
        [(2, 1), (0, 1)],
        [(1, 1), (3, 1), (2, 1), (0, 1)],
    ]
    for batch in steps:
        assert pair.step(batch) <= ATOL


@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
def test_decode_batch_of_very_different_lengths(heads: str) -> None:
    pair = Pair(*HEADS[heads], block_size=4, num_seqs=4, max_len=160, seed=3)
    assert pair.step([(0, 1), (1, 3), (2, 130), (3, 37)]) <= ATOL
    for _ in range(3):
        assert pair.step([(0, 1), (1, 1), (2, 1), (3, 1)]) <= ATOL


def test_slot_mapping_and_block_tables_are_exact() -> None:
    meta = PagedAttentionMetadata.build(
        seq_ids=[5, 9], query_lens=[3, 4], context_lens=[0, 5], block_tables=[[7, 2], [1, 9, 4]], block_size=4
    )
    # seq 5: positions 0-2 in block 7; seq 9: positions 5-7 in block 9 (offsets 1-3), 8 in block 4.
    assert meta.slot_mapping.tolist() == [28, 29, 30, 37, 38, 39, 16]
    assert meta.slot_mapping.dtype == torch.long
    assert meta.block_tables[0].tolist() == [[7, 2, 0], [1, 9, 4]]
    assert meta.seq_lens == (3, 9)
    assert meta.num_tokens == 7


def test_too_short_block_table_is_rejected() -> None:
    with pytest.raises(ValueError, match="needs 9 slots"):
        PagedAttentionMetadata.build([0], [4], [5], [[1, 2]], block_size=4)


def test_contiguous_metadata_is_rejected() -> None:
    cache = PagedKVCache(1, 4, 4, 1, HEAD_DIM, torch.float32)
    x = torch.zeros(1, 1, HEAD_DIM)
    with pytest.raises(TypeError, match="PagedAttentionMetadata"):
        cache.forward(0, x, x, x, AttentionMetadata(seq_ids=(0,), query_lens=(1,), context_lens=(0,)))


def test_layers_read_their_own_group() -> None:
    """Two KV groups with different tables: each layer writes and reads its group's blocks only."""
    cache = PagedKVCache(2, 8, 2, 1, HEAD_DIM, torch.float32)
    ref = ContiguousKVCache(2, 1, 1, HEAD_DIM, 8, torch.float32)
    groups = [[[3, 6, 1]], [[5, 0, 7]]]
    gen = torch.Generator().manual_seed(7)
    for ctx, q_len in ((0, 4), (4, 1)):
        meta = PagedAttentionMetadata.build_grouped([0], [q_len], [ctx], groups, 2, "cpu", layer_to_group=(0, 1))
        ref_meta = AttentionMetadata(seq_ids=(0,), query_lens=(q_len,), context_lens=(ctx,))
        for layer in range(2):
            q, k, v = (torch.randn(q_len, 1, HEAD_DIM, generator=gen) for _ in range(3))
            got = cache.forward(layer, q, k, v, meta)
            assert (got - ref.forward(layer, q, k, v, ref_meta)).abs().max().item() <= ATOL
    for layer, table in enumerate(([3, 6, 1], [5, 0, 7])):
        stored = cache.k[layer, table].flatten(0, 1)[:5]  # (5, Hkv, D)
        assert torch.equal(stored, ref.k[layer, 0, :, :5].transpose(0, 1))
        unused = sorted(set(range(8)) - set(table))
        assert not cache.k[layer, unused].any()


def _random_cache(num_blocks: int, seed: int) -> PagedKVCache:
    cache = PagedKVCache(3, num_blocks, 4, 2, HEAD_DIM, torch.float32)
    cache.k.normal_(generator=torch.Generator().manual_seed(seed))
    cache.v.normal_(generator=torch.Generator().manual_seed(seed + 1))
    return cache


def test_copy_blocks_copies_every_layer_and_reads_before_writing() -> None:
    cache = _random_cache(8, seed=11)
    k0, v0 = cache.k.clone(), cache.v.clone()
    pairs = [(3, 5), (0, 7), (5, 2)]  # block 5 is a target and a source: the source is its old contents
    cache.copy_blocks(pairs)
    want_k, want_v = k0.clone(), v0.clone()
    for src, dst in pairs:
        want_k[:, dst], want_v[:, dst] = k0[:, src], v0[:, src]
    assert torch.equal(cache.k, want_k) and torch.equal(cache.v, want_v)


def test_swap_out_and_in_round_trip() -> None:
    device = _random_cache(10, seed=21)
    k0, v0 = device.k.clone(), device.v.clone()
    host = device.make_host_cache(num_blocks=6)
    assert host.k.shape == (3, 6, 4, 2, HEAD_DIM) and host.k.device.type == "cpu"
    device.swap_out([(5, 0), (2, 1), (7, 4)], host)
    for dev_block, host_block in [(5, 0), (2, 1), (7, 4)]:
        assert torch.equal(host.k[:, host_block], k0[:, dev_block])
        assert torch.equal(host.v[:, host_block], v0[:, dev_block])
    assert not host.k[:, [2, 3, 5]].any()
    device.k.zero_()
    device.v.zero_()
    device.swap_in([(0, 1), (1, 3), (4, 9)], host)
    for dev_block, orig in [(1, 5), (3, 2), (9, 7)]:
        assert torch.equal(device.k[:, dev_block], k0[:, orig])
        assert torch.equal(device.v[:, dev_block], v0[:, orig])
    assert not device.k[:, [0, 2, 4, 5, 6, 7, 8]].any()


def test_block_moves_reject_bad_pairs() -> None:
    cache = _random_cache(4, seed=0)
    with pytest.raises(ValueError, match="out of range"):
        cache.copy_blocks([(0, 4)])
    with pytest.raises(ValueError, match="twice"):
        cache.copy_blocks([(0, 1), (2, 1)])
    with pytest.raises(ValueError, match="differ"):
        cache.swap_out([(0, 0)], PagedKVCache(3, 4, 8, 2, HEAD_DIM, torch.float32))


# ----- through the model -----


def _model_logits(loaded, backend, meta, ids: list[int], positions: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.tensor(positions), backend, meta)
        return loaded.model.compute_logits(hidden)


def test_tiny_model_paged_equals_contiguous(tmp_path) -> None:
    """Two prompts prefill together (the second in two chunks), then decode together for 10 steps."""
    loaded = load_model(write_tiny_model(tmp_path, TinySpec(num_heads=4, num_kv_heads=2)), dtype=torch.float32)
    cfg = loaded.config
    block_size = 4
    paged = PagedKVCache(cfg.num_layers, 16, block_size, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    ref = ContiguousKVCache(cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim, 48, torch.float32)
    tables = [[11, 2, 7, 0, 14, 5, 10], [9, 3, 15, 1, 12, 6, 8, 4]]  # shuffled, 28 and 31 tokens
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB_SIZE, (n,), generator=gen).tolist() for n in (17, 21)]
    lens = [0, 0]

    def step(chunks: list[list[int]]) -> torch.Tensor:
        q_lens = [len(c) for c in chunks]
        meta = PagedAttentionMetadata.build([0, 1], q_lens, lens, tables, block_size)
        ref_meta = AttentionMetadata(seq_ids=(0, 1), query_lens=tuple(q_lens), context_lens=tuple(lens))
        ids = chunks[0] + chunks[1]
        positions = [lens[s] + i for s in (0, 1) for i in range(q_lens[s])]
        got = _model_logits(loaded, paged, meta, ids, positions)
        want = _model_logits(loaded, ref, ref_meta, ids, positions)
        assert want.std() > 1.0
        assert (got - want).abs().max().item() <= 1e-4
        lens[0] += q_lens[0]
        lens[1] += q_lens[1]
        ends = torch.tensor(q_lens).cumsum(0) - 1
        return got[ends].argmax(-1)  # next token of each sequence

    first = step([prompts[0], prompts[1][:9]])  # seq 0's whole prompt, seq 1's first chunk
    nxt = step([[int(first[0])], prompts[1][9:]])  # seq 0's first decode next to seq 1's second chunk
    for _ in range(10):
        nxt = step([[int(nxt[0])], [int(nxt[1])]])
    assert lens == [17 + 11, 21 + 10]


@pytest.mark.real_model
def test_default_model_batched_greedy_equals_generator(default_model) -> None:
    """Three prompts of different lengths, prefilled in one step and decoded together, token for token."""
    prompts = [
        "The capital of France is",
        "Write a short poem about the sea, the wind and a small boat that sails at night.",
        "List three prime numbers:",
    ]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = [Generator(default_model).generate(p, params).token_ids for p in prompts]

    cfg, tok = default_model.config, default_model.tokenizer
    block_size, num_seqs = 16, len(prompts)
    ids = [tok.encode(p) for p in prompts]
    blocks_per_seq = max(math.ceil((len(i) + 16) / block_size) for i in ids)
    # Interleaved blocks: sequence s owns s, s + 3, s + 6, ... (distinct, never contiguous).
    tables = [[s + num_seqs * j for j in range(blocks_per_seq)] for s in range(num_seqs)]
    cache = PagedKVCache(
        cfg.num_layers, num_seqs * blocks_per_seq, block_size, cfg.num_kv_heads, cfg.head_dim, default_model.dtype
    )
    seqs = list(range(num_seqs))
    meta = PagedAttentionMetadata.build(seqs, [len(i) for i in ids], [0] * num_seqs, tables, block_size)
    positions = [p for i in ids for p in range(len(i))]
    logits = _model_logits(default_model, cache, meta, [t for i in ids for t in i], positions)
    got = [[int(t)] for t in logits[torch.tensor([len(i) for i in ids]).cumsum(0) - 1].argmax(-1)]
    lens = [len(i) for i in ids]
    for _ in range(15):
        meta = PagedAttentionMetadata.build(seqs, [1] * num_seqs, lens, tables, block_size)
        logits = _model_logits(default_model, cache, meta, [g[-1] for g in got], lens)
        for g, t in zip(got, logits.argmax(-1).tolist(), strict=True):
            g.append(t)
        lens = [n + 1 for n in lens]
    assert got == want


WINDOW_STEPS = [
    [(0, 13), (1, 7), (2, 1)],  # fresh prefills longer and shorter than the windows
    [(0, 1), (1, 9), (2, 17)],  # decode past the window, chunked prefills crossing it
    [(3, 23), (0, 1), (1, 1), (2, 1)],  # a fresh prompt several windows long beside decodes
    [(0, 6), (3, 1), (1, 1)],
    [(0, 1), (1, 1), (2, 1), (3, 1)],
    [(0, 1), (1, 1), (2, 1), (3, 1)],
]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(
    ("windows", "release"),
    [((5, None), False), ((3, 7), False), ((3, 7), True)],  # a global layer sees every block: none is released
    ids=["window-and-global", "two-windows", "two-windows-released-blocks"],
)
def test_sliding_window_layers_match_contiguous(windows: tuple, release: bool, block_size: int) -> None:
    """Sliding-window layers over the paged cache equal the masked contiguous reference, in decodes,
    fresh and chunked prefills; and blocks wholly outside every window are never read."""
    pair = Pair(*HEADS["gqa_6_2"], block_size=block_size, num_seqs=4, max_len=64, windows=windows, release=release)
    for step in WINDOW_STEPS:
        assert pair.step(step) < ATOL


def test_windowed_prefill_in_chunks_matches_one_masked_call() -> None:
    """A prompt many windows long is attended chunk by chunk; the result is the full masked attention."""
    from kvserve.attention.masks import causal_mask
    from kvserve.attention.paged import attend_prefill

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(70 + 30 * (i > 0), h, HEAD_DIM, generator=gen) for i, h in enumerate((6, 2, 2)))
    got = attend_prefill(q, k, v, ctx_len=30, window=9)
    mask = causal_mask(70, 30, 9)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True
    )[0].transpose(0, 1)
    assert (got - want).abs().max().item() < ATOL
