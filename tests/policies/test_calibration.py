"""InfiniGen's calibrated threshold (``infinigen_alpha="auto"``): a row's alpha is the smallest whose selection
keeps the target attention mass (hand-made and random logits), a layer's the smallest that does so for the target
share of rows; on a tiny model the calibration is deterministic and reaches its target on the sample (on a
sliding-window model, window layers their own target in their window); the skewing
file stores it (an older file is recomputed, a tensor-parallel rank told to run the setup); "auto" resolves to
per-layer alphas that drive which rows each layer fetches, a number overrides; bad values are refused by name."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from kvserve.attention.offloaded import OffloadedKVCache
from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.entrypoints.engine_args import add_kv_policy_args
from kvserve.models import LoadedModel, load_model
from kvserve.policies.calibration import (
    ThresholdCalibration,
    calibrate_alphas,
    calibration_rows,
    candidates,
    kept_mass,
    layer_logits,
)
from kvserve.policies.infinigen import InfiniGen, PagedCandidates, Rehearsal, speculate
from kvserve.policies.skewing import (
    CALIBRATION_ROWS,
    SKEWING_DIR_ENV,
    Skewing,
    compute_skewing,
    load_skewing,
    record_sample,
    sample_tokens,
    skewing_for,
)
from kvserve.sampling.sampling_params import SamplingParams
from tests.test_sliding_window_tiny import SPECS
from tests.tiny_models import TinySpec, torch_single_thread, write_tiny_model  # noqa: F401 - autouse fixture

SPEC = TinySpec(num_heads=4, num_kv_heads=2, num_layers=3, head_dim=32, max_position_embeddings=256, seed=31)
DIMS = InfiniGen().partial_dims(SPEC.head_dim)  # the default partial ratio's


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> LoadedModel:
    return load_model(write_tiny_model(tmp_path_factory.mktemp("calibration"), SPEC), dtype=torch.float32)


@pytest.fixture(autouse=True)
def skewing_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(SKEWING_DIR_ENV, str(tmp_path / "skewing"))
    return tmp_path / "skewing"


def reaching(speculated, exact, valid, alpha: float, mass: float) -> torch.Tensor:
    """(R,) bool: which rows keep ``mass`` of their attention when speculation runs at ``alpha``."""
    return kept_mass(speculate(speculated, valid, alpha), exact, valid) >= mass


# ----- one row, one layer -----


def test_row_alpha_on_hand_made_logits() -> None:
    # One row, one KV head of two query heads, 4 candidates; both heads' exact weights: candidate 2 holds 0.8,
    # candidate 0 0.1, candidates 1 and 3 0.05 each.
    weights = torch.tensor([0.1, 0.05, 0.8, 0.05])
    exact = weights.log().expand(1, 1, 2, 4)  # both query heads see the same weights
    # Speculation ranks 2, 0, 1, 3; head 0's gaps to its best: [1, 3, 0, 5], head 1's [2, 4, 0, 6].
    speculated = torch.tensor([[[[9.0, 7.0, 10.0, 5.0], [8.0, 6.0, 10.0, 4.0]]]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    # mass 0.85 needs 2 tokens ({2, 0}: 0.9): 2 heads x 2 = 4 gaps <= alpha; sorted gaps 0, 0, 1, 2 -> alpha 2.
    alpha = float(ThresholdCalibration(0.85).row_alphas(speculated, exact, valid)[0])
    assert alpha == pytest.approx(2.0, rel=1e-4) and alpha >= 2.0
    assert speculate(speculated, valid, alpha).counts.tolist() == [2]
    assert speculate(speculated, valid, 1.99).counts.tolist() == [1]
    # mass 0.75 is held by token 2 alone: alpha 0; mass 1 needs all 4 tokens: the 8th smallest gap, 6.
    assert float(ThresholdCalibration(0.75).row_alphas(speculated, exact, valid)[0]) == 0.0
    assert float(ThresholdCalibration(1.0).row_alphas(speculated, exact, valid)[0]) == pytest.approx(6.0, rel=1e-4)


def test_row_alphas_are_the_smallest_that_keep_the_mass_on_random_logits() -> None:
    g = torch.Generator().manual_seed(3)
    rows, kv_heads, group, n = 24, 3, 2, 40
    exact = torch.randn(rows, kv_heads, group, n, generator=g) * 2
    speculated = exact + torch.randn(rows, kv_heads, group, n, generator=g)  # a noisy rehearsal
    valid = torch.arange(n)[None, :] < torch.randint(2, n + 1, (rows,), generator=g)[:, None]
    for mass in (0.5, 0.9, 0.99):
        alphas = ThresholdCalibration(mass).row_alphas(speculated, exact, valid)
        for r in range(rows):
            one = (speculated[r : r + 1], exact[r : r + 1], valid[r : r + 1])
            assert bool(reaching(*one, float(alphas[r]), mass))
            if alphas[r] > 0:  # just below it, the count falls short and so does the mass
                assert not bool(reaching(*one, float(alphas[r]) * (1 - 1e-4), mass))


def test_layer_alpha_is_the_smallest_for_the_share_of_rows() -> None:
    row_alphas = torch.tensor([5.0, 1.0, 3.0, 2.0, 4.0, 9.0, 7.0, 6.0, 8.0, 10.0])
    assert ThresholdCalibration(quantile=0.9).layer_alpha(row_alphas) == 9.0  # 9 of 10 rows need <= 9
    assert ThresholdCalibration(quantile=0.5).layer_alpha(row_alphas) == 5.0
    assert ThresholdCalibration(quantile=0.55).layer_alpha(row_alphas) == 6.0  # ceil(5.5) = 6 rows
    assert ThresholdCalibration(quantile=1.0).layer_alpha(row_alphas) == 10.0
    assert ThresholdCalibration(quantile=0.01).layer_alpha(row_alphas) == 1.0


def test_calibration_rows_spread_over_the_second_half() -> None:
    rows = calibration_rows(2048, 128)
    assert rows.tolist()[0] == 1024 and rows.tolist()[-1] == 2047 and len(rows) == 128
    assert calibration_rows(100, 128).tolist() == list(range(50, 100))  # fewer tokens than rows: each once
    assert calibration_rows(2, 8).tolist() == [1]
    with pytest.raises(ValueError, match="at least 2 tokens, got 1"):
        calibration_rows(1, 8)


# ----- a tiny model -----


def sample_of(loaded: LoadedModel):
    ids = sample_tokens(loaded.tokenizer, loaded.config.max_position_embeddings)
    recorder = record_sample(loaded.model, ids, calibration_rows(len(ids), CALIBRATION_ROWS))
    return recorder, len(ids)


def test_calibration_is_deterministic_and_reaches_its_target_on_the_sample(loaded) -> None:
    recorder, n = sample_of(loaded)
    skewing = compute_skewing(loaded.model, sample_tokens(loaded.tokenizer, n))
    rehearsal = Rehearsal(loaded.model, skewing.partial(DIMS))
    target = ThresholdCalibration(mass=0.9, quantile=0.75)
    alphas = calibrate_alphas(recorder.sample(), rehearsal, target)
    assert len(alphas) == SPEC.num_layers and alphas[0] == 0.0 and all(a > 0 for a in alphas[1:])
    again, _ = sample_of(loaded)  # the whole run again: the same alphas, bit for bit
    assert calibrate_alphas(again.sample(), rehearsal, target) == alphas
    sample = recorder.sample()
    valid = candidates(sample, n)
    for layer in range(1, SPEC.num_layers):
        speculated, exact = layer_logits(sample, rehearsal, layer)
        share = float(reaching(speculated, exact, valid, alphas[layer], target.mass).float().mean())
        below = float(reaching(speculated, exact, valid, alphas[layer] * (1 - 1e-4), target.mass).float().mean())
        assert share >= target.quantile > below, (layer, share, below)


def test_window_layers_calibrate_their_own_query_in_their_window_at_the_window_mass(tmp_path) -> None:
    """Tiny Gemma 3 (window 8, layer 5 global): every layer speculates, layer 0 included; a window layer's alpha is
    the smallest at which its own query's selection among its window's rows keeps ``window_mass``, the global
    layer's the smallest at which its rehearsal keeps ``mass``."""
    loaded = load_model(write_tiny_model(tmp_path, SPECS["gemma3"]), dtype=torch.float32)
    windows = loaded.config.layer_windows
    recorder, n = sample_of(loaded)
    dims = InfiniGen().partial_dims(loaded.config.head_dim)
    rehearsal = Rehearsal(loaded.model, compute_skewing(loaded.model, sample_tokens(loaded.tokenizer, n)).partial(dims))
    assert rehearsal.speculated_layers == set(range(6)) and rehearsal.own_query_layers == {0, 1, 2, 3, 4}
    target = ThresholdCalibration(mass=0.7, quantile=0.75, window_mass=0.9)
    sample = recorder.sample()
    alphas = calibrate_alphas(sample, rehearsal, target)
    position = torch.arange(n)[None, :]
    for layer, window in enumerate(windows):
        valid = candidates(sample, n)
        if window is not None:
            valid &= position > sample.rows[:, None] - window
            partial_q = rehearsal.partial_from_query(layer, sample.queries[layer])
        else:
            partial_q = rehearsal.partial_query(layer, sample.inputs[layer - 1], sample.rope[layer - 1])
        speculated, exact = layer_logits(sample, rehearsal, layer, partial_q)
        mass = target.window_mass if window is not None else target.mass
        share = float(reaching(speculated, exact, valid, alphas[layer], mass).float().mean())
        below = float(reaching(speculated, exact, valid, alphas[layer] * (1 - 1e-4), mass).float().mean())
        assert share >= target.quantile > below, (layer, share, below)


