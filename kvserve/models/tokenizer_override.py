"""``--tokenizer`` and ``--chat-template``: the tokenizer or chat template a model runs with, chosen by the user."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvserve.errors import ModelLoadError
from kvserve.models import gguf_file
from kvserve.models.catalog import resolve_model_path
from kvserve.text.tokenizer import Tokenizer, check_chat_template


def load_tokenizer(spec: str) -> Tokenizer:
    """A Hugging Face folder (tokenizer.json + tokenizer_config.json), a tokenizer.json file, a GGUF file, or a
    name ``--model`` takes (a shipped model, a Hugging Face name in the local cache)."""
    path = resolve_model_path(spec)
    if path.is_dir():
        return Tokenizer.from_hf_folder(path)
    if path.suffix == ".gguf" and path.is_file():
        return Tokenizer.from_gguf(gguf_file.open_gguf(path))
    if path.suffix == ".json" and path.is_file():
        return Tokenizer.from_hf_folder(path.parent, tokenizer_file=path)
    raise ModelLoadError(
        f"tokenizer {spec!r} is not a folder with tokenizer.json, a tokenizer .json file or a .gguf file"
        + ("" if path.exists() else f" ({path} does not exist)")
    )


def read_chat_template(spec: str) -> tuple[str, str]:
    """A Jinja template written inline (it holds ``{{`` or ``{%``) or a file holding one -> (template, where)."""
    if "{{" in spec or "{%" in spec:
        template, where = spec, "chat template (inline)"
    else:
        template, where = _read_template_file(spec), f"chat template {spec}"
    check_chat_template(template, where)
    return template, where


def _read_template_file(spec: str) -> str:
    try:
        return Path(spec).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        raise ValueError(
            f"chat template {spec!r} is neither a readable file ({why}) nor a Jinja template (no {{{{ or {{% in it)"
        ) from None


@dataclass(frozen=True)
class TokenizerOverride:
    """What the user chose instead of the model's own: read and checked before the weights load."""

    tokenizer: Tokenizer | None = None
    chat_template: tuple[str, str] | None = None  # (template, where it came from)

    @classmethod
    def read(cls, tokenizer: str | None, chat_template: str | None) -> TokenizerOverride:
        return cls(
            load_tokenizer(tokenizer) if tokenizer is not None else None,
            read_chat_template(chat_template) if chat_template is not None else None,
        )

    def apply(self, own: Tokenizer, vocab_size: int) -> Tokenizer:
        """``own`` (the model's tokenizer) with the overrides; a tokenizer past the model's vocabulary is refused."""
        tokenizer = self.tokenizer or own
        if tokenizer.vocab_size > vocab_size:
            raise ModelLoadError(
                f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's vocabulary of {vocab_size}"
            )
        if self.chat_template is not None:
            tokenizer = tokenizer.with_chat_template(*self.chat_template)
        return tokenizer
