"""Single-request generation (kvserve.entrypoints.generation.Generator) over a tiny random checkpoint."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from kvserve.entrypoints.generation import Generator
from kvserve.models import LoadedModel, load_model
from kvserve.sampling.sampling_params import SamplingParams
from tests.tiny_models import (  # noqa: F401 - torch_single_thread is an autouse fixture
    TinySpec,
    hf_logits,
    load_hf_model,
    torch_single_thread,
    write_tiny_model,
    write_tokenizer,
)

SPEC = TinySpec(num_heads=4, num_kv_heads=2, seed=7)
PROMPTS = ["the cat sat on the mat", "héllo 你好", "one two three four five six"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("gen"), SPEC)


@pytest.fixture(scope="module")
def loaded(folder) -> LoadedModel:
    return load_model(folder)


@pytest.fixture(scope="module")
def generator(loaded) -> Generator:
    return Generator(loaded)


@pytest.fixture(scope="module")
def hf(folder) -> PreTrainedModel:
    return load_hf_model(folder)


def greedy(max_tokens: int = 20, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """Reference: full recompute with transformers at every step, argmax of the last position."""
    ids = list(ids)
    out = []
    for _ in range(n):
        token = int(hf_logits(hf, ids)[-1].argmax())
        out.append(token)
        ids.append(token)
    return out


def collect(generator: Generator, prompt, params: SamplingParams) -> tuple[list[str], object]:
    stream = generator.stream(prompt, params)
    deltas = list(stream)
    return deltas, stream.output


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_hf_full_recompute(generator, hf, prompt) -> None:
    ids = generator.tokenizer.encode(prompt)
    out = generator.generate(prompt, greedy(20))
    assert out.prompt_token_ids == ids
    assert out.token_ids == hf_greedy(hf, ids, 20)
    assert out.finish_reason == "length"
    assert len(set(out.token_ids)) > 1  # not a degenerate model repeating one token


def test_token_id_prompt_equals_text_prompt(generator) -> None:
    ids = generator.tokenizer.encode(PROMPTS[0])
    assert generator.generate(ids, greedy(8)).token_ids == generator.generate(PROMPTS[0], greedy(8)).token_ids


@pytest.mark.parametrize("max_tokens", [1, 7])
def test_max_tokens_respected(generator, max_tokens) -> None:
    for params in (greedy(max_tokens), SamplingParams(max_tokens=max_tokens, seed=3, ignore_eos=True)):
        out = generator.generate(PROMPTS[0], params)
        assert len(out.token_ids) == max_tokens
        assert out.finish_reason == "length"


def test_streamed_deltas_concatenate_to_text(generator) -> None:
    deltas, out = collect(generator, PROMPTS[1], greedy(20))
    assert "".join(deltas) == out.text
    assert out.text  # something was generated
    assert all(deltas)  # no empty deltas are yielded


def test_seeded_sampling_is_reproducible(generator) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=15, seed=11, ignore_eos=True)
    first = generator.generate(PROMPTS[0], params).token_ids
    assert generator.generate(PROMPTS[0], params).token_ids == first
    other = generator.generate(PROMPTS[0], dataclasses.replace(params, seed=12)).token_ids
    assert other != first
    top1 = SamplingParams(temperature=1.0, top_k=1, max_tokens=15, seed=11, ignore_eos=True)
    assert generator.generate(PROMPTS[0], top1).token_ids == generator.generate(PROMPTS[0], greedy(15)).token_ids


def _stop_candidate(text: str) -> tuple[str, int]:
    """A 3-character stop string from the middle of ``text`` and where it first occurs."""
    for start in range(len(text) // 3, len(text) - 3):
        stop = text[start : start + 3]
        if "\ufffd" not in stop and stop.strip():
            return stop, text.find(stop)
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_stop_string_truncates_output(generator, prompt) -> None:
    full = generator.generate(prompt, greedy(20))
    assert len(full.text) >= 9, full.text
    stop, index = _stop_candidate(full.text)
    deltas, out = collect(generator, prompt, greedy(20, stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.text == full.text[:index]
    assert stop not in out.text
    assert "".join(deltas) == out.text
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < len(full.token_ids)


def test_earliest_of_several_stop_strings_wins(generator) -> None:
    full = generator.generate(PROMPTS[0], greedy(20))
    late, late_index = _stop_candidate(full.text)
    early = full.text[1:3]
    out = generator.generate(PROMPTS[0], greedy(20, stop=[late, early]))
    assert out.finish_reason == "stop"
    assert out.text == full.text[: min(late_index, full.text.find(early))]


def test_partial_stop_match_is_released_at_the_end(generator) -> None:
    """A tail that looks like the start of a stop string is held back, then emitted when generation ends."""
    full = generator.generate(PROMPTS[0], greedy(20))
    tail = full.text[-2:]
    deltas, out = collect(generator, PROMPTS[0], greedy(20, stop=[tail + "\x00never"]))
    assert out.finish_reason == "length"
    assert out.text == full.text
    assert "".join(deltas) == full.text


def test_stop_token_ids_and_eos(generator, loaded) -> None:
    full = generator.generate(PROMPTS[0], greedy(20))
    target = full.token_ids[5]
    first = full.token_ids.index(target)
    out = generator.generate(PROMPTS[0], greedy(20, stop_token_ids=[target]))
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: first + 1]
    # The same token as the model's EOS: stops unless ignore_eos.
    eos_tokenizer = dataclasses.replace(loaded.tokenizer, eos_token_ids=(target,))
    eos_generator = Generator(dataclasses.replace(loaded, tokenizer=eos_tokenizer))
    stopped = eos_generator.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=20))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[: first + 1]
    ignored = eos_generator.generate(PROMPTS[0], greedy(20))
    assert ignored.token_ids == full.token_ids and ignored.finish_reason == "length"


def test_generation_is_capped_by_the_context(generator, loaded) -> None:
    context = loaded.config.max_position_embeddings
    ids = generator.tokenizer.encode("the cat " * 200)[: context - 6]
    out = generator.generate(ids, greedy(50))
    assert len(out.token_ids) == 6
    assert out.finish_reason == "length"


@pytest.mark.parametrize("extra", [0, 44])
def test_prompt_longer_than_context_raises(generator, loaded, extra) -> None:
    context = loaded.config.max_position_embeddings
    ids = [5] * (context + extra)
    with pytest.raises(ValueError) as info:
        generator.generate(ids, greedy(5))
    message = str(info.value)
    assert str(len(ids)) in message and str(context) in message


def test_empty_prompt_raises(generator) -> None:
    with pytest.raises(ValueError, match="empty"):
        generator.generate([], greedy(5))


def test_empty_text_prompt_without_bos_raises(folder, tmp_path) -> None:
    """With a tokenizer that adds no BOS, "" encodes to no tokens at all."""
    for file in folder.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    write_tokenizer(tmp_path, add_bos=False)
    generator = Generator(load_model(tmp_path))
    assert generator.tokenizer.encode("") == []
    with pytest.raises(ValueError, match="empty"):
        generator.generate("", greedy(5))


def test_logits_are_float32_and_cache_is_exact(generator, hf) -> None:
    """forward_last over a fresh cache gives the HF logits of the last prompt token."""
    from kvserve.attention import ContiguousKVCache

    cfg = generator.config
    ids = generator.tokenizer.encode(PROMPTS[2])
    cache = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, len(ids), torch.float32)
    logits = generator.forward_last(cache, ids, 0)
    assert logits.dtype == torch.float32 and logits.shape == (cfg.vocab_size,)
    assert (logits - hf_logits(hf, ids)[-1]).abs().max().item() <= 1e-4