def same(a: Skewing, b: Skewing) -> bool:
    return (torch.equal(a.matrices, b.matrices) and torch.equal(a.ranking, b.ranking) and a.target == b.target
            and a.alphas == b.alphas)  # fmt: skip


def test_skewing_file_stores_the_calibration(loaded, skewing_dir) -> None:
    skewing, file = skewing_for(loaded)
    assert set(skewing.alphas) == {DIMS} and skewing.target == ThresholdCalibration()
    assert same(load_skewing(file), skewing)
    # Another partial ratio's alphas are added to the file; the default's stay.
    wider, _ = skewing_for(loaded, partial_dims=SPEC.head_dim)
    assert set(wider.alphas) == {DIMS, SPEC.head_dim} and wider.alphas[DIMS] == skewing.alphas[DIMS]
    assert torch.equal(wider.matrices, skewing.matrices) and same(load_skewing(file), wider)
    # Another target recalibrates (only the default and asked dimensions); the default target is the same again.
    other, _ = skewing_for(loaded, target=ThresholdCalibration(0.5, 0.5))
    lower = zip(other.alphas[DIMS], skewing.alphas[DIMS], strict=True)
    assert set(other.alphas) == {DIMS} and all(a <= b for a, b in lower)
    assert skewing_for(loaded, target=ThresholdCalibration())[0].alphas == skewing.alphas


