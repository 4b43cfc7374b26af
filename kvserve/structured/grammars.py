"""Compiled grammars for one engine: xgrammar's view of the tokenizer, built once, and an LRU of compiled
constraints keyed by what they ask (so a server seeing the same schema again compiles it once)."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence

import torch
import xgrammar

from kvserve.structured import matching
from kvserve.structured.params import GuidedDecodingParams
from kvserve.text.tokenizer import Tokenizer

CACHE_SIZE = 64


class GrammarCache:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, size: int = CACHE_SIZE) -> None:
        self.info = tokenizer_info(tokenizer, vocab_size)
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.size = size
        self._compiled: OrderedDict[tuple[str, str], xgrammar.CompiledGrammar] = OrderedDict()

    def compile(self, guided: GuidedDecodingParams) -> xgrammar.CompiledGrammar:
        key = guided.key
        compiled = self._compiled.pop(key, None)
        if compiled is None:
            compiled = self.compiler.compile_grammar(guided.to_grammar())
        self._compiled[key] = compiled  # most recently used last
        if len(self._compiled) > self.size:
            self._compiled.popitem(last=False)
        return compiled

    # What the engine does with matchers, here so that the engine imports xgrammar only with this class.
    new_matcher = staticmethod(matching.new_matcher)
    accept = staticmethod(matching.accept)

    def fill_bitmasks(self, matchers: Sequence[xgrammar.GrammarMatcher | None]) -> list[torch.Tensor | None]:
        return matching.fill_bitmasks(matchers, self.info.vocab_size)


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgrammar.TokenizerInfo:
    """xgrammar's TokenizerInfo from the vocabulary strings, as its ``from_huggingface`` builds it: byte-level
    BPE tokens are spelt in GPT-2's byte alphabet; SentencePiece ones use ``▁`` for a space and ``<0xNN>`` byte
    tokens.
    Special tokens become empty strings, which xgrammar never allows inside the output (EOS ends it)."""
    backend = tokenizer.backend
    vocab = [backend.id_to_token(i) or "" for i in range(min(tokenizer.vocab_size, vocab_size))]
    for token_id, added in backend.get_added_tokens_decoder().items():
        if added.special and token_id < len(vocab):
            vocab[token_id] = ""
    decoder = json.dumps(json.loads(backend.to_str()).get("decoder"))
    if '"ByteLevel"' in decoder:
        vocab_type = xgrammar.VocabType.BYTE_LEVEL
    elif '"ByteFallback"' in decoder:
        vocab_type = xgrammar.VocabType.BYTE_FALLBACK
    else:
        vocab_type = xgrammar.VocabType.RAW
    # Output follows the prompt, so a leading "▁" is a space in the text the client gets, and the grammar must
    # see it (add_prefix_space=True would drop it from a first token, for text encoded on its own).
    return xgrammar.TokenizerInfo(
        vocab, vocab_type, vocab_size=vocab_size, stop_token_ids=list(tokenizer.eos_token_ids),
        add_prefix_space=False,
    )  # fmt: skip
