"""Tiny random Hugging Face checkpoints (Llama / Qwen2) with a byte-level BPE tokenizer, for CPU tests.

``write_tiny_model(folder, TinySpec(...))`` writes ``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json``. Weights are drawn
from a seeded generator with scales chosen so that attention is not uniform and logits spread over
several units (parity checks at 1e-4 would be vacuous on near-zero logits).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

if TYPE_CHECKING:  # transformers is imported lazily: only the tests that compare against it need it
    from transformers import PretrainedConfig, PreTrainedModel


@pytest.fixture(autouse=True, scope="module")
def torch_single_thread() -> Iterator[None]:
    """Run a test module's tiny matmuls on one thread (restored afterwards).

    Import this name into a test module to activate it there. On small, shared CPUs the OpenMP
    hand-off between two threads costs milliseconds per 64x64 matmul, far more than the maths.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True, scope="module")
def skewing_in_tmp(tmp_path_factory) -> Iterator[None]:
    """InfiniGen's skewing is computed into a temporary folder, never the user's cache (import to activate)."""
    from kvserve.policies.skewing import SKEWING_DIR_ENV

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SKEWING_DIR_ENV, str(tmp_path_factory.mktemp("skewing")))
        yield


# ----- tokenizer -----

NUM_MERGES = 42
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
BOS_ID = 256 + NUM_MERGES  # 298: special tokens come after the bytes and the merges
EOS_ID = BOS_ID + 1  # 299
VOCAB_SIZE = EOS_ID + 1  # 300: the model's vocabulary equals the tokenizer's

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = (
    "the quick brown fox jumps over the lazy dog. the cat sat on the mat and then the cat ran. "
    "there is a theory that the thing in the other room is then there. hello world, hello there! "
    "in the beginning the sentence is long and the words are short; the end is near the start. "
    "this is the test of the tokenizer and the model in the tests. one two three four five six."
)


