"""Token strings and logprobs in OpenAI's two shapes (completions and chat).

A token's string is its own decoded text (``" the"``, not the BPE spelling ``"Ġthe"``); its bytes are
the raw bytes it stands for. A byte-level token holding only part of a UTF-8 character is written as
OpenAI writes it, ``"bytes:\\xe2\\x80"``, so that two such tokens never share a string.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.core.outputs import RequestOutput
from kvserve.server.protocol import ChatLogprobToken, CompletionLogprobs, PromptLogprob, PromptLogprobs, TopLogprob
from kvserve.text.tokenizer import Tokenizer, bytes_to_unicode

Logprobs = Sequence[dict[int, float] | None]  # per position: token id -> logprob (top k plus the chosen one)
MIN_LOGPROB = -9999.0  # what vLLM writes for -inf, which JSON cannot hold


class TokenTexts:
    """Cached id -> (text, bytes) for one tokenizer. Used from the asyncio side only."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        byte_level = type(tokenizer.backend.decoder).__name__ == "ByteLevel"
        self._byte_of = {c: b for b, c in enumerate(bytes_to_unicode())} if byte_level else None
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        """(display string, raw bytes) of one token."""
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            raw = text.encode("utf-8")
            if self._byte_of is not None and "\ufffd" in text:  # a piece of a character: spell its bytes
                spelled = self.tokenizer.backend.id_to_token(token_id) or ""
                if all(c in self._byte_of for c in spelled):
                    raw = bytes(self._byte_of[c] for c in spelled)
                    text = _display(raw, text)
            hit = self._cache[token_id] = (text, list(raw))
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]

    def num_chars(self, token_id: int) -> int:
        """The characters the token adds to decoded text (a piece of a character adds one replacement mark)."""
        return len(bytes(self.get(token_id)[1]).decode("utf-8", errors="replace"))


def _display(raw: bytes, text: str) -> str:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text


def completion_logprobs(
    texts: TokenTexts, token_ids: Sequence[int], logprobs: Logprobs, text_offset: int = 0
) -> CompletionLogprobs:
    """The completions shape: parallel lists; a position without logprobs (the prompt's first) is None."""
    out = CompletionLogprobs()
    for token_id, entry in zip(token_ids, logprobs, strict=True):
        text = texts.text(token_id)
        out.tokens.append(text)
        out.text_offset.append(text_offset)
        text_offset += texts.num_chars(token_id)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(entry.get(token_id))
        top: dict[str, float] = {}
        for tid, lp in sorted(entry.items(), key=lambda item: -item[1]):
            top.setdefault(texts.text(tid), lp)
        out.top_logprobs.append(top)
    return out


def prompt_logprobs(texts: TokenTexts, out: RequestOutput, num_top: int) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: None for the first prompt token; for each other, by token id, the token
    itself (its rank in the vocabulary) and then the ``num_top`` most likely tokens at that position (ranks
    1 to ``num_top``; the prompt token keeps its place, with that rank, when it is one of them)."""
    entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    ranks = out.prompt_token_ranks or [None] * len(out.prompt_token_ids)
    result: PromptLogprobs = []
    for token_id, entry, rank in zip(out.prompt_token_ids, entries, ranks, strict=True):
        if entry is None:
            result.append(None)
            continue
        position = {str(token_id): _prompt_logprob(texts, token_id, entry[token_id], rank)}
        for top_rank, (tid, lp) in enumerate(sorted(entry.items(), key=lambda item: -item[1])[:num_top], 1):
            position[str(tid)] = _prompt_logprob(texts, tid, lp, top_rank)
        result.append(position)
    return result


def _prompt_logprob(texts: TokenTexts, token_id: int, logprob: float, rank: int | None) -> PromptLogprob:
    return PromptLogprob(logprob=max(logprob, MIN_LOGPROB), rank=rank, decoded_token=texts.text(token_id))


def chat_logprobs(
    texts: TokenTexts, token_ids: Sequence[int], logprobs: Logprobs, num_top: int
) -> list[ChatLogprobToken]:
    """The chat shape: one object per token with its ``num_top`` most likely alternatives."""
    out = []
    for token_id, entry in zip(token_ids, logprobs, strict=True):
        entry = entry or {}
        text, raw = texts.get(token_id)
        ranked = sorted(entry.items(), key=lambda item: -item[1])[:num_top]
        top = [TopLogprob(token=texts.text(t), logprob=lp, bytes=texts.get(t)[1]) for t, lp in ranked]
        logprob = entry.get(token_id, float("-inf"))
        out.append(ChatLogprobToken(token=text, logprob=logprob, bytes=raw, top_logprobs=top))
    return out
