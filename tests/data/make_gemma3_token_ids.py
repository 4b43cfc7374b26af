"""llama.cpp's token ids for a GGUF file's tokenizer: the reference the SentencePiece tests compare against.

Runs under an interpreter with ``llama_cpp`` (llama-cpp-python), so it imports only the standard library and
``llama_cpp``. Ids come from ``Llama(model, vocab_only=True).tokenize(text, add_bos=True, special=True)``.

Usage::

    python make_gemma3_token_ids.py MODEL.gguf          # writes gemma3_llamacpp_token_ids.json beside this file
    python make_gemma3_token_ids.py MODEL.gguf --stdin  # reads a JSON list of texts, prints {"llama_cpp", "ids"}
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import llama_cpp

OUT = Path(__file__).with_name("gemma3_llamacpp_token_ids.json")

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "",
    " ",
    "\n",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "multiple  spaces   between    words",
    "tabs\tand\t\tdouble tabs\t\t\tand more",
    "newlines\nsingle\n\ndouble\n\n\ntriple\n",
    "mixed \t \n whitespace \r\n windows line end",
    "a" + " " * 70 + "b" + "\t" * 35 + "c" + "\n" * 40 + "d",
    "日本語のテキストと中文，한국어 문장",
    "Привет, мир! Ελληνικά. עברית. العربية",
    "Hindi हिन्दी, Thai ภาษาไทย, Tamil தமிழ்",
    "emoji 🎉🚀 and 👩‍👩‍👧 family, flags 🇫🇷🇯🇵, skin 👋🏽",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 outside the BMP 𐍈 𓀀",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'int main(void) {\n\tprintf("%d\\n", 42);\n\treturn 0;\n}',
    '{"key": [1, 2, 3], "nested": {"a": null, "b": "x y"}}',
    "# Title\n\n- item 1\n- item 2\n\n```python\nprint('hi')\n```\n",
    "3.14159 2,718 1e-9 0x1F 12345678901234567890",
    "https://example.com/path?query=1&x=y#frag",
    "Don't won't it's we'll they're I'm",
    "naïve café façade Straße œuvre",
    "punctuation!!! ??? ... --- === *** ### @@@",
    "repeated hahahahahaha aaaaaaaaaaaaaaa ababababab",
    "literal piece markers \u2581 and \u2581\u2581 and byte text <0x41> <0xFF>",
    "zero width\u200bspace and nbsp\u00a0here",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after a literal bos<eos>",
    "<unused0> <pad> <mask> [multimodal] <start_of_image>",
    "<table><tr><td>cell</td></tr></table> <b>bold</b> <s>strike</s>",
]


def tokenize(model_path: str, texts: list[str]) -> list[list[int]]:
    llama = llama_cpp.Llama(model_path, vocab_only=True, verbose=False)
    return [llama.tokenize(text.encode(), add_bos=True, special=True) for text in texts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a GGUF file")
    parser.add_argument("--stdin", action="store_true", help="tokenize a JSON list of texts read from stdin")
    args = parser.parse_args()
    if args.stdin:
        ids = tokenize(args.model, json.load(sys.stdin))
        json.dump({"llama_cpp": llama_cpp.__version__, "ids": ids}, sys.stdout)
        return
    ids = tokenize(args.model, TEXTS)
    cases = [{"text": text, "ids": row} for text, row in zip(TEXTS, ids, strict=True)]
    head = {"model": Path(args.model).name, "llama_cpp": llama_cpp.__version__}
    rows = ",\n  ".join(json.dumps(case, ensure_ascii=False) for case in cases)  # one text per line
    OUT.write_text(json.dumps(head, ensure_ascii=False)[:-1] + f', "cases": [\n  {rows}\n]}}\n')
    print(f"wrote {len(cases)} texts to {OUT}")


if __name__ == "__main__":
    main()
