"""SentencePiece ("llama") GGUF tokenizers: llama.cpp's SPM rule on a tiny vocabulary, Gemma 3 against llama.cpp.

The tiny vocabulary's expected ids are worked out by hand from llama.cpp's ``llm_tokenizer_spm``: spaces become
"▁" (one prepended to each piece of text when ``add_space_prefix``), then the adjacent pair whose concatenation
is a token with the highest score merges first (ties: leftmost), and characters outside the vocabulary become
``<0xXX>`` byte tokens. Control tokens and user-defined tokens are matched in the text before any of that.
"""

from __future__ import annotations

import heapq
import json
import os
import random
import subprocess
from pathlib import Path

import gguf
import pytest

from kvserve.errors import ModelLoadError, UnsupportedModelError
from kvserve.models.gguf_file import open_gguf
from kvserve.text.detokenizer import IncrementalDetokenizer
from kvserve.text.sentencepiece import SPACE, score_ranked_merges, sentencepiece_backend
from kvserve.text.tokenizer import Tokenizer

DATA = Path(__file__).parent / "data"
REFERENCE = DATA / "gemma3_llamacpp_token_ids.json"
LLAMACPP_SCRIPT = DATA / "make_gemma3_token_ids.py"
LLAMACPP_PYTHON = "KVSERVE_LLAMACPP_PYTHON"

