"""The batch-invariant mode: a row's numbers do not depend on the rows computed beside it.

Kernel by kernel (dense projections in fixed row tiles, int4 projections on one kernel, attention per query
row) and through the engine on a tiny Q4_1 model in bfloat16, native and dequantised: concurrent greedy
requests and a prefix-cache hit give exactly the tokens and logprobs of each prompt run alone. Without the
mode the same checks find differences (the reason for the mode), except where a kernel happens to be
row-invariant already.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from gguf import GGMLQuantizationType

from kvserve.attention import PagedAttentionMetadata, PagedKVCache
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.entrypoints.engine_args import add_engine_args, engine_config_from_args
from kvserve.entrypoints.llm import LLM
from kvserve.models.batch_invariant import make_batch_invariant
from kvserve.models.layers import Linear
from kvserve.models.loader import load_model
from kvserve.models.packed_linear import ROW_TILE
from kvserve.models.quant_linear import Int4Weight, Int8Weight, Q8Linear, QuantLinear, max_rows
from kvserve.sampling.sampler import SampleRow, sample_each
from kvserve.sampling.sampling_params import SamplingParams
from tests.test_gguf_loader import checkpoint, write_gguf
from tests.test_quant_linear import blocks_of
from tests.tiny_models import TinySpec, torch_single_thread  # noqa: F401 - autouse fixture

ROW_COUNTS = [1, 2, 3, 4, ROW_TILE - 1, ROW_TILE, ROW_TILE + 1, 14, 33]


def rows_alone(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([module(x[i : i + 1]) for i in range(x.shape[0])])


def assert_row_invariant(module: torch.nn.Module, x: torch.Tensor) -> None:
    alone = rows_alone(module, x)
    for rows in ROW_COUNTS:
        assert torch.equal(module(x[:rows]), alone[:rows]), f"{rows} rows"


# ----- projections -----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(96, 1536), (576, 64)], ids=str)
def test_dense_projection_in_row_tiles_gives_each_row_its_own_result(dtype, shape) -> None:
    out_features, in_features = shape
    linear = Linear(in_features, out_features, bias=True)
    linear.weight.data = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) / 24).to(dtype)
    linear.bias.data = torch.randn(out_features).to(dtype)
    linear.requires_grad_(False).prepack()  # bfloat16: oneDNN's packed weight, as the loader leaves it
    x = torch.randn(max(ROW_COUNTS), in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    plain = linear(x)
    linear.row_tile = ROW_TILE
    assert_row_invariant(linear, x)
    torch.testing.assert_close(linear(x), plain)  # the same projection, only its sums ordered otherwise
    assert linear(x[:5].view(5, 1, in_features)).shape == (5, 1, out_features)


def int4_linear(dense: bool, dtype: torch.dtype = torch.bfloat16) -> QuantLinear:
    blocks, w = blocks_of((48, 64), GGMLQuantizationType.Q4_1)
    weight = Int4Weight.from_ggml_blocks(blocks, GGMLQuantizationType.Q4_1)
    bias = torch.randn(48, generator=torch.Generator().manual_seed(4))
    return QuantLinear(weight, dtype, bias, dense=w if dense else None).requires_grad_(False)


class _Holder(torch.nn.Module):
    """Stands in for a model: make_batch_invariant walks ``modules()`` and sets the head's row tile."""

    def __init__(self, *modules: torch.nn.Module) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(modules)
        self.head_row_tile = 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)  # torch's int4 kernel, kvserve's
