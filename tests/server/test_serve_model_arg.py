"""``kvserve serve MODEL --chat-template FILE`` as a user runs it: the positional model, and chat completions rendered
with the custom template (the official openai client against a subprocess on loopback)."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from kvserve.models.tokenizer_override import load_tokenizer
from tests.server.test_serve_cli import free_port, interrupt, wait_for_health

TEMPLATE = (
    "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<<assistant>>{% endif %}"
)


@pytest.mark.slow
def test_serve_takes_the_model_positionally_and_chats_with_the_custom_template(tiny_folder, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    port = free_port()
    command = [
        sys.executable, "-m", "kvserve", "serve", str(tiny_folder), "--chat-template", str(template),
        "--port", str(port), "--threads", "1", "--kv-cache-memory", "8MiB", "--log-level", "warning",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_health(process, port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert client.models.list().data[0].id == str(tiny_folder)  # served under the name it was given
        messages = [{"role": "user", "content": "the cat sat"}]
        chat = client.chat.completions.create(model=str(tiny_folder), messages=messages, max_tokens=5, temperature=0)
        rendered = "<<user>> the cat sat\n<<assistant>>"
        ids = load_tokenizer(str(tiny_folder)).encode(rendered, add_special_tokens=False)
        plain = client.completions.create(model=str(tiny_folder), prompt=ids, max_tokens=5, temperature=0)
    finally:
        stderr = interrupt(process)
    assert process.returncode == 0, stderr
    assert chat.usage.prompt_tokens == len(ids) == plain.usage.prompt_tokens
    assert chat.choices[0].message.content == plain.choices[0].text
