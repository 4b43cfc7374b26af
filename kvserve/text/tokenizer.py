"""Tokenizer: the ``tokenizers`` library built from GGUF metadata or ``tokenizer.json``, plus the chat template."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from jinja2.exceptions import TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.text.sentencepiece import sentencepiece_backend

if TYPE_CHECKING:
    from kvserve.models.gguf_reader import GGUFFile

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL = 1
_UNKNOWN = 2
_CONTROL = 3
_USER_DEFINED = 4

_GGUF_TOKENIZER_KINDS = {"gpt2": "byte-level BPE", "llama": "SentencePiece"}
# End-of-turn token texts llama.cpp looks for when tokenizer.ggml.eot_token_id is absent (llama-vocab.cpp).
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "_<EOT>")

# Pre-tokenizer splits by ``tokenizer.ggml.pre``; these mirror llama.cpp's llama-vocab.cpp.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Pre-tokenizer types that isolate every digit before the GPT-2 split (SmolLM, StarCoder).
_DIGIT_SPLIT_PRE_TYPES = ("smollm", "starcoder", "refact")


@dataclass
class Tokenizer:
    backend: BackendTokenizer
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    add_bos_token: bool = False
    chat_template: str | None = None
    special_token_strings: dict[str, str] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # tokenizer.json's post-processor adds BOS for Hugging Face folders; GGUF files say so in a flag.
        # The batch call releases the GIL while it works (``encode`` holds it for seconds on a long text, which
        # would freeze the server's event loop and engine thread) and skips the offsets nobody reads.
        ids = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.backend.id_to_token(i) or "" for i in ids]

    def apply_chat_template(
        self, messages: Sequence[dict], add_generation_prompt: bool = True, tools: Sequence[dict] | None = None
    ) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the model's own Jinja template; ``tools``
        (OpenAI's function tools) reach it as Hugging Face's ``apply_chat_template`` passes them."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass a plain prompt instead of --chat")
        extra = {"tools": list(tools)} if tools else {}
        return self._compiled_template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **extra, **self.special_token_strings
        )

    def encode_chat(
        self, messages: Sequence[dict], add_generation_prompt: bool = True, tools: Sequence[dict] | None = None
    ) -> list[int]:
        """Token ids of the rendered chat; the template writes its own BOS, so none is added here."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens=False)

    @cached_property
    def _compiled_template(self):  # noqa: ANN202 - jinja2 Template
        return _template_environment().from_string(self.chat_template)

    # ----- construction -----

    @classmethod
    def from_gguf(cls, reader: GGUFFile) -> Tokenizer:
        def get(key: str, default: object = None) -> object:
            f = reader.fields.get(f"tokenizer.{key}")
            return default if f is None else f.contents()

        kind = get("ggml.model")
        if kind is None:
            raise ModelLoadError("the GGUF file has no tokenizer (tokenizer.ggml.model is missing)")
        if kind not in _GGUF_TOKENIZER_KINDS:
            supported = ", ".join(f"{k!r} ({what})" for k, what in _GGUF_TOKENIZER_KINDS.items())
            raise UnsupportedModelError(
                f"GGUF tokenizer model {kind!r} is not supported (supported: {supported}); "
                "load the model from a Hugging Face folder with tokenizer.json instead"
            )
        tokens: list[str] = get("ggml.tokens")
        token_types = get("ggml.token_type")  # a numpy array: one list of ints is cheaper to walk
        token_types = [_NORMAL] * len(tokens) if token_types is None else np.asarray(token_types).tolist()
        if len(token_types) != len(tokens):
            raise ModelLoadError(f"the GGUF tokenizer has {len(tokens)} tokens but {len(token_types)} token types")
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, get("ggml.merges") or [], str(get("ggml.pre", "default")))
            _add_gguf_special_tokens(backend, tokens, token_types, special_types=(_CONTROL,))
            eot = get("ggml.eot_token_id")
        else:
            backend = _sentencepiece_from_gguf(get, tokens, token_types)
            eot = get("ggml.eot_token_id", _eot_by_text(tokens))
        bos, eos = get("ggml.bos_token_id"), get("ggml.eos_token_id")
        eos_ids = tuple(dict.fromkeys(i for i in (eos, eot) if i is not None))
        strings = {name: tokens[i] for name, i in (("bos_token", bos), ("eos_token", eos)) if i is not None}
        return cls(
            backend=backend,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            # llama.cpp adds BOS by default for SentencePiece vocabularies, not for GPT-2 ones.
            add_bos_token=bool(get("ggml.add_bos_token", kind == "llama")),
            chat_template=get("chat_template"),
            special_token_strings=strings,
        )

    def with_chat_template(self, template: str, source: str = "chat template") -> Tokenizer:
        """This tokenizer with ``template`` as its chat template, compiled and tried on a one-message chat now,
        so a broken template is refused at start-up (a ValueError naming ``source`` and the line)."""
        check_chat_template(template, source)
        tokenizer = dataclasses.replace(self, chat_template=template)
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        except (TemplateError, TypeError, ValueError) as exc:  # compiles but cannot render a plain chat
            raise ValueError(f"{source} fails on a one-message chat: {exc}") from None
        return tokenizer

    @classmethod
    def from_hf_folder(cls, folder: Path, tokenizer_file: Path | None = None) -> Tokenizer:
        """A Hugging Face folder's tokenizer.json (or ``tokenizer_file``), with the folder's tokenizer_config.json,
        generation_config.json and config.json where they exist."""
        path = tokenizer_file or folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder} has no tokenizer.json; kvserve needs it to tokenize prompts")
        try:
            backend = BackendTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises a bare Exception on bad JSON
            raise ModelLoadError(f"{path} is not a valid tokenizer.json: {exc}") from exc
        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")
        strings = {k: _token_string(config.get(k)) for k in ("bos_token", "eos_token")}
        strings = {k: v for k, v in strings.items() if v}
        bos_id = backend.token_to_id(strings["bos_token"]) if "bos_token" in strings else None
        eos = generation.get("eos_token_id", model_config.get("eos_token_id"))
        if eos is None and "eos_token" in strings:
            eos = backend.token_to_id(strings["eos_token"])
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        template = config.get("chat_template")
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        return cls(
            backend=backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            add_bos_token=False,  # the post-processor in tokenizer.json adds it where wanted
            chat_template=template,
            special_token_strings=strings,
        )


