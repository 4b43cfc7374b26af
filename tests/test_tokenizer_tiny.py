"""Tokenizer, incremental detokeniser and chat template on the tiny byte-level BPE tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from jinja2.exceptions import TemplateError

from kvserve.text.detokenizer import IncrementalDetokenizer
from kvserve.text.tokenizer import Tokenizer
from tests.tiny_models import BOS_ID, BOS_TOKEN, EOS_ID, EOS_TOKEN, VOCAB_SIZE, write_tokenizer

TEXTS = [
    "the cat sat on the mat",
    "héllo wörld, naïve café",
    "日本語のテキストと中文",
    "emoji 🎉🚀 and 👩‍👩‍👧 family",
    "mixed: abc 你好 🎉 ÿ \t tabs\n\nnew lines  double  spaces ",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 outside the BMP 𐍈",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder)
    return Tokenizer.from_hf_folder(folder)


def test_tokenizer_metadata(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == VOCAB_SIZE
    assert tokenizer.bos_token_id == BOS_ID
    assert tokenizer.eos_token_ids == (EOS_ID,)
    assert tokenizer.convert_ids_to_tokens([BOS_ID, EOS_ID]) == [BOS_TOKEN, EOS_TOKEN]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_roundtrip(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids[0] == BOS_ID and BOS_ID not in ids[1:]
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]
    assert tokenizer.decode(ids, skip_special_tokens=False) == BOS_TOKEN + text


def test_merges_are_used_and_multibyte_characters_span_tokens(tokenizer: Tokenizer) -> None:
    english = tokenizer.encode("the the the", add_special_tokens=False)
    assert len(english) < len("the the the")  # merges apply
    cjk = tokenizer.encode("你好世界", add_special_tokens=False)
    assert len(cjk) == len("你好世界".encode())  # one byte token per UTF-8 byte


def _stream(tokenizer: Tokenizer, prompt_ids: list[int], new_ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    return [detok.step(i) for i in new_ids]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_matches_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    deltas = _stream(tokenizer, ids[:1], ids[1:])
    full = tokenizer.decode(ids)
    assert "".join(deltas) == full
    emitted = ""
    for delta in deltas:
        assert "\ufffd" not in delta
        emitted += delta
        assert full.startswith(emitted)
    if any(len(ch.encode()) > 1 for ch in text):
        assert "" in deltas  # some byte tokens completed no character and were held back


def test_incremental_detokenizer_keeps_leading_space_after_prompt(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Hello")
    continuation = tokenizer.encode(" wörld 🎉 done", add_special_tokens=False)
    deltas = _stream(tokenizer, prompt, continuation)
    assert "".join(deltas) == " wörld 🎉 done"
    assert deltas[0].startswith(" ")  # the space survives: the prompt seeds the stream


def test_incremental_detokenizer_random_unicode(tokenizer: Tokenizer) -> None:
    rng = random.Random(0)
    alphabet = "ab cdé你好🎉ÿ\n€𐍈"
    for _ in range(30):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 25)))
        ids = tokenizer.encode(text)
        deltas = _stream(tokenizer, ids[:1], ids[1:])
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_skips_special_tokens(tokenizer: Tokenizer) -> None:
    a = tokenizer.encode("ab", add_special_tokens=False)
    b = tokenizer.encode(" 你", add_special_tokens=False)
    deltas = _stream(tokenizer, [BOS_ID], a + [EOS_ID] + b)
    assert "".join(deltas) == "ab 你"


# ----- chat template -----

MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi 🎉"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "and now?"},
]


def test_chat_template_renders(tokenizer: Tokenizer) -> None:
    with_prompt = tokenizer.apply_chat_template(MESSAGES)
    without = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert with_prompt.startswith(BOS_TOKEN)
    assert with_prompt == without + "<|assistant|>"
    position = 0
    for message in MESSAGES:
        chunk = f"<|{message['role']}|>{message['content']}{EOS_TOKEN}"
        found = without.find(chunk, position)
        assert found >= position, chunk
        position = found + len(chunk)
    # The rendered specials encode as the special tokens, not as their spelling.
    ids = tokenizer.encode(with_prompt, add_special_tokens=False)
    assert ids[0] == BOS_ID and ids.count(EOS_ID) == len(MESSAGES)


def test_encode_chat_has_exactly_one_bos(tokenizer: Tokenizer) -> None:
    """The template writes BOS itself; the post-processor must not add a second one."""
    ids = tokenizer.encode_chat(MESSAGES)
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    assert ids == tokenizer.encode(tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)


def test_chat_template_raise_exception(tmp_path: Path) -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}x"
    write_tokenizer(tmp_path, chat_template=template)
    tokenizer = Tokenizer.from_hf_folder(tmp_path)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "a"}]) == "x"
    with pytest.raises(TemplateError, match="first message must be user"):
        tokenizer.apply_chat_template([{"role": "system", "content": "a"}])


def test_chat_template_from_jinja_file(tmp_path: Path) -> None:
    write_tokenizer(tmp_path, chat_template=None)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    tokenizer = Tokenizer.from_hf_folder(tmp_path)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "q"}]) == "[q]"


def test_model_without_chat_template_raises(tmp_path: Path) -> None:
    write_tokenizer(tmp_path, chat_template=None)
    tokenizer = Tokenizer.from_hf_folder(tmp_path)
    assert tokenizer.chat_template is None
    with pytest.raises(ValueError, match="chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
