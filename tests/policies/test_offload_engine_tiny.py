"""The offloading engine (kv_offload host/disk) over a tiny random checkpoint in float32: fetch-everything
is token-identical to the paged engine (batched prompts of different lengths, chunked prefill beside
decodes, forks, prefix hits, preemption by recompute); InfiniGen that selects everything is identical to
it and fetches every row, its default and small-alpha settings fetch fewer rows past layer 0, and its
batched fetches generate what InfiniGen written out one sequence at a time does; INT4 moves exactly the
bytes its row format says and generates what attention over 4-bit cached KV does; the KV pool limit
runs every eviction policy past its capacity (fifo keeps exactly the most recent tokens and, selecting
everything, is a sliding window; counter/lru keep the protected newer half) with the right keys in the
tier; a request cannot pick another policy."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvserve.attention.backend import AttentionMetadata
from kvserve.attention.contiguous import ContiguousKVCache
from kvserve.attention.offloaded import OffloadedKVCache, offload_block_bytes
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.models import LoadedModel, load_model
from kvserve.models.layers import RotaryEmbedding
from kvserve.policies import make_policy
from kvserve.policies.infinigen import Rehearsal, partial_logits, speculate
from kvserve.policies.quant import dequantize_int4, quantize_int4
from kvserve.sampling.sampling_params import SamplingParams
from tests.tiny_models import (  # noqa: F401 - autouse fixtures
    TinySpec,
    skewing_in_tmp,
    torch_single_thread,
    write_tiny_model,
)

# head_dim 64: INT4's default group of 64 values per row.
SPEC = TinySpec(num_heads=4, num_kv_heads=2, num_layers=4, head_dim=64, max_position_embeddings=512, seed=5)
BLOCK = 4
LENGTHS = (30, 57, 9, 2)  # decode batches pad the shorter sequences' candidates
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> LoadedModel:
    return load_model(write_tiny_model(tmp_path_factory.mktemp("offload"), SPEC), dtype=torch.float32)


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 290, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [prompt_ids(n, seed=n) for n in LENGTHS]


def make_engine(loaded: LoadedModel, num_blocks: int | None = None, **options) -> LLMEngine:
    """An engine of ``num_blocks`` blocks of 4 tokens (None: plenty)."""
    memory: str | int = "4MiB"
    if num_blocks is not None:
        cfg = loaded.config
        policy = make_policy(options.get("kv_policy", "full"))
        size = offload_block_bytes(policy, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, BLOCK)
        memory = num_blocks * size + size - 1
    config = EngineConfig(
        model=str(loaded.path), dtype="float32", block_size=BLOCK, kv_cache_memory=memory, swap_space=0, **options
    )
    engine = LLMEngine(config, loaded)
    if num_blocks is not None:
        assert engine.kv.pool.num_blocks == num_blocks
    return engine


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def run(engine: LLMEngine, prompts, params) -> list:
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [done[i] for i in ids]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def paged_tokens(loaded) -> list[list[int]]:
    engine = make_engine(loaded)
    out = tokens(run(engine, PROMPTS, greedy()))
    engine.close()
    return out


def offloaded(loaded, prompts=PROMPTS, params=None, **options) -> tuple[list, OffloadedKVCache]:
    """Outputs of an offloading engine (host tier unless said) and its cache, closed."""
    engine = make_engine(loaded, **{"kv_offload": "host", **options})
    cache = engine.runner.cache
    assert isinstance(cache, OffloadedKVCache)
    outputs = run(engine, prompts, params or greedy())
    engine.close()
    return outputs, cache


def row_bytes(loaded: LoadedModel, int4: bool = False) -> int:
    """One token's K and V in one layer, every KV head, as the tier stores them (float32 model)."""
    cfg = loaded.config
    if int4:  # 4-bit codes two per byte, and a (scale, minimum) float32 pair per group of 64
        return 2 * cfg.num_kv_heads * (cfg.head_dim // 2 + cfg.head_dim // 64 * 2 * 4)
    return 2 * cfg.num_kv_heads * cfg.head_dim * 4


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_full_offload_matches_the_paged_engine(loaded, paged_tokens, tier, tmp_path: Path) -> None:
    options = {"kv_offload_path": str(tmp_path)} if tier == "disk" else {}
    engine = make_engine(loaded, kv_offload=tier, **options)
    cache = engine.runner.cache
    assert cache.tier.kind == tier
    if tier == "disk":
        assert list(tmp_path.iterdir()) == []  # the mapped file is unlinked at once
    assert tokens(run(engine, PROMPTS, greedy())) == paged_tokens
    engine.close()
    # Every token that ran through the model was stored once per layer (the last sampled one never runs).
    stored = sum(n + MAX_TOKENS - 1 for n in LENGTHS)
    assert cache.queue.stats.bytes_stored == stored * loaded.config.num_layers * row_bytes(loaded)
    assert cache.stats.fetch_fraction() == [1.0] * loaded.config.num_layers
    assert cache.stats.decode_steps == MAX_TOKENS - 1
    assert engine.kv_usage().used_blocks == 0


@pytest.mark.parametrize(
    "options",
    [{}, {"kv_policy": "infinigen", "infinigen_partial_ratio": 1.0, "infinigen_alpha": 1e9}],
    ids=["full", "infinigen-everything"],
)
def test_chunked_prefill_beside_decodes_matches_the_paged_engine(loaded, paged_tokens, options) -> None:
    """Prompts in chunks of at most 16 tokens, in steps that also decode other sequences."""
    engine = make_engine(loaded, kv_offload="host", max_num_batched_tokens=16, **options)
    steps = []
    schedule = engine.scheduler.schedule

    def spy():  # noqa: ANN202 - SchedulerOutput
        out = schedule()
        steps.append(sorted(len(s.token_ids) for s in out.scheduled))
        return out

    engine.scheduler.schedule = spy
    assert tokens(run(engine, PROMPTS, greedy())) == paged_tokens
    engine.close()
    assert any(lengths[0] == 1 and lengths[-1] > 1 for lengths in steps)  # a decode beside a chunk
    assert any(lengths[-1] > 1 and len(lengths) > 1 for lengths in steps)


def test_infinigen_selecting_everything_is_the_full_offload(loaded, paged_tokens) -> None:
    outputs, cache = offloaded(loaded, kv_policy="infinigen", infinigen_partial_ratio=1.0, infinigen_alpha=1e9)
    assert tokens(outputs) == paged_tokens
    assert cache.stats.fetch_fraction() == [1.0] * loaded.config.num_layers
    assert cache.rehearsal.partial_dims == loaded.config.head_dim


def test_infinigen_fetches_fewer_rows_past_layer_zero(loaded) -> None:
    full_outputs, full = offloaded(loaded)
    outputs, cache = offloaded(loaded, kv_policy="infinigen")
    fractions = cache.stats.fetch_fraction()
    assert fractions[0] == 1.0  # layer 0 has no rehearsal: it reads its whole cache
    assert all(0 < f <= 1 for f in fractions)
    assert cache.rehearsal.partial_dims == math.ceil(0.3 * loaded.config.head_dim)
    assert cache.queue.stats.bytes_fetched < full.queue.stats.bytes_fetched
    assert cache.queue.stats.bytes_stored == full.queue.stats.bytes_stored  # the whole KV still goes down
    assert [len(t) for t in tokens(outputs)] == [MAX_TOKENS] * len(PROMPTS)
    assert [t[0] for t in tokens(outputs)] == [t[0] for t in tokens(full_outputs)]  # the prefill reads no tier


def test_infinigen_small_alpha_fetches_a_fraction(loaded) -> None:
    _, cache = offloaded(loaded, kv_policy="infinigen", infinigen_alpha=0.5)
    fractions = cache.stats.fetch_fraction()
    assert fractions[0] == 1.0
    assert all(0 < f < 1 for f in fractions[1:]), fractions
    # Every selected row of a decode step moves once per KV head (plus one spare row for the step's own KV).
    fetched_rows = sum(cache.stats.fetched_rows[1:])
    layer0_bytes = cache.stats.cached_rows[0] * row_bytes(loaded)  # at least: whole blocks, padding included
    assert cache.queue.stats.bytes_fetched >= layer0_bytes + fetched_rows * row_bytes(loaded)


class FakeQuantKV(ContiguousKVCache):
    """The INT4 reference: each row attends over the cached keys/values as 4-bit codes give them back and
    over its step's own rows unquantised, then is cached quantised (one sequence)."""

    def forward(self, layer, q, k, v, metadata) -> torch.Tensor:  # noqa: ANN001 - ContiguousKVCache's
        ctx, n = metadata.context_lens[0], q.shape[0]
        keys = torch.cat((self.k[layer, 0, :, :ctx], k.transpose(0, 1)), dim=1)  # (Hkv, ctx + n, D)
        values = torch.cat((self.v[layer, 0, :, :ctx], v.transpose(0, 1)), dim=1)
        out = self._attend(q, keys, values, ctx)
        for cache, rows in ((self.k, k), (self.v, v)):
            cache[layer, 0, :, ctx : ctx + n] = dequantize_int4(*quantize_int4(rows, 64), rows.dtype).transpose(0, 1)
        return out


class SlidingWindowKV(ContiguousKVCache):
    """Each row attends to itself and the ``window`` tokens before it (one sequence)."""

    window = 0

    def forward(self, layer, q, k, v, metadata) -> torch.Tensor:  # noqa: ANN001 - ContiguousKVCache's
        ctx, n = metadata.context_lens[0], q.shape[0]
        self.k[layer, 0, :, ctx : ctx + n], self.v[layer, 0, :, ctx : ctx + n] = k.transpose(0, 1), v.transpose(0, 1)
        rows = torch.arange(ctx, ctx + n)[:, None]
        columns = torch.arange(ctx + n)[None, :]
        mask = (columns <= rows) & (columns >= rows - self.window)
        keys, values = self.k[layer, 0, :, : ctx + n], self.v[layer, 0, :, : ctx + n]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, enable_gqa=True
        )
        return out[0].transpose(0, 1)


