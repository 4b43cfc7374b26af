"""SentencePiece vocabularies (GGUF ``tokenizer.ggml.model == "llama"``) as a ``tokenizers`` BPE model.

llama.cpp's ``llm_tokenizer_spm`` turns spaces into "▁" (and prepends one when ``add_space_prefix``), splits
the text into characters, then keeps merging the adjacent pair whose concatenation is a vocabulary token with
the highest score (ties: leftmost); characters left outside the vocabulary become ``<0xXX>`` byte tokens.
A BPE model whose merges are every two-token split of every token, ranked by the merged token's score, with
``byte_fallback`` on, runs the same algorithm (the transformers GGUF converter and ``tokenizers``'
``SentencePieceBPETokenizer`` build it the same way). Special tokens are added by the caller.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers

SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space


def sentencepiece_backend(
    tokens: Sequence[str], scores: Sequence[float], add_space_prefix: bool, unk_id: int | None
) -> BackendTokenizer:
    """The ``tokenizers`` equivalent of llama.cpp's SPM tokenizer over ``tokens`` and their ``scores``."""
    vocab = {token: index for index, token in enumerate(tokens)}  # a repeated token keeps its last id, as in llama.cpp
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    merges = score_ranked_merges(tokens, scores, vocab)
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=False, byte_fallback=True)
    backend = BackendTokenizer(model)
    backend.normalizer = _normalizer(add_space_prefix)
    backend.decoder = _decoder(add_space_prefix)
    return backend


def score_ranked_merges(
    tokens: Sequence[str], scores: Sequence[float], ids: dict[str, int] | None = None
) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary tokens, the merged token's best score first.

    Splits of one token stay together (shorter left part first). Distinct tokens with equal scores keep
    vocabulary order, where llama.cpp takes the leftmost pair in the text; real SentencePiece vocabularies
    give every normal piece its own score (byte tokens share 0.0 but only form from literal "<0xXX>" text).
    ``ids``: each text's id (its last copy's), when the caller has built it.
    """
    if ids is None:
        ids = {token: index for index, token in enumerate(tokens)}
    vocab = set(ids)  # a set looks up faster than the dict: 1.2M splits to try in a 262k vocabulary
    pairs: list[tuple[str, str]] = []
    owners: list[int] = []
    add_pair, add_owner = pairs.append, owners.append
    for index, token in enumerate(tokens):
        for cut in range(1, len(token)):
            left = token[:cut]
            if left in vocab:
                right = token[cut:]
                if right in vocab:
                    add_pair((left, right))
                    add_owner(index)
    if len(ids) < len(tokens):  # a repeated text merges once, as its last copy (the id llama.cpp keeps)
        kept = [i for i, owner in enumerate(owners) if ids[tokens[owner]] == owner]
        pairs, owners = [pairs[i] for i in kept], [owners[i] for i in kept]
    # Found in (token, cut) order, so a stable sort by score alone keeps that order among equal scores.
    order = np.argsort(-np.asarray(scores, np.float64)[owners], kind="stable")
    return [pairs[i] for i in order.tolist()]


def _normalizer(add_space_prefix: bool) -> normalizers.Normalizer:
    # Applied to each piece of text between special tokens, as llama.cpp prefixes each raw-text fragment.
    replace = normalizers.Replace(" ", SPACE)
    if not add_space_prefix:
        return replace
    return normalizers.Sequence([normalizers.Prepend(SPACE), replace])


def _decoder(add_space_prefix: bool) -> decoders.Decoder:
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # the prefixed space of the first token
    return decoders.Sequence(steps)