def _sentencepiece_from_gguf(get: Callable[..., object], tokens: list[str], token_types: list[int]) -> BackendTokenizer:
    """llama.cpp's SPM tokenizer: merges by score, byte fallback, control and unknown tokens matched in text."""
    scores = get("ggml.scores")
    if scores is None or len(scores) != len(tokens):
        found = "none" if scores is None else len(scores)
        raise ModelLoadError(
            f"the GGUF SentencePiece tokenizer has {len(tokens)} tokens but {found} scores (tokenizer.ggml.scores); "
            "it needs one score per token to merge"
        )
    # llama.cpp prepends a space to each piece of text when the key is absent.
    add_space_prefix = bool(get("ggml.add_space_prefix", True))
    backend = sentencepiece_backend(tokens, scores, add_space_prefix, get("ggml.unknown_token_id"))
    _add_gguf_special_tokens(backend, tokens, token_types, special_types=(_CONTROL, _UNKNOWN))
    return backend


def _add_gguf_special_tokens(
    backend: BackendTokenizer, tokens: list[str], token_types: list[int], special_types: tuple[int, ...]
) -> None:
    """Tokens matched in raw text before the model runs: ``special_types`` (skipped on decode) and user-defined."""
    kinds = list(zip(tokens, token_types, strict=True))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in kinds if k in special_types])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in kinds if k == _USER_DEFINED])


def _eot_by_text(tokens: list[str]) -> int | None:
    """llama.cpp's guess at the end-of-turn token when the file names none (Gemma's ``<end_of_turn>``)."""
    return next((i for i, t in enumerate(tokens) if t in _EOT_TEXTS), None)


def _byte_level_bpe(tokens: list[str], merges: list[str], pre_type: str) -> BackendTokenizer:
    byte_spelling = bytes_to_unicode()
    alphabet = set(byte_spelling)
    vocab = {}
    for index, token in enumerate(tokens):
        # Tokens written outside the byte alphabet (rare, mislabelled specials) are respelled in it.
        key = token if set(token) <= alphabet else "".join(byte_spelling[b] for b in token.encode())
        vocab.setdefault(key, index)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    split = _PRE_TOKENIZER_SPLITS.get(pre_type)
    if split is not None:
        pre = [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(False, use_regex=False),
        ]
    elif pre_type in _DIGIT_SPLIT_PRE_TYPES:
        pre = [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False, use_regex=True)]
    else:
        pre = [pre_tokenizers.ByteLevel(False, use_regex=True)]
    backend.pre_tokenizer = pre_tokenizers.Sequence(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def bytes_to_unicode() -> list[str]:
    """GPT-2's printable spelling of each byte value 0..255."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    spelling, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelling[b] = chr(b)
        else:
            spelling[b] = chr(256 + extra)
            extra += 1
    return [spelling[b] for b in range(256)]


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc


def _token_string(value: object) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config files
        return value.get("content")
    return value if isinstance(value, str) else None


def check_chat_template(template: str, source: str = "chat template") -> None:
    """Compile ``template`` as chat templates are compiled; a ValueError naming ``source`` and the line if it fails."""
    if not template.strip():
        raise ValueError(f"{source} is empty")
    try:
        _template_environment().from_string(template)
    except TemplateSyntaxError as exc:
        raise ValueError(f"{source}, line {exc.lineno}: {exc.message}") from None


def _template_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)