S = SPACE
UNKNOWN = ["<unk>"]
CONTROL = ["<s>", "</s>", "<turn>", "<end_of_turn>"]
USER_DEFINED = ["\n\n"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
SINGLES = [S, "a", "b", "c", "e", "h", "l", "o"]
# Multi-character pieces and their scores (all different, as in real SentencePiece vocabularies).
PIECES = {
    "ab": -5.0,
    "bc": -2.0,
    "aa": -4.0,
    "he": -10.0,
    "ll": -6.0,
    "llo": -3.0,
    "hell": -8.0,
    "hello": -1.5,
    f"{S}hello": -1.0,
    f"{S}a": -9.0,
    f"{S}b": -7.0,
}
TOKENS = UNKNOWN + CONTROL + USER_DEFINED + BYTES + SINGLES + list(PIECES)
ID = {token: index for index, token in enumerate(TOKENS)}
TYPES = [2] * len(UNKNOWN) + [3] * len(CONTROL) + [4] * len(USER_DEFINED) + [6] * len(BYTES)
TYPES += [1] * (len(SINGLES) + len(PIECES))
SCORES = [0.0] * (len(TOKENS) - len(SINGLES) - len(PIECES))
SCORES += [-100.0 - i for i in range(len(SINGLES))] + list(PIECES.values())
BOS, EOS = ID["<s>"], ID["</s>"]

# Texts with no special or user-defined tokens: these decode back to themselves in both modes.
PLAIN_TEXTS = ["abc", "hello", " hello", "a b", "hé", "aaaa", "  two leading", "trailing  ", "hello\tworld\n"]
UNICODE_TEXTS = ["emoji 🎉🚀 and 👩‍👩‍👧", "日本語のテキストと中文", "mixed: hello 你好 🎉 ÿ 𝔘𝔫𝔦 ab", "ab\U0001f600bc"]


def write_spm_gguf(path: Path, add_space_prefix: bool | None, kind: str = "llama", scores: bool = True) -> Path:
    """The tiny vocabulary as a vocabulary-only Llama GGUF (llama.cpp can load it with ``vocab_only``)."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model(kind)
    writer.add_token_list(TOKENS)
    if scores:
        writer.add_token_scores(SCORES)
    writer.add_token_types(TYPES)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_unk_token_id(ID["<unk>"])
    writer.add_add_bos_token(True)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=[True, False], ids=["space_prefix", "no_space_prefix"])
def tiny(request, tmp_path_factory) -> tuple[Tokenizer, bool, Path]:
    path = write_spm_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", add_space_prefix=request.param)
    return Tokenizer.from_gguf(open_gguf(path)), request.param, path


def expected(prefixed: list[str], bare: list[str], add_space_prefix: bool) -> list[int]:
    """BOS, then the hand-derived pieces for the mode in use."""
    return [BOS] + [ID[p] for p in (prefixed if add_space_prefix else bare)]


def test_metadata(tiny) -> None:
    tok, _, _ = tiny
    assert tok.vocab_size == len(TOKENS)
    assert tok.bos_token_id == BOS
    # llama.cpp takes <end_of_turn> as the end-of-turn token when the file names none.
    assert tok.eos_token_ids == (EOS, ID["<end_of_turn>"])
    assert tok.add_bos_token
    assert tok.chat_template is None


# (text, pieces with add_space_prefix, pieces without), each derived by hand from the SPM rule.
HAND_DERIVED = [
    # "bc" (-2) outscores "ab" (-5); then "▁" + "a" -> "▁a" (-9) when prefixed; "abc" is no token.
    ("abc", [f"{S}a", "bc"], ["a", "bc"]),
    # ll (-6) > he (-10): h e [ll] o -> h e [llo] (-3) -> [he] [llo] -> [hello] (-1.5) -> [▁hello] (-1).
    ("hello", [f"{S}hello"], ["hello"]),
    ("hell", [S, "hell"], ["hell"]),  # h e [ll] -> [he][ll] -> [hell]; "▁h" is no token
    # Equal scores: the leftmost pair merges first; "aa" (-4) outscores "▁a" (-9).
    ("aaa", [S, "aa", "a"], ["aa", "a"]),
    ("aaaa", [S, "aa", "aa"], ["aa", "aa"]),
    # "▁b" (-7) before "▁a" (-9).
    ("a b", [f"{S}a", f"{S}b"], ["a", f"{S}b"]),
    (" a", [S, f"{S}a"], [f"{S}a"]),
    # Characters outside the vocabulary fall back to their UTF-8 bytes.
    ("hé", [S, "h", "<0xC3>", "<0xA9>"], ["h", "<0xC3>", "<0xA9>"]),
    ("\n", [S, "<0x0A>"], ["<0x0A>"]),
    ("", [], []),
    # Control tokens are matched in the text; each piece of text after one gets its own "▁" prefix.
    ("<turn>hello</s>", ["<turn>", f"{S}hello", "</s>"], ["<turn>", "hello", "</s>"]),
    ("<s>abc", ["<s>", f"{S}a", "bc"], ["<s>", "a", "bc"]),
    ("<unk>", ["<unk>"], ["<unk>"]),
    # User-defined tokens are matched in the text too (as Gemma's newline and space runs are).
    ("a\n\nb", [f"{S}a", "\n\n", f"{S}b"], ["a", "\n\n", "b"]),
]


@pytest.mark.parametrize(("text", "prefixed", "bare"), HAND_DERIVED, ids=[repr(t[0]) for t in HAND_DERIVED])
def test_hand_derived_ids(tiny, text, prefixed, bare) -> None:
    tok, add_space_prefix, _ = tiny
    assert tok.encode(text) == expected(prefixed, bare, add_space_prefix)
    assert tok.encode(text, add_special_tokens=False) == expected(prefixed, bare, add_space_prefix)[1:]


def test_add_space_prefix_defaults_to_true(tmp_path) -> None:
    """llama.cpp prefixes a space when a "llama" GGUF does not say (older Llama 2 files)."""
    tok = Tokenizer.from_gguf(open_gguf(write_spm_gguf(tmp_path / "t.gguf", add_space_prefix=None)))
    assert tok.encode("abc") == expected([f"{S}a", "bc"], [], add_space_prefix=True)


@pytest.mark.parametrize("text", PLAIN_TEXTS + UNICODE_TEXTS)
def test_round_trip(tiny, text) -> None:
    tok, _, _ = tiny
    assert tok.decode(tok.encode(text)) == text


def test_decode_skips_special_tokens(tiny) -> None:
    tok, add_space_prefix, _ = tiny
    ids = tok.encode("<turn>hello</s>")
    assert tok.decode(ids) == "hello"
    shown = tok.decode(ids, skip_special_tokens=False)
    assert shown == ("<s><turn> hello</s>" if add_space_prefix else "<s><turn>hello</s>")


def test_unknown_character_without_byte_tokens_is_unk() -> None:
    tokens = ["<unk>", S, "a", f"{S}a"]
    backend = sentencepiece_backend(tokens, [0.0, -1.0, -2.0, -0.5], add_space_prefix=True, unk_id=0)
    assert backend.encode("az").ids == [3, 0]


def llamacpp_spm(text: str, add_space_prefix: bool) -> list[int]:
    """A direct port of llama.cpp's ``llm_tokenizer_spm_session::tokenize`` on the tiny vocabulary."""
    text = ((" " if add_space_prefix else "") + text).replace(" ", S)
    symbols = [[c, i - 1, i + 1 if i + 1 < len(text) else -1] for i, c in enumerate(text)]  # [text, prev, next]
    queue: list[tuple[float, int, int, int]] = []

    def try_add(left: int, right: int) -> None:
        merged = symbols[left][0] + symbols[right][0] if left >= 0 and right >= 0 else ""
        if merged in ID:
            heapq.heappush(queue, (-SCORES[ID[merged]], left, right, len(merged)))

    for i in range(1, len(symbols)):
        try_add(i - 1, i)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        lsym, rsym = symbols[left], symbols[right]
        if not lsym[0] or not rsym[0] or len(lsym[0]) + len(rsym[0]) != size:
            continue  # one side already merged elsewhere
        lsym[0], rsym[0], lsym[2] = lsym[0] + rsym[0], "", rsym[2]
        if rsym[2] >= 0:
            symbols[rsym[2]][1] = left
        try_add(lsym[1], left)
        try_add(left, lsym[2])
    pieces = [s for s, _, _ in symbols if s]
    return [i for p in pieces for i in ([ID[p]] if p in ID else [ID[f"<0x{b:02X}>"] for b in p.encode()])]


def test_random_texts_match_a_port_of_llamacpp(tiny) -> None:
    tok, add_space_prefix, _ = tiny
    rng = random.Random(0)
    alphabet = "abcehlo  é\t🎉"
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 16)))
        assert tok.encode(text, add_special_tokens=False) == llamacpp_spm(text, add_space_prefix), repr(text)


