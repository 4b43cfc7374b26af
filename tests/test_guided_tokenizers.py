"""The tokenizer as xgrammar sees it (``structured/grammars.py``): a grammar matching a text accepts exactly the
tokens the tokenizer writes that text with, for byte-level BPE and for SentencePiece with byte fallback."""

from __future__ import annotations

import pytest
import xgrammar

from kvserve.models.gguf_file import open_gguf
from kvserve.structured import GuidedDecodingParams
from kvserve.structured.grammars import GrammarCache
from kvserve.text.tokenizer import Tokenizer
from tests.test_tokenizer_spm import write_spm_gguf
from tests.tiny_models import BOS_ID, EOS_ID, build_tiny_tokenizer

TEXT = "hello world, 42 héllo"


def accepts(tokenizer: Tokenizer, ids: list[int], text: str = TEXT) -> bool:
    cache = GrammarCache(tokenizer, tokenizer.vocab_size)
    matcher = cache.new_matcher(cache.compile(GuidedDecodingParams(choice=[text])))
    return all(matcher.accept_token(i) for i in ids) and matcher.accept_token(tokenizer.eos_token_ids[0])


@pytest.mark.parametrize("space_prefix", [True, False])
def test_sentencepiece_byte_fallback(tmp_path, space_prefix):
    tokenizer = Tokenizer.from_gguf(open_gguf(write_spm_gguf(tmp_path / "spm.gguf", add_space_prefix=space_prefix)))
    assert GrammarCache(tokenizer, tokenizer.vocab_size).info.vocab_type == xgrammar.VocabType.BYTE_FALLBACK
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # With a space prefix, the first token is "▁hello": after a prompt it writes " hello", and so does the grammar.
    spelt = " " + TEXT if space_prefix else TEXT
    assert tokenizer.decode([tokenizer.bos_token_id, *ids], skip_special_tokens=False).endswith(spelt)
    assert accepts(tokenizer, ids, spelt) and not accepts(tokenizer, ids, TEXT if space_prefix else " " + TEXT)
    assert not accepts(tokenizer, tokenizer.encode("hello there", add_special_tokens=False), spelt)


def test_byte_level_bpe_keeps_special_tokens_out():
    tokenizer = Tokenizer(build_tiny_tokenizer(add_bos=False), bos_token_id=None, eos_token_ids=(EOS_ID,))
    cache = GrammarCache(tokenizer, tokenizer.vocab_size)
    assert cache.info.vocab_type == xgrammar.VocabType.BYTE_LEVEL
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert accepts(tokenizer, ids)
    any_text = cache.compile(GuidedDecodingParams(regex=".*"))
    assert cache.new_matcher(any_text).accept_token(ids[0])
    assert not cache.new_matcher(any_text).accept_token(BOS_ID)  # "<s>" is a special token, never text