def _learn_merges(num_merges: int) -> list[tuple[str, str]]:
    """Plain BPE training over a fixed English corpus in GPT-2 byte spelling (deterministic ties)."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = Counter(piece for piece, _ in pre.pre_tokenize_str(_CORPUS))
    splits = {word: list(word) for word in words}
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            parts = splits[word]
            for a, b in zip(parts, parts[1:], strict=False):
                pairs[(a, b)] += count
        best = max(pairs.items(), key=lambda item: (item[1], item[0]))[0]
        merges.append(best)
        for word, parts in splits.items():
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            splits[word] = merged
    return merges


@dataclass(frozen=True)
class TinyVocab:
    tokens: list[str]  # id -> token string (GPT-2 byte spelling; specials as written)
    merges: list[tuple[str, str]]
    special_ids: tuple[int, ...]


def tiny_vocab() -> TinyVocab:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    assert len(alphabet) == 256
    merges = _learn_merges(NUM_MERGES)
    tokens = alphabet + [a + b for a, b in merges] + [BOS_TOKEN, EOS_TOKEN]
    assert len(set(tokens)) == len(tokens) == VOCAB_SIZE
    return TinyVocab(tokens=tokens, merges=merges, special_ids=(BOS_ID, EOS_ID))


def build_tiny_tokenizer(add_bos: bool = True) -> Tokenizer:
    """Byte-level BPE: 256 byte tokens, NUM_MERGES merges, then <s> and </s> (BOS prepended if add_bos)."""
    vocab = tiny_vocab()
    bpe_vocab = {token: i for i, token in enumerate(vocab.tokens[:BOS_ID])}
    tokenizer = Tokenizer(models.BPE(vocab=bpe_vocab, merges=vocab.merges, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    added = tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (BOS_TOKEN, EOS_TOKEN)]
    )
    assert added == 2 and tokenizer.token_to_id(BOS_TOKEN) == BOS_ID and tokenizer.token_to_id(EOS_TOKEN) == EOS_ID
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, BOS_ID)]
        )
    return tokenizer


# ----- model -----


@dataclass(frozen=True)
class TinySpec:
    # "llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "mixtral", "qwen2_moe" or "qwen3_moe"
    arch: str = "llama"
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int | None = None  # None: hidden_size // num_heads
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # llama only (qwen2 always has q/k/v bias)
    rope_scaling: dict | None = None
    rope_theta: float = 10000.0
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    max_position_embeddings: int = 256
    rms_norm_eps: float = 1e-5
    chat_template: str | None = CHAT_TEMPLATE
    seed: int = 0
    extra: dict = field(default_factory=dict)


def hf_config(spec: TinySpec) -> PretrainedConfig:
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    kwargs = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        head_dim=spec.head_dim or spec.hidden_size // spec.num_heads,
        **spec.extra,
    )
    rope = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.rope_scaling is not None:
        rope = {**spec.rope_scaling, "rope_theta": spec.rope_theta}
    kwargs["rope_parameters"] = rope
    if spec.arch == "llama":
        config = LlamaConfig(attention_bias=spec.attention_bias, **kwargs)
    elif spec.arch == "qwen2":
        config = Qwen2Config(**kwargs)
    elif spec.arch == "qwen3":
        config = Qwen3Config(**kwargs)
    elif spec.arch == "mistral":
        config = MistralConfig(**kwargs)
    elif spec.arch == "gemma2":
        config = Gemma2Config(**kwargs)
    elif spec.arch == "phi3":
        config = Phi3Config(pad_token_id=None, **kwargs)
    elif spec.arch in _MOE_CONFIGS:  # experts, top-k and sizes through ``extra``
        config = {"mixtral": MixtralConfig, "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig}[spec.arch](
            **kwargs
        )
    elif spec.arch == "gemma3":
        kwargs["rope_parameters"] = {
            "full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}
        }  # fmt: skip
        config = Gemma3TextConfig(**kwargs)
    else:
        raise ValueError(f"unknown tiny arch {spec.arch!r}")
    config._attn_implementation = "eager"
    return config


_MOE_CONFIGS = ("mixtral", "qwen2_moe", "qwen3_moe")
ROUTER_SCALE = 4.0  # router logits spread over several units: each token's top-k is decisive, not a near tie


def build_hf_model(spec: TinySpec) -> PreTrainedModel:
    """A float32 HF model with seeded, non-degenerate random weights."""
    from transformers import (
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        LlamaForCausalLM,
        MistralForCausalLM,
        MixtralForCausalLM,
        Phi3ForCausalLM,
        Qwen2ForCausalLM,
        Qwen2MoeForCausalLM,
        Qwen3ForCausalLM,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(spec.seed)
    classes = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM,
               "mistral": MistralForCausalLM, "gemma2": Gemma2ForCausalLM, "gemma3": Gemma3ForCausalLM,
               "phi3": Phi3ForCausalLM, "mixtral": MixtralForCausalLM, "qwen2_moe": Qwen2MoeForCausalLM,
               "qwen3_moe": Qwen3MoeForCausalLM}  # fmt: skip
    cls = classes[spec.arch]
    model = cls(hf_config(spec)).float().eval()
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied lm_head is listed once (as embed_tokens)
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):  # Gemma multiplies by 1 + weight
                param.copy_((0.0 if spec.arch in ("gemma2", "gemma3") else 1.0) + 0.2 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise * (0.5 if spec.tie_word_embeddings else 1.0))
            elif "lm_head" in name:
                param.copy_(noise * (3.0 / math.sqrt(param.shape[1])))
            elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):  # MoE router
                param.copy_(noise * (ROUTER_SCALE / math.sqrt(param.shape[1])))
            else:  # fan-in is the last dimension, stacked experts (E, out, in) included
                param.copy_(noise / math.sqrt(param.shape[-1]))
    return model


def write_tokenizer(folder: Path, chat_template: str | None = CHAT_TEMPLATE, add_bos: bool = True) -> None:
    build_tiny_tokenizer(add_bos=add_bos).save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "model_max_length": 256,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def write_tiny_model(folder: str | Path, spec: TinySpec | None = None) -> Path:
    """Write a tiny HF checkpoint + tokenizer for ``spec`` into ``folder``; return the folder."""
    spec = spec or TinySpec()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build_hf_model(spec).save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder, spec.chat_template)
    (folder / "tiny_spec.json").write_text(json.dumps(asdict(spec), indent=2))
    return folder


def load_hf_model(folder: str | Path) -> PreTrainedModel:
    """The reference: the saved checkpoint loaded by transformers itself (float32, eager attention)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def hf_logits(
    model: PreTrainedModel,
    ids: list[int] | torch.Tensor,
    position_offset: int = 0,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """All-position float32 logits (N, vocab) of one sequence, recomputed from scratch.

    Position ids are ``position_offset + arange(N)`` unless ``positions`` (N,) is given. An explicit
    all-ones attention mask keeps transformers from reading a jump in position ids as the start of
    another packed sequence (it would then mask across the jump).
    """
    input_ids = torch.as_tensor(ids, dtype=torch.long).unsqueeze(0)
    if positions is None:
        positions = torch.arange(position_offset, position_offset + input_ids.shape[1])
    positions = positions.unsqueeze(0)
    mask = torch.ones_like(input_ids)
    return model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=False).logits[0].float()


def assert_greedy_equal_up_to_ties(completion, reference: list[int], atol: float = 1e-4) -> None:
    """A greedy ``CompletionOutput`` (run with ``logprobs >= 2``) equals ``reference`` token ids, except that from
    a step where its two best logprobs lie within ``atol`` (a tie that float32 rounding may break either way,
    so a run with other kernels or batching may pick the other) both token lists may go their own ways, as long
    as the reference took the other of the two."""
    for step, (got, want) in enumerate(zip(completion.token_ids, reference, strict=True)):
        if got == want:
            continue
        best = completion.logprobs[step]
        assert want in best and abs(best[got] - best[want]) <= atol, (
            f"greedy tokens differ at step {step}: {got} vs the reference's {want} (logprobs {best}), not a tie"
        )
        return