def test_an_older_skewing_file_is_recomputed_or_refused_with_the_command(loaded, skewing_dir) -> None:
    skewing, file = skewing_for(loaded)
    torch.save({"format": 1, "matrices": skewing.matrices, "ranking": skewing.ranking}, file)  # before calibration
    assert load_skewing(file) is None
    shard = SimpleNamespace(path=loaded.path, shard=object())  # a tensor-parallel rank cannot run the sample
    with pytest.raises(ValueError, match="older kvserve, without calibrated alphas.*run `kvserve infinigen-setup`"):
        skewing_for(shard)
    assert same(skewing_for(loaded)[0], skewing)  # recomputed: the same matrices and alphas
    with pytest.raises(ValueError, match=r"for \[10\] partial dimensions, not 32: run `kvserve infinigen-setup "):
        skewing_for(shard, partial_dims=SPEC.head_dim)


# ----- the policy and the engine -----


def offload_engine(loaded: LoadedModel, **options) -> LLMEngine:
    config = EngineConfig(model=str(loaded.path), dtype="float32", block_size=4, kv_cache_memory="4MiB",
                          swap_space=0, kv_offload="host", kv_policy="infinigen", **options)  # fmt: skip
    return LLMEngine(config, loaded)


def fetched(engine: LLMEngine, prompt_len: int = 60, max_tokens: int = 6) -> list[float]:
    """Per layer, the share of cached rows fetched while decoding after a prompt."""
    prompt = torch.randint(0, 290, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.close()
    return engine.runner.cache.stats.fetch_fraction()


def test_auto_resolves_to_the_calibrated_alphas_and_a_number_overrides(loaded) -> None:
    engine = offload_engine(loaded)  # infinigen_alpha="auto", the default
    assert engine.config.infinigen_alpha == "auto" and engine.kv_policy.alpha == "auto"
    cache = engine.runner.cache
    assert isinstance(cache, OffloadedKVCache)
    assert cache.policy.alpha == skewing_for(loaded)[0].alphas[DIMS]
    assert [cache.policy.layer_alpha(layer) for layer in range(SPEC.num_layers)] == list(cache.policy.alpha)
    fractions = fetched(engine)
    assert fractions[0] == 1.0 and all(0 < f <= 1 for f in fractions)
    fixed = offload_engine(loaded, infinigen_alpha=2.5)
    assert fixed.runner.cache.policy.alpha == 2.5 and fixed.runner.cache.policy.layer_alpha(2) == 2.5
    fixed.close()
    wide = offload_engine(loaded, infinigen_partial_ratio=1.0)  # another ratio: calibrated on first use
    assert wide.runner.cache.policy.alpha == skewing_for(loaded)[0].alphas[SPEC.head_dim]
    wide.close()


def test_per_layer_alphas_decide_each_layers_fetch(loaded) -> None:
    g = torch.Generator().manual_seed(8)
    policy = InfiniGen(alpha=(0.0, 0.0, 1.0, 1e9))
    # 3 sequences, 2 KV heads of 2 query heads, r = 5; 40 candidates each: 5 blocks of 8 (keys transposed).
    partial_q, partial_keys = torch.randn(3, 2, 2, 5, generator=g), torch.randn(2, 15, 5, 8, generator=g)
    tables = torch.arange(15, dtype=torch.int32).view(3, 5)
    candidates = PagedCandidates(tables, 8, torch.zeros(3, dtype=torch.int32), torch.full((3,), 40, dtype=torch.int32))
    counts = [policy.select_decode_rows(layer, partial_q, partial_keys, candidates, 32)[0].counts for layer in range(4)]
    assert torch.all(counts[1] <= counts[2]) and torch.all(counts[2] <= counts[3]) and counts[3].tolist() == [40] * 3
    # Through an engine: layer 1 fetches its best row, layer 2 everything.
    fractions = fetched(offload_engine(loaded, infinigen_alpha=(0.0, 0.0, 1e9)))
    assert fractions[2] == 1.0 and fractions[1] < 0.1
    fractions = fetched(offload_engine(loaded, infinigen_alpha=(0.0, 1e9, 0.0)))
    assert fractions[1] == 1.0 and fractions[2] < 0.1


@pytest.mark.parametrize(
    ("alpha", "message"),
    [
        ("automatic", "infinigen_alpha must be 'auto' or a finite number >= 0 (or one per layer), got 'automatic'"),
        ((1.0, -1.0), "got (1.0, -1.0)"),
        ((), "got ()"),
        (True, "got True"),
        (float("nan"), "got nan"),
    ],
)
def test_bad_alphas_are_refused_by_name(alpha, message) -> None:
    with pytest.raises(ValueError) as error:
        InfiniGen(alpha=alpha)
    assert message in str(error.value)
    with pytest.raises(ValueError) as error:
        EngineConfig(kv_offload="host", kv_policy="infinigen", infinigen_alpha=alpha)
    assert message in str(error.value)


def test_unresolved_or_mismatched_alphas_are_refused(loaded) -> None:
    with pytest.raises(ValueError, match="infinigen_alpha='auto' is resolved from the model's calibration"):
        InfiniGen().layer_alpha(1)
    with pytest.raises(ValueError, match="lacks: run `kvserve infinigen-setup` for this model"):
        InfiniGen().resolve_alpha(None)
    assert InfiniGen(alpha=3.0).resolve_alpha(None).alpha == 3.0  # a number needs no calibration
    with pytest.raises(ValueError, match="asked for layer 2"):
        InfiniGen(alpha=(0.0, 1.0)).layer_alpha(2)
    with pytest.raises(ValueError, match="infinigen_alpha has 2 per-layer values; the model has 3 layers"):
        offload_engine(loaded, infinigen_alpha=(0.0, 1.0))
    for bad in ({"mass": 0.0}, {"quantile": 1.5}):
        with pytest.raises(ValueError, match=f"calibration {next(iter(bad))} must be in \\(0, 1\\], got"):
            ThresholdCalibration(**bad)


def test_command_line_alpha_is_auto_or_a_number(capsys) -> None:
    parser = argparse.ArgumentParser()
    add_kv_policy_args(parser)
    assert parser.parse_args([]).infinigen_alpha == "auto"
    assert parser.parse_args(["--infinigen-alpha", "auto"]).infinigen_alpha == "auto"
    assert parser.parse_args(["--infinigen-alpha", "6.5"]).infinigen_alpha == 6.5
    with pytest.raises(SystemExit):
        parser.parse_args(["--infinigen-alpha", "lots"])
    assert "infinigen_alpha must be 'auto' or a number, got 'lots'" in capsys.readouterr().err
