"""InfiniGen on the real default model (SmolLM2-135M-Instruct, float32): its skewing (computed once into a
temporary folder) leaves attention scores unchanged, offloading with every row selected generates the
device engine's tokens on a prose prompt, and the default settings (alpha "auto": calibrated per layer) fetch
fewer rows past layer 0, and without kv_offload (sparse decode) read the rows the offloaded one fetches."""

from __future__ import annotations

import pytest
import torch

from kvserve.attention.backend import AttentionMetadata
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.eval.data import AUSTEN
from kvserve.models import LoadedModel
from kvserve.policies.skewing import SKEWING_DIR_ENV, Skewing, _Recorder, skewing_for
from kvserve.sampling.sampling_params import SamplingParams
from tests.tiny_models import torch_single_thread  # noqa: F401 - autouse: one thread copes with a busy CPU

pytestmark = pytest.mark.real_model

OPTIONS = dict(dtype="float32", kv_cache_memory="64MiB", swap_space=0)


@pytest.fixture(scope="module")
def skewing(default_model, tmp_path_factory) -> Skewing:
    """The model's skewing, computed once into a temporary folder that this module's engines read."""
    folder = tmp_path_factory.mktemp("skewing")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SKEWING_DIR_ENV, str(folder))
        skewing, file = skewing_for(default_model)
        assert file.parent == folder
        yield skewing


@pytest.fixture(scope="module")
def prose(default_model) -> list[int]:
    """About 300 tokens of Emma from well past the skewing's sample (its first 2,048 tokens)."""
    text = AUSTEN.read_text(encoding="utf-8")[60_000:64_000]
    return default_model.tokenizer.encode(text, add_special_tokens=False)[:300]


def generate(loaded: LoadedModel, prompt: list[int], max_tokens: int, **options) -> tuple[list[int], LLMEngine]:
    engine = LLMEngine(EngineConfig(**OPTIONS, **options), loaded)
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    done = []
    while engine.has_unfinished_requests():
        done.extend(o for o in engine.step() if o.finished)
    engine.close()
    return done[0].outputs[0].token_ids, engine


def test_skewing_keeps_the_real_models_attention_scores(default_model, skewing, prose) -> None:
    cfg = default_model.config
    d, group = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    assert skewing.matrices.shape == (cfg.num_layers, cfg.num_kv_heads, d, d)
    ids = prose[:64]
    recorder = _Recorder(cfg.num_layers, 1, cfg.num_kv_heads, d, len(ids), torch.float32)
    metadata = AttentionMetadata(seq_ids=(0,), query_lens=(len(ids),), context_lens=(0,))
    with torch.inference_mode():
        default_model.model(torch.tensor(ids), torch.arange(len(ids)), recorder, metadata)
    for layer in (0, cfg.num_layers // 2, cfg.num_layers - 1):
        q, k = recorder.queries[layer], recorder.keys[layer]
        for head in range(cfg.num_kv_heads):
            a = skewing.matrices[layer, head]
            torch.testing.assert_close(a.T @ a, torch.eye(d), atol=1e-4, rtol=0)
            heads, keys = q[:, head * group : (head + 1) * group], k[:, head]
            scores = torch.einsum("ngd,md->gnm", heads, keys)
            skewed = torch.einsum("ngd,md->gnm", heads @ a, keys @ a)
            assert float((skewed - scores).abs().max()) < 1e-3 * float(scores.abs().max())


def test_selecting_everything_generates_the_device_engines_tokens(default_model, skewing, prose) -> None:
    everything, engine = generate(
        default_model, prose, 16, kv_offload="host", kv_policy="infinigen", infinigen_partial_ratio=1.0,
        infinigen_alpha=1e9,
    )  # fmt: skip
    assert engine.runner.cache.stats.fetch_fraction() == [1.0] * default_model.config.num_layers
    assert everything == generate(default_model, prose, 16)[0]


def test_default_infinigen_fetches_fewer_rows_past_layer_zero(default_model, skewing, prose) -> None:
    """The default, infinigen_alpha="auto": each layer's alpha calibrated on the sample (its skewing file's)."""
    tokens, engine = generate(default_model, prose, 8, kv_offload="host", kv_policy="infinigen")
    assert len(tokens) == 8
    policy = engine.runner.cache.policy
    assert policy.alpha == skewing.alphas[policy.partial_dims(default_model.config.head_dim)]
    assert len(policy.alpha) == default_model.config.num_layers and len(set(policy.alpha[1:])) > 1  # per layer
    fractions = engine.runner.cache.stats.fetch_fraction()
    assert fractions[0] == 1.0 and all(0 < f <= 1 for f in fractions)
    deeper = fractions[1:]
    assert sum(deeper) / len(deeper) < 1


def test_device_infinigen_reads_what_the_offloaded_one_fetches(default_model, skewing, prose) -> None:
    """Without kv_offload (sparse decode over the paged cache): selecting everything generates the device engine's
    tokens; the default reads, layer by layer, the rows the offloaded InfiniGen fetches, and generates its tokens."""
    everything, engine = generate(default_model, prose, 16, kv_policy="infinigen", infinigen_alpha=1e9)
    stats = engine.runner.cache.stats
    assert stats.read_fraction()[1:] == [1.0] * (default_model.config.num_layers - 1)
    assert everything == generate(default_model, prose, 16)[0]
    tokens, sparse = generate(default_model, prose, 8, kv_policy="infinigen")
    fetched, offloaded = generate(default_model, prose, 8, kv_offload="host", kv_policy="infinigen")
    stats = sparse.runner.cache.stats
    assert stats.selected_rows[1:] == offloaded.runner.cache.stats.fetched_rows[1:]
    assert 0 < sum(stats.selected_rows) < sum(stats.cached_rows)
    assert tokens == fetched