@pytest.mark.parametrize("text", UNICODE_TEXTS + PLAIN_TEXTS)
def test_incremental_detokenizer_matches_decode(tiny, text) -> None:
    """Byte-fallback pieces of one character and "▁" spaces stream out exactly as a full decode."""
    tok, _, _ = tiny
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(detok.step(i) for i in ids) == tok.decode(ids) == text


def test_incremental_detokenizer_after_a_prompt(tiny) -> None:
    tok, _, _ = tiny
    prompt, generated = tok.encode("hello"), tok.encode(" a b 🎉 hé", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = "".join(detok.step(i) for i in generated)
    assert tok.decode(prompt) + deltas == tok.decode(prompt + generated)


@pytest.mark.parametrize("kind", ["bert", "t5", "rwkv"])
def test_other_tokenizer_kinds_are_refused(tmp_path, kind) -> None:
    path = write_spm_gguf(tmp_path / f"{kind}.gguf", add_space_prefix=False, kind=kind)
    with pytest.raises(UnsupportedModelError, match=f"'{kind}'.*'gpt2'.*'llama'"):
        Tokenizer.from_gguf(open_gguf(path))


def test_missing_scores_are_an_error(tmp_path) -> None:
    path = write_spm_gguf(tmp_path / "noscores.gguf", add_space_prefix=False, scores=False)
    with pytest.raises(ModelLoadError, match=rf"{len(TOKENS)} tokens but none scores \(tokenizer.ggml.scores\)"):
        Tokenizer.from_gguf(open_gguf(path))


# ----- llama.cpp itself, when an interpreter with llama_cpp is named -----


def llamacpp_ids(model: Path, texts: list[str]) -> dict:
    """``{"llama_cpp": version, "ids": [...]}`` from llama.cpp run by ``$KVSERVE_LLAMACPP_PYTHON``."""
    python = os.environ.get(LLAMACPP_PYTHON)
    if not python:
        pytest.skip(f"set {LLAMACPP_PYTHON} to a Python with llama_cpp (llama-cpp-python) to compare live")
    run = subprocess.run(
        [python, str(LLAMACPP_SCRIPT), str(model), "--stdin"],
        input=json.dumps(texts),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if run.returncode != 0:
        pytest.fail(f"{LLAMACPP_SCRIPT.name} under {python} failed ({run.returncode}): {run.stderr[-2000:]}")
    return json.loads(run.stdout)


@pytest.mark.slow
def test_tiny_vocabulary_matches_llamacpp_live(tiny) -> None:
    tok, _, path = tiny
    texts = [t for t, _, _ in HAND_DERIVED] + PLAIN_TEXTS + UNICODE_TEXTS
    assert [tok.encode(t) for t in texts] == llamacpp_ids(path, texts)["ids"]


# ----- Gemma 3 270M (262,144-token SentencePiece vocabulary) -----

GEMMA_CASES = json.loads(REFERENCE.read_text())["cases"]


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    from kvserve.models.catalog import gemma3_270m_path

    return gemma3_270m_path()


@pytest.fixture(scope="module")
def gemma(gemma_path) -> Tokenizer:
    return Tokenizer.from_gguf(open_gguf(gemma_path))


@pytest.mark.real_model
def test_gemma_metadata(gemma) -> None:
    tokens = gemma.convert_ids_to_tokens([gemma.bos_token_id, *gemma.eos_token_ids])
    assert tokens == ["<bos>", "<eos>", "<end_of_turn>"]
    assert gemma.add_bos_token
    assert gemma.chat_template is None


@pytest.mark.real_model
@pytest.mark.parametrize("case", GEMMA_CASES, ids=[repr(c["text"][:30]) for c in GEMMA_CASES])
def test_gemma_ids_equal_llamacpp_reference(gemma, case) -> None:
    """Ids stored from llama.cpp by tests/data/make_gemma3_token_ids.py."""
    assert gemma.encode(case["text"]) == case["ids"]


@pytest.mark.real_model
@pytest.mark.parametrize("case", GEMMA_CASES, ids=[repr(c["text"][:30]) for c in GEMMA_CASES])
def test_gemma_round_trip_and_stream(gemma, case) -> None:
    ids = gemma.encode(case["text"])
    # A literal "▁" in the text is the space piece, so it decodes as a space.
    assert gemma.decode(ids, skip_special_tokens=False) == "<bos>" + case["text"].replace(S, " ")
    detok = IncrementalDetokenizer(gemma, [])
    assert "".join(detok.step(i) for i in ids) == gemma.decode(ids)


def random_gemma_texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    pieces = list("abcxyz ABC019.,;:!?'\"()[]{}<>=+-*/_\\|@#$%^&~`éüñçßø日本語中文한국어Привет") + [" "] * 8
    pieces += ["\t", "\n", "\r", "  ", "\n\n", "🎉", "👩‍👩‍👧", "🇫🇷", S, "\u00a0", "\u200b", "𝔘", "<0x41>", "hahaha"]
    pieces += ["the", "hello", "world", "def", "return", "    ", "====", "<start_of_turn>", "<end_of_turn>"]
    pieces += ["<bos>", "<b>", "</s>", "<unused3>", "[multimodal]", "tokenizer", "naïve"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 40))) for _ in range(count)]