class InfiniGenReference(ContiguousKVCache):
    """InfiniGen written out for one sequence: a prompt attends causally; a decode row at layer i >= 1
    attends to itself and, per KV head, the top ``count`` cached rows by the speculated logits of layer i's
    partial query (from layer i - 1's input; layer 1 and window layers: from its own query) against the cached
    partial keys (a window layer, layer 0 included: those of its window)."""

    rehearsal: Rehearsal
    alpha = 0.0

    def observe_input(self, layer, x, rope, metadata) -> None:  # noqa: ANN001 - AttentionBackend's
        if layer == 0:
            self.partial_q = {}
        if 1 < layer + 1 < len(self.rehearsal.weights) and metadata.window_of(layer + 1) is None:
            self.partial_q[layer + 1] = self.rehearsal.partial_query(layer + 1, x, rope)  # (n, Hkv, G, r)

    def forward(self, layer, q, k, v, metadata) -> torch.Tensor:  # noqa: ANN001 - ContiguousKVCache's
        ctx, n = metadata.context_lens[0], q.shape[0]
        # Layer 0's input is the token embedding: layer 1 speculates with its own query, as window layers do.
        window = metadata.window_of(layer)
        if layer == 1 or window is not None:
            d = q.shape[-1]
            grouped = q.view(n, self.rehearsal.num_kv_heads, -1, d)  # (n, Hkv, G, D)
            self.partial_q[layer] = torch.einsum("nhgd,hdr->nhgr", grouped, self.rehearsal.skew[layer])
        if layer == 0 and ctx == 0:  # a new sequence
            self.partial_k = {}
        new_partial = self.rehearsal.partial_key(layer, k).transpose(0, 1)  # (Hkv, n, r)
        cached_partial = self.partial_k.get(layer)
        self.partial_k[layer] = new_partial if cached_partial is None else torch.cat((cached_partial, new_partial), 1)
        if n > 1 or (layer == 0 and window is None):  # a full-attention layer 0 reads everything
            return super().forward(layer, q, k, v, metadata)
        partial_q = self.partial_q[layer][0]  # (Hkv, G, r) of the one decode row
        first = max(0, ctx + 1 - window) if window else 0  # a window layer selects among its window's rows
        logits = partial_logits(partial_q, cached_partial[:, first:], self.rehearsal.head_dim)  # (Hkv, G, ctx - first)
        selection = speculate(logits[None], None, self.alpha)
        count = int(selection.counts[0])
        allowed = torch.zeros(q.shape[1] // self.rehearsal.group, ctx + 1, dtype=torch.bool)
        allowed.scatter_(1, first + selection.index[0, :, :count], True)
        allowed[:, ctx] = True
        self.k[layer, 0, :, ctx], self.v[layer, 0, :, ctx] = k[0], v[0]
        keys, values = self.k[layer, 0, :, : ctx + 1], self.v[layer, 0, :, : ctx + 1]  # (Hkv, ctx + 1, D)
        qg = q[0].view(keys.shape[0], -1, 1, q.shape[-1])  # (Hkv, G, 1, D)
        out = F.scaled_dot_product_attention(qg, keys[:, None], values[:, None], attn_mask=allowed[:, None, None])
        return out.reshape(1, q.shape[1], q.shape[2])


@torch.inference_mode()
def greedy_reference(
    loaded: LoadedModel, cache: ContiguousKVCache, prompt: list[int], max_tokens: int, first: int | None = None
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each step's log-probabilities of one sequence over ``cache``: the prompt's
    ``first`` tokens (all by default) in one step, the rest of it one token a step, then one token a step."""
    out, logprobs = [], []
    step, ctx = prompt[: len(prompt) if first is None else first], 0
    while len(out) < max_tokens:
        meta = AttentionMetadata(
            seq_ids=(0,), query_lens=(len(step),), context_lens=(ctx,), layer_windows=loaded.config.layer_windows
        )
        hidden = loaded.model(torch.tensor(step), torch.arange(ctx, ctx + len(step)), cache, meta)
        ctx += len(step)
        if ctx < len(prompt):  # the rest of the prompt: no token sampled yet
            step = [prompt[ctx]]
            continue
        logprobs.append(torch.log_softmax(loaded.model.compute_logits(hidden[-1:])[0], dim=-1))
        out.append(int(logprobs[-1].argmax()))
        step = [out[-1]]
    return out, logprobs


def reference_cache(loaded: LoadedModel, cache_type: type[ContiguousKVCache], length: int) -> ContiguousKVCache:
    cfg = loaded.config
    return cache_type(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, length, torch.float32)


def test_infinigen_generates_what_the_written_out_selection_does(loaded) -> None:
    """Batched, padded decode steps gather each KV head's selected rows from the tier: the same tokens as
    InfiniGen computed one sequence at a time over a contiguous cache."""
    outputs, cache = offloaded(loaded, kv_policy="infinigen", infinigen_alpha=0.5)
    assert all(f < 0.5 for f in cache.stats.fetch_fraction()[1:])  # selective enough to matter
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        reference = reference_cache(loaded, InfiniGenReference, len(prompt) + MAX_TOKENS)
        reference.rehearsal, reference.alpha = cache.rehearsal, 0.5
        assert out.outputs[0].token_ids == greedy_reference(loaded, reference, prompt, MAX_TOKENS)[0]


def _chunked_infinigen(loaded, params: SamplingParams) -> tuple:
    """A 40-token prompt in chunks of 16 under InfiniGen at alpha 0.5: (output, chunk sizes, cache)."""
    engine = make_engine(
        loaded, kv_offload="host", kv_policy="infinigen", infinigen_alpha=0.5, max_num_batched_tokens=16
    )
    chunks = []
    build = engine.runner.cache.build_metadata

    def spy(out, rows_from):
        metadata = build(out, rows_from)
        chunks.append(metadata.query_lens[0])
        return metadata

    engine.runner.cache.build_metadata = spy
    (out,) = run(engine, [prompt_ids(40, seed=9)], params)
    engine.close()
    return out, chunks, engine.runner.cache


def _reference(loaded, cache) -> ContiguousKVCache:
    reference = reference_cache(loaded, InfiniGenReference, 40 + MAX_TOKENS)
    reference.rehearsal, reference.alpha = cache.rehearsal, 0.5
    return reference


def test_infinigen_chunked_prompt_attends_to_everything_like_a_whole_prefill(loaded) -> None:
    """A plain prompt in chunks of 16: every prompt row reads all rows before it (InfiniGen speculates for
    decoding), so the tokens are those of the whole prompt in one step, then selective decoding."""
    out, chunks, cache = _chunked_infinigen(loaded, greedy())
    assert chunks[:3] == [16, 16, 8]
    assert 0 < cache.stats.fetch_fraction()[1] < 0.5  # decoding did select
    prompt = prompt_ids(40, seed=9)
    assert out.outputs[0].token_ids == greedy_reference(loaded, _reference(loaded, cache), prompt, MAX_TOKENS)[0]


def test_infinigen_scored_chunks_select_as_decoding_one_by_one(loaded) -> None:
    """With prompt logprobs (how the eval tools score), past the first chunk each row attends to what its
    own rehearsal selects among the rows before it, as if it were decoded alone."""
    out, chunks, cache = _chunked_infinigen(loaded, greedy(prompt_logprobs=1))
    assert chunks[:3] == [16, 16, 8]
    prompt = prompt_ids(40, seed=9)
    reference = _reference(loaded, cache)
    assert out.outputs[0].token_ids == greedy_reference(loaded, reference, prompt, MAX_TOKENS, first=16)[0]
    # Not what one whole-prompt step gives: the chunks' rows did select.
    whole = _reference(loaded, cache)
    assert out.outputs[0].token_ids != greedy_reference(loaded, whole, prompt, MAX_TOKENS)[0]


def test_int4_moves_the_bytes_of_its_row_format(loaded) -> None:
    cfg = loaded.config
    _, full = offloaded(loaded)
    outputs, cache = offloaded(loaded, kv_policy="int4", params=greedy(logprobs=3))
    full_block, int4_block = (
        offload_block_bytes(make_policy(name), cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, BLOCK)
        for name in ("full", "int4")
    )
    assert full_block == row_bytes(loaded) * cfg.num_layers * BLOCK
    assert int4_block == row_bytes(loaded, int4=True) * cfg.num_layers * BLOCK
    # The same rows move (whole blocks each step), each in fewer bytes: 256 -> 40 per KV head here.
    assert full.queue.stats.bytes_fetched * int4_block == cache.queue.stats.bytes_fetched * full_block
    assert full.queue.stats.bytes_stored * int4_block == cache.queue.stats.bytes_stored * full_block
    assert cache.tier.arrays["k"].dtype == torch.uint8 and cache.tier.arrays["k"].shape[-1] == cfg.head_dim // 2
    # What it generates: exactly what attention over 4-bit cached keys/values gives.
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        cache = reference_cache(loaded, FakeQuantKV, len(prompt) + MAX_TOKENS)
        expected, logprobs = greedy_reference(loaded, cache, prompt, MAX_TOKENS)
        assert out.outputs[0].token_ids == expected
        for reference, top in zip(logprobs, out.outputs[0].logprobs, strict=True):
            for token, logprob in top.items():
                assert logprob == pytest.approx(float(reference[token]), abs=1e-4)


def reference_layer0_keys(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Layer 0's rotated keys (n, Hkv, D) of ``ids``: they depend on nothing but each token and its position."""
    model, cfg = loaded.model, loaded.config
    with torch.inference_mode():
        x = model.embed_tokens(torch.tensor(ids))
        qkv = model.layers[0].self_attn.qkv_proj(model.layers[0].input_layernorm(x))
        k = qkv[:, cfg.q_size : cfg.q_size + cfg.num_kv_heads * cfg.head_dim].view(len(ids), cfg.num_kv_heads, -1)
        return RotaryEmbedding.apply(k, model.rotary.table(torch.arange(len(ids)), torch.float32))


def pool_run(loaded, eviction: str, prompt: list[int], max_tokens: int):
    """One request under kv_pool_limit=0.5: its outputs, the cache, and its block table."""
    engine = make_engine(loaded, kv_offload="host", kv_policy="infinigen", kv_pool_limit=0.5, kv_pool_eviction=eviction)
    cache = engine.runner.cache
    tables = []
    build = cache.build_metadata

    def spy(out, rows_from):
        metadata = build(out, rows_from)
        tables.append(metadata.block_tables[0])
        return metadata

    cache.build_metadata = spy
    (out,) = run(engine, [prompt], greedy(max_tokens))
    engine.close()
    return out, cache, tables[-1]


def test_pool_limit_keeps_each_eviction_policys_victims(loaded) -> None:
    cfg = loaded.config
    prompt, max_tokens = prompt_ids(40, seed=3), 12
    cap = math.ceil(0.5 * (len(prompt) + max_tokens))  # 26: the prompt alone overflows the pool
    assert len(prompt) > cap
    runs = {eviction: pool_run(loaded, eviction, prompt, max_tokens) for eviction in ("fifo", "counter", "lru")}
    stamps = {}
    for eviction, (out, cache, table) in runs.items():
        completion = out.outputs[0]
        assert len(completion.token_ids) == max_tokens and completion.finish_reason == "length"
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cap)])  # the pool's slots
        inserted = cache.speculation.pool[2][:, slots]  # (L, cap, Hkv): the token each slot holds, per layer, head
        stamps[eviction] = inserted
        stored = len(prompt) + max_tokens - 1  # tokens 0..stored-1 went through the model
        recent = list(range(stored - cap, stored))
        protected = set(range(stored - 1 - (cap - cap // 2), stored))  # never in the older half when evicting
        for layer in range(cfg.num_layers):
            for head in range(cfg.num_kv_heads):
                held = sorted(inserted[layer, :, head].tolist())
                assert len(set(held)) == cap and 0 <= held[0] and held[-1] == stored - 1
                if eviction == "fifo" or layer == 0:  # layer 0 is never selected: counts and recency are age
                    assert held == recent, (eviction, layer, head)
                else:
                    assert protected <= set(held), (eviction, layer, head)
        # The tier holds, at each slot, the key of the token stamped there (layer 0 keys need no attention).
        ids = prompt + completion.token_ids[:-1]
        keys = reference_layer0_keys(loaded, ids)
        for head in range(cfg.num_kv_heads):
            expected = keys[inserted[0, :, head].long(), head]
            torch.testing.assert_close(cache.tier.arrays["k"][0, slots, head], expected, atol=1e-5, rtol=1e-5)
    assert not torch.equal(stamps["fifo"][1:], stamps["counter"][1:])  # selection counts changed some victim
    assert not torch.equal(stamps["fifo"][1:], stamps["lru"][1:])


def test_fifo_pool_selecting_everything_is_a_sliding_window(loaded) -> None:
    """With every pooled row selected, a fifo pool of ``cap`` slots lets each token attend to itself and the
    ``cap`` tokens before it: prompts past the pool and decode batches of sequences with different caps
    generate what sliding-window attention does."""
    prompts = [prompt_ids(n, seed=50 + n) for n in (40, 17, 3)]
    outputs, _ = offloaded(
        loaded, prompts, kv_policy="infinigen", infinigen_alpha=1e9, infinigen_partial_ratio=1.0,
        kv_pool_limit=0.5, kv_pool_eviction="fifo",
    )  # fmt: skip
    for prompt, out in zip(prompts, outputs, strict=True):
        cache = reference_cache(loaded, SlidingWindowKV, len(prompt) + MAX_TOKENS)
        cache.window = math.ceil(0.5 * (len(prompt) + MAX_TOKENS))
        assert out.outputs[0].token_ids == greedy_reference(loaded, cache, prompt, MAX_TOKENS)[0]
    # The window is no full cache: the longest prompt's tokens differ from an unlimited pool's.
    unlimited = tokens(offloaded(loaded, prompts[:1])[0])
    assert outputs[0].outputs[0].token_ids != unlimited[0]


def test_a_request_cannot_pick_another_policy(loaded) -> None:
    engine = make_engine(loaded, kv_offload="host", kv_policy="infinigen")
    with pytest.raises(ValueError) as error:
        engine.add_request(PROMPTS[0], greedy(kv_policy="h2o"))
    assert "kv_policy='infinigen'" in str(error.value) and "kv_policy='h2o'" in str(error.value)
    assert not engine.has_unfinished_requests()
    (out,) = run(engine, [PROMPTS[2]], greedy(4))
    assert len(out.outputs[0].token_ids) == 4
    engine.close()


@pytest.mark.parametrize(
    "options",
    [{}, {"kv_policy": "infinigen", "infinigen_partial_ratio": 1.0, "infinigen_alpha": 1e9}],
    ids=["full", "infinigen-everything"],
)
def test_preemption_by_recompute_keeps_the_tokens(loaded, options) -> None:
    prompts = [prompt_ids(n, seed=100 + n) for n in (9, 5, 23, 2)]
    params = greedy(16)
    roomy = tokens(run(make_engine(loaded), prompts, params))
    # 10 blocks hold 40 tokens: the 23-token prompt plus 16 outputs fits alone, not beside the others.
    engine = make_engine(loaded, num_blocks=10, kv_offload="host", **options)
    assert tokens(run(engine, prompts, params)) == roomy
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_usage().used_blocks == 0
    engine.close()


def test_forks_and_prefix_hits_read_the_right_rows(loaded) -> None:
    """n=2 samples share their prompt's blocks and copy the partial one on write; a repeated prompt
    reuses cached blocks in the tier: the same outputs as the paged engine."""
    params = [SamplingParams(n=2, seed=7 + i, max_tokens=8, ignore_eos=True) for i in range(2)]
    prompts = PROMPTS[:2]
    paged = run(make_engine(loaded), prompts, params)
    engine = make_engine(loaded, kv_offload="host")
    forked = run(engine, prompts, params)
    for a, b in zip(paged, forked, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    again = run(engine, [PROMPTS[1]], greedy())
    assert again[0].num_cached_tokens > 0
    assert tokens(again) == tokens(run(make_engine(loaded), [PROMPTS[1]], greedy()))
    engine.close()
