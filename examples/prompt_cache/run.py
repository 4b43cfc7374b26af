"""Prompt Cache examples: register three PML schemas, run their prompts, compare time to first token.

For every prompt the script runs the PML prompt (module KV reused from the cache, only the new tokens
computed) and then the same tokens as a plain token-id prompt, computed from scratch: the prompt's
tokens in schema-position order, which is the prompt a model without Prompt Cache would be sent.
Prefix caching is off so that the plain runs cannot reuse each other's blocks; Prompt Cache does not
need it.

    .venv/bin/python examples/prompt_cache/run.py [--max-tokens 32] [--tier device|host] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvserve import LLM, SamplingParams
from kvserve.core.outputs import RequestOutput
from kvserve.prompt_cache.pml import parse_prompt, parse_schema
from kvserve.prompt_cache.roles import RoleFrames
from kvserve.prompt_cache.schema import SchemaLayout
from kvserve.text.tokenizer import Tokenizer

HERE = Path(__file__).resolve().parent


def plain_equivalent(
    layout: SchemaLayout, pml_prompt: str, tokenizer: Tokenizer, frames: RoleFrames | None
) -> tuple[list[str], list[int]]:
    """The modules a prompt imports, and all its tokens (modules, arguments, new text) in position order."""
    bound = layout.bind(parse_prompt(pml_prompt), tokenizer, frames)
    tokens = list(zip(bound.positions, bound.token_ids, strict=True))
    for name in bound.modules:
        module = layout.modules[name]
        tokens += zip(module.positions, module.token_ids, strict=True)
    return bound.modules, [token for _, token in sorted(tokens)]


def ttft(output: RequestOutput) -> float:
    return output.metrics["first_token_time"] - output.metrics["arrival_time"]


def print_layout(info: dict) -> None:
    print(f"\nschema {info['name']!r}: {info['num_positions']} positions")
    for name, module in info["modules"].items():
        params = ", ".join(f"{p} (len {n})" for p, n in module["params"].items())
        span = f"{module['start']:>4}-{module['end'] - 1:<4}"
        line = f"  {name or '(schema text)':<16} positions {span} {module['tokens']:>4} tokens"
        print(f"{line}  params: {params}" if params else line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (greedy)")
    parser.add_argument("--tier", choices=("device", "host"), default="device", help="where module KV is kept")
    parser.add_argument("--repeat", type=int, default=1, help="run each prompt this often; report the fastest TTFT")
    args = parser.parse_args()

    llm = LLM(prompt_cache_tier=args.tier, enable_prefix_caching=False)
    tokenizer = llm.get_tokenizer()
    frames = RoleFrames.from_tokenizer(tokenizer)  # the chat template's role framing, as the engine renders it
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.generate("Hello", SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # warm-up

    for file_name, prompts in json.loads((HERE / "prompts.json").read_text()).items():
        schema_text = (HERE / file_name).read_text()
        print_layout(llm.register_schema(schema_text))  # encodes every module now
        layout = SchemaLayout.build(parse_schema(schema_text), tokenizer, frames)
        for pml_prompt in prompts:
            modules, plain_ids = plain_equivalent(layout, pml_prompt, tokenizer, frames)
            # Greedy, so every repeat gives the same output; the fastest repeat is the steadiest TTFT.
            cached = min((llm.generate(pml_prompt, greedy, use_tqdm=False)[0] for _ in range(args.repeat)), key=ttft)
            plain = min((llm.generate(plain_ids, greedy, use_tqdm=False)[0] for _ in range(args.repeat)), key=ttft)
            print(f"\n--- {file_name}: imports {', '.join(m for m in modules if m)}")
            print(f"    {len(cached.prompt_token_ids)} prompt tokens, {cached.num_cached_tokens} from cached modules")
            print(f"    {'TTFT with Prompt Cache:':<41}{ttft(cached) * 1000:8.1f} ms")
            print(f"    {'TTFT, same tokens computed from scratch:':<41}{ttft(plain) * 1000:8.1f} ms "
                  f"({ttft(plain) / ttft(cached):.1f}x)")  # fmt: skip
            print(f"    output: {cached.outputs[0].text.strip()!r}")
            same = cached.outputs[0].token_ids == plain.outputs[0].token_ids
            print(f"    plain output: {'the same' if same else repr(plain.outputs[0].text.strip())}")


if __name__ == "__main__":
    main()