@pytest.mark.slow
@pytest.mark.real_model
def test_gemma_ids_equal_llamacpp_live(gemma, gemma_path) -> None:
    texts = [c["text"] for c in GEMMA_CASES] + random_gemma_texts(300, seed=0)
    reference = llamacpp_ids(gemma_path, texts)
    differing = [t for t, ids in zip(texts, reference["ids"], strict=True) if gemma.encode(t) != ids]
    assert differing == [], f"llama_cpp {reference['llama_cpp']} tokenizes these differently"


def reference_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges by their definition: every split of a token (its last copy) into two vocabulary tokens, sorted
    by the merged token's score, then its id, then the cut."""
    ids = {token: index for index, token in enumerate(tokens)}
    ranked = sorted(
        (-scores[index], index, cut)
        for index, token in enumerate(tokens)
        if ids[token] == index
        for cut in range(1, len(token))
        if token[:cut] in ids and token[cut:] in ids
    )
    return [(tokens[index][:cut], tokens[index][cut:]) for _, index, cut in ranked]


@pytest.mark.parametrize("seed", range(5))
def test_score_ranked_merges_follow_their_definition(seed) -> None:
    """Random vocabularies with repeated texts, equal scores and NULs."""
    rng = random.Random(seed)
    alphabet = ["a", "b", "\x00", "é", S, "🎉"]
    for _ in range(100):
        tokens = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 5))) for _ in range(rng.randint(0, 60))]
        scores = [rng.choice([0.0, -1.0, -2.5, rng.uniform(-10, 0)]) for _ in tokens]
        assert score_ranked_merges(tokens, scores) == reference_merges(tokens, scores)