def test_int4_projections_take_one_kernel_for_every_row_count(dtype) -> None:
    head_blocks, _ = blocks_of((40, 64), GGMLQuantizationType.Q8_0)
    head = Q8Linear(Int8Weight.from_q8_0_blocks(head_blocks), dtype, dense=torch.randn(40, 64).to(dtype))
    quant = int4_linear(dense=True, dtype=dtype)
    x = torch.randn(max(ROW_COUNTS), 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    # The default: the codes for up to max_rows rows, the dense copy above, so a row changes with its batch.
    above = max_rows(dtype) + 1
    assert above <= x.shape[0] and not torch.equal(quant(x[:above])[:1], quant(x[:1]))
    holder = _Holder(quant, head)
    make_batch_invariant(holder)
    assert quant.dense is None and quant.dense_packed is None and head.dense is None
    assert holder.head_row_tile == ROW_TILE
    assert_row_invariant(quant, x)
    assert_row_invariant(head, x)
    assert torch.equal(quant(x), int4_linear(dense=False, dtype=dtype)(x))  # exactly the int4 kernel


# ----- attention -----

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 16, 4


class Schedule:
    """Runs steps of (sequence, new tokens) over a fresh paged cache, layer 0, with fixed per-position q/k/v;
    collects each position's attention output."""

    def __init__(self, lengths: list[int], batch_invariant: bool, window: int | None = None) -> None:
        gen = torch.Generator().manual_seed(5)
        self.q = [torch.randn(n, HEADS, HEAD_DIM, generator=gen).bfloat16() for n in lengths]
        self.k = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).bfloat16() for n in lengths]
        self.v = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).bfloat16() for n in lengths]
        blocks = [math.ceil(n / BLOCK) for n in lengths]
        ids = list(range(1, sum(blocks) + 1))
        random.Random(0).shuffle(ids)  # no sequence's blocks are consecutive
        self.tables = [[ids.pop() for _ in range(b)] for b in blocks]
        self.cache = PagedKVCache(1, sum(blocks) + 1, BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16,
                                  batch_invariant=batch_invariant)  # fmt: skip
        self.window, self.done = window, [0] * len(lengths)
        self.out: dict[tuple[int, int], torch.Tensor] = {}

    def step(self, work: list[tuple[int, int]]) -> None:
        ctx = [self.done[s] for s, _ in work]
        meta = PagedAttentionMetadata.build(
            [s for s, _ in work], [n for _, n in work], ctx, [self.tables[s] for s, _ in work], BLOCK
        )
        if self.window is not None:
            meta = PagedAttentionMetadata(**{**meta.__dict__, "layer_windows": (self.window,)})
        part = [slice(c, c + n) for c, (_, n) in zip(ctx, work, strict=True)]
        q, k, v = ([t[s][p] for (s, _), p in zip(work, part, strict=True)] for t in (self.q, self.k, self.v))
        out = self.cache.forward(0, torch.cat(q), torch.cat(k), torch.cat(v), meta)
        row = 0
        for (s, n), c in zip(work, ctx, strict=True):
            for i in range(n):
                self.out[(s, c + i)] = out[row + i]
            row += n
            self.done[s] += n


def run_schedules(batch_invariant: bool, window: int | None) -> list[dict[tuple[int, int], torch.Tensor]]:
    """Sequence 0 (23 tokens) computed four ways: one prefill alone; chunks of 9, 1 and 13 beside other
    sequences; a 5-token prefill then decodes beside a long prefill and other decodes; token by token alone."""
    lengths = [23, 37, 6, 18]
    runs = []
    alone = Schedule(lengths, batch_invariant, window)
    alone.step([(0, 23)])
    runs.append(alone.out)
    chunked = Schedule(lengths, batch_invariant, window)
    for work in ([(1, 30), (0, 9)], [(0, 1), (2, 6), (1, 7)], [(3, 18), (0, 13)]):
        chunked.step(work)
    runs.append(chunked.out)
    decodes = Schedule(lengths, batch_invariant, window)
    decodes.step([(0, 5), (2, 3)])
    decodes.step([(1, 37), (0, 1), (2, 1)])
    for _ in range(17):
        decodes.step([(0, 1), (3, 1)])
    runs.append(decodes.out)
    token_by_token = Schedule(lengths, batch_invariant, window)
    for _ in range(23):
        token_by_token.step([(0, 1)])
    runs.append(token_by_token.out)
    return runs


