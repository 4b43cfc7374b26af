"""``--chat-template`` / ``--tokenizer`` and ``LLM(chat_template=..., tokenizer=...)``: the rendered chat prompt is the
custom template's, a tokenizer from elsewhere tokenizes the prompts, and a bad template or tokenizer is a clear
error (tiny checkpoint, the default model, and the command line)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvserve.entrypoints.llm import LLM
from kvserve.errors import ModelLoadError
from kvserve.models.catalog import default_model_path
from kvserve.models.tokenizer_override import load_tokenizer
from kvserve.sampling.sampling_params import SamplingParams
from tests.tiny_models import (  # noqa: F401 - torch_single_thread is an autouse fixture
    BOS_ID,
    TinySpec,
    build_tiny_tokenizer,
    torch_single_thread,
    write_tiny_model,
)

TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### ASSISTANT:{% endif %}"
)
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat sat"}]
RENDERED = "### SYSTEM: be brief\n### USER: the cat sat\n### ASSISTANT:"
GREEDY = SamplingParams(max_tokens=4, temperature=0)
OPTIONS = {"dtype": "float32", "kv_cache_memory": "1MiB", "swap_space": 0}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("template"), TinySpec(seed=11))


@pytest.mark.parametrize("as_file", [True, False])
def test_llm_chat_renders_the_custom_template(folder, tmp_path, as_file):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    with LLM(str(folder), chat_template=str(path) if as_file else TEMPLATE, **OPTIONS) as llm:
        tokenizer = llm.get_tokenizer()
        assert tokenizer.apply_chat_template(MESSAGES) == RENDERED
        chat = llm.chat(MESSAGES, GREEDY, use_tqdm=False)[0]
        plain = llm.generate({"prompt_token_ids": tokenizer.encode(RENDERED, add_special_tokens=False)}, GREEDY)[0]
    assert chat.prompt_token_ids == plain.prompt_token_ids
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    with LLM(str(folder), **OPTIONS) as own:  # the model's own template renders something else
        assert own.chat(MESSAGES, GREEDY, use_tqdm=False)[0].prompt_token_ids != chat.prompt_token_ids


def test_a_tokenizer_from_a_tokenizer_json_replaces_the_models(folder, tmp_path):
    other = tmp_path / "elsewhere" / "no-bos.json"
    other.parent.mkdir()
    build_tiny_tokenizer(add_bos=False).save(str(other))
    with LLM(str(folder), **OPTIONS) as own, LLM(str(folder), tokenizer=str(other), **OPTIONS) as custom:
        with_bos = own.generate("the cat", GREEDY, use_tqdm=False)[0].prompt_token_ids
        without = custom.generate("the cat", GREEDY, use_tqdm=False)[0].prompt_token_ids
    assert with_bos[0] == BOS_ID and with_bos[1:] == without


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{% for m in messages %}{{ m.content }}", "chat template (inline), line 1: Unexpected end of template"),
        ("{{ messages | no_such_filter }}", "chat template (inline), line 1: No filter named 'no_such_filter'"),
        ("{{ raise_exception('needs a system message') }}", "fails on a one-message chat: needs a system message"),
        ("missing.jinja", "chat template 'missing.jinja' is neither a readable file (No such file or directory)"),
    ],
)
def test_a_bad_template_is_a_clear_error(folder, template, message):
    with pytest.raises(ValueError) as info:
        LLM(str(folder), chat_template=template, **OPTIONS)
    assert message in str(info.value)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(folder):
    with pytest.raises(ModelLoadError, match="the tokenizer has 49152 tokens, more than the model's vocabulary of 300"):
        LLM(str(folder), tokenizer=str(default_model_path()), **OPTIONS)
    with pytest.raises(ModelLoadError, match="tokenizer 'nowhere.txt' is not a folder with tokenizer.json"):
        LLM(str(folder), tokenizer="nowhere.txt", **OPTIONS)


@pytest.mark.slow
def test_generate_with_a_bad_template_fails_in_one_line(folder):
    command = [sys.executable, "-m", "kvserve", "generate", "--model", str(folder), "--chat-template",
               "{% if %}", "--chat", "hi"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("kvserve: error: chat template (inline), line 1: ")
    assert result.stderr.count("\n") == 1, result.stderr


@pytest.mark.real_model
def test_the_default_model_chats_with_a_custom_template_and_tokenizer(tmp_path):
    template = tmp_path / "chatml-plain.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    options = {"dtype": "float32", "kv_cache_memory": "32MiB", "swap_space": 0}
    with LLM(chat_template=str(template), tokenizer=str(default_model_path()), **options) as llm:
        ids = llm.get_tokenizer().encode(expected, add_special_tokens=False)
        chat = llm.chat(messages, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
    assert chat.prompt_token_ids == ids
    assert load_tokenizer(str(default_model_path())).encode_chat(messages) != ids  # its own adds a system turn
    assert "Paris" in chat.outputs[0].text