def reference(schedule: Schedule, seq: int, window: int | None) -> torch.Tensor:
    """float64 causal attention of one sequence (23, H, D)."""
    q, k, v = (t[seq].double() for t in (schedule.q, schedule.k, schedule.v))
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
    pos = torch.arange(q.shape[0])
    visible = pos[None, :] <= pos[:, None]
    if window is not None:
        visible &= pos[None, :] > pos[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("window", [None, 6], ids=["full", "window6"])
def test_attention_per_query_row_is_the_same_in_every_schedule(window) -> None:
    runs = run_schedules(True, window)
    first = torch.stack([runs[0][(0, p)] for p in range(23)])
    for run in runs[1:]:
        assert torch.equal(torch.stack([run[(0, p)] for p in range(23)]), first)
    expected = reference(Schedule([23, 37, 6, 18], True), 0, window)
    assert (first.double() - expected).abs().max() < 0.02  # bfloat16 rounding of the output


def test_attention_without_the_mode_depends_on_the_schedule() -> None:
    runs = run_schedules(False, None)
    outputs = [torch.stack([run[(0, p)] for p in range(23)]) for run in runs]
    assert any(not torch.equal(out, outputs[0]) for out in outputs[1:])


# ----- sampler -----


def test_sampling_each_row_alone_gives_a_row_its_own_logprobs() -> None:
    logits = torch.randn(5, 70_000, generator=torch.Generator().manual_seed(3)) * 4
    rows = [SampleRow(SamplingParams(temperature=0, logprobs=2), None) for _ in range(5)]
    batch = sample_each(logits, rows)
    for i in range(5):
        assert sample_each(logits[i : i + 1], rows[i : i + 1]) == [batch[i]]


# ----- the engine on a tiny Q4_1 model -----

SPEC = TinySpec(num_heads=4, num_kv_heads=2, max_position_embeddings=512, seed=11)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch-invariant")
    _, state = checkpoint(tmp, SPEC)
    path = tmp / "tiny-q4_1.gguf"
    write_gguf(path, SPEC, state, qtype=GGMLQuantizationType.Q4_1)
    return path


def tiny_llm(path, loaded, **options) -> LLM:
    config = EngineConfig(model=str(path), dtype="bfloat16", weights=loaded.weights, kv_cache_memory="8MiB",
                          swap_space=0, block_size=8, **options)  # fmt: skip
    return LLM.from_engine(LLMEngine(config, loaded))


PROMPTS = [[(7 * i + 3 * j) % 290 + 1 for j in range(5 + 9 * i)] for i in range(8)]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)


def batched_and_alone(path, loaded, batch_invariant: bool) -> tuple[list, list, list, list]:
    """(concurrent, alone, prefix hits, misses) outputs: token ids and logprobs per prompt."""

    def result(outputs) -> list:
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    together = tiny_llm(path, loaded, batch_invariant=batch_invariant, max_num_batched_tokens=24)
    solo = tiny_llm(path, loaded, batch_invariant=batch_invariant, enable_prefix_caching=False)
    concurrent = result(together.generate(PROMPTS, GREEDY, use_tqdm=False))
    alone = [result(solo.generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS]
    shared = PROMPTS[-1][:40]  # five blocks of 8, cached by the first request
    extended = [shared + p[: 3 + i] for i, p in enumerate(PROMPTS[:3])]
    together.generate([shared], GREEDY, use_tqdm=False)
    hits = result(together.generate(extended, GREEDY, use_tqdm=False))
    misses = [result(solo.generate([p], GREEDY, use_tqdm=False))[0] for p in extended]
    return concurrent, alone, hits, misses


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["native", "dequant"])
def test_engine_gives_concurrent_and_cached_prompts_the_numbers_they_get_alone(tiny_gguf, weights) -> None:
    loaded = load_model(tiny_gguf, torch.bfloat16, weights=weights, batch_invariant=True)
    assert loaded.batch_invariant and "batch-invariant" in loaded.weights_summary
    concurrent, alone, hits, misses = batched_and_alone(tiny_gguf, loaded, True)
    assert concurrent == alone
    assert hits == misses


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["native", "dequant"])
def test_engine_without_the_mode_gives_other_numbers_in_a_batch(tiny_gguf, weights) -> None:
    loaded = load_model(tiny_gguf, torch.bfloat16, weights=weights)
    concurrent, alone, hits, misses = batched_and_alone(tiny_gguf, loaded, False)
    assert concurrent != alone or hits != misses


# ----- configuration -----


@pytest.mark.parametrize(
    "options, named",
    [({"kv_policy": "pyramid"}, "kv_policy"), ({"kv_offload": "host"}, "kv_offload"),
     ({"prefill_parallel": 2}, "prefill_parallel"), ({"device": "meta"}, "device")],
)  # fmt: skip
def test_mode_refuses_what_it_does_not_cover(options, named) -> None:
    with pytest.raises(ValueError, match=named):
        EngineConfig(batch_invariant=True, **options)


def test_engine_refuses_a_model_loaded_without_the_mode(tiny_gguf) -> None:
    loaded = load_model(tiny_gguf, torch.bfloat16)
    with pytest.raises(ValueError, match="batch_invariant=True"):
        tiny_llm(tiny_gguf, loaded, batch_invariant=True)


def test_flag_reaches_the_engine_config() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    for name, default in (("--model", None), ("--dtype", "auto"), ("--device", "cpu"), ("--weights", "native")):
        parser.add_argument(name, default=default)
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--batch-invariant"])).batch_invariant
    assert not engine_config_from_args(parser.parse_args([])).batch_invariant
