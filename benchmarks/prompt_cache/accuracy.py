"""L-Eval QuALITY with Prompt Cache against the plain prompts, in one run (same model, same engine options).

Each document (truncated to the context as the baseline truncates it) becomes a Prompt Cache module
encoded alone, so it no longer attends to the chat template and instruction before it; each question
is a PML prompt importing it. Everything else (positions, greedy decoding, scoring) is the baseline's.
Writes accuracy.json and accuracy.md next to this script.

    .venv/bin/python benchmarks/prompt_cache/accuracy.py --threads 2

With ``--modules N`` each document is cut into N modules encoded alone (they no longer attend to each
other either), and plain prompts, Prompt Cache and Prompt Cache with ``--recompute R`` (selective
recompute, CacheBlend) answer the same questions; besides option accuracy, the first answer token's
distribution is compared with the plain prompt's (L1 distance over the union of both top-20 tokens, and
whether the top token agrees). Writes accuracy-recompute.json and .md (``--output`` names another stem).

    .venv/bin/python benchmarks/prompt_cache/accuracy.py --threads 2 --modules 4 --recompute 0.15 --limit 3
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.core.outputs import RequestOutput
from kvserve.entrypoints.llm import LLM
from kvserve.eval.longqa import (
    DEFAULT_MAX_TOKENS,
    Document,
    build_prompts,
    evaluate_longqa,
    load_documents,
    pml_prompts,
    score_answer,
)
from kvserve.models.dtype import DTYPE_NAMES
from kvserve.models.loader import LoadedModel, load_model
from kvserve.platform.machine import describe_machine
from kvserve.prompt_cache.pml import pml_escape
from kvserve.sampling.sampling_params import SamplingParams
from kvserve.text.tokenizer import Tokenizer

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model name or path (default: SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--chat-template", default=None, help="a Jinja template (file or inline) for a model without one (a base model)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--limit", type=int, default=None, help="first N documents (default: all 15)")
    parser.add_argument("--modules", type=int, default=0, help="cut each document into N modules (recompute run)")
    parser.add_argument("--recompute", type=float, default=0.15, help="share recomputed in the --modules run")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens at most in the --modules run")
    parser.add_argument(
        "--output", default="accuracy-recompute", help="the --modules run's file stem beside this script"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    loaded = load_model(args.model, dtype=dtype, chat_template=args.chat_template)
    if args.modules:
        recompute_run(loaded, args, dtype)
        return
    runs = {}
    for prompt_cache in (False, True):
        engine = LLMEngine(EngineConfig(dtype=args.dtype, kv_cache_memory="2GiB", swap_space=0), loaded)
        runs[prompt_cache] = evaluate_longqa(engine, "quality", limit=args.limit, prompt_cache=prompt_cache)
    base, cached = runs[False]["questions"], runs[True]["questions"]
    same = sum(b["letter"] == c["letter"] for b, c in zip(base, cached, strict=True))
    gained = sum(c["score"] > b["score"] for b, c in zip(base, cached, strict=True))
    lost = sum(c["score"] < b["score"] for b, c in zip(base, cached, strict=True))
    summary = {
        "model": loaded.path.name, "dtype": DTYPE_NAMES[dtype], "threads": args.threads,
        "machine": describe_machine(), "questions": len(base), "documents": runs[False]["num_documents"],
        "context": runs[False]["context"],
        "baseline": {k: runs[False][k] for k in ("score", "score_stderr", "seconds", "cached_prompt_tokens")},
        "prompt_cache": {k: runs[True][k] for k in ("score", "score_stderr", "seconds", "cached_prompt_tokens")},
        "difference_points": 100 * (runs[True]["score"] - runs[False]["score"]),
        "same_answer_letter": same, "right_only_with_prompt_cache": gained, "right_only_without": lost,
    }  # fmt: skip
    (HERE / "accuracy.json").write_text(json.dumps({**summary, "runs": runs}, indent=2) + "\n")
    b, c = summary["baseline"], summary["prompt_cache"]
    m = summary["machine"]
    table = "\n".join([
        f"# L-Eval QuALITY: Prompt Cache vs plain prompts, {summary['model']}, {summary['dtype']}",
        "",
        f"`python benchmarks/prompt_cache/accuracy.py --threads {args.threads}` on {m['cpu']}, {m['nproc']} CPUs, "
        f"torch {m['torch']}, {args.threads} threads. {summary['questions']} questions over {summary['documents']} "
        f"documents, prompts of at most {summary['context']} tokens, greedy, option letter scored.",
        "",
        "| prompts | option accuracy | stderr | prompt tokens from a cache | time (s) |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| plain (prefix caching on) | {b['score']:.4f} | {b['score_stderr']:.4f} | {b['cached_prompt_tokens']:,} | "
        f"{b['seconds']:.0f} |",
        f"| Prompt Cache (document = module) | {c['score']:.4f} | {c['score_stderr']:.4f} | "
        f"{c['cached_prompt_tokens']:,} | {c['seconds']:.0f} |",
        "",
        f"Difference: {summary['difference_points']:+.1f} points. Same answer letter on {same} of {len(base)} "
        f"questions; right only with Prompt Cache: {gained}, right only without: {lost}.",
    ]) + "\n"  # fmt: skip
    (HERE / "accuracy.md").write_text(table)
    print(table)


def split_schema(
    tokenizer: Tokenizer, task: str, document: Document, kept: str, name: str, parts: int
) -> tuple[str, list[str]]:
    """``pml_prompts``' schema and prompts with the document module cut into ``parts`` modules (by tokens)."""
    schema, prompts = pml_prompts(tokenizer, task, document, kept, name)
    ids = tokenizer.encode(kept, add_special_tokens=False)
    size = -(-len(ids) // parts)
    texts = [tokenizer.decode(ids[i * size : (i + 1) * size]) for i in range(parts)]
    modules = "".join(f'<module name="doc{i}">{pml_escape(t)}</module>' for i, t in enumerate(texts))
    schema = schema.replace(f'<module name="doc">{pml_escape(kept)}</module>', modules)
    imports = "".join(f"<doc{i}/>" for i in range(parts))
    return schema, [p.replace("<doc/>", imports) for p in prompts]


def first_token(out: RequestOutput) -> dict[int, float]:
    return out.outputs[0].logprobs[0]


def l1_top(a: dict[int, float], b: dict[int, float]) -> float:
    """L1 distance of two next-token distributions over the union of their top tokens (a missing one: 0)."""
    return sum(abs(math.exp(a.get(t, -math.inf)) - math.exp(b.get(t, -math.inf))) for t in set(a) | set(b))


def recompute_run(loaded: LoadedModel, args: argparse.Namespace, dtype: torch.dtype) -> None:
    task, tokenizer = "quality", loaded.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=DEFAULT_MAX_TOKENS[task], logprobs=20)
    documents = load_documents(task, args.limit)
    # (recompute share, what a module attends to while encoded): Prompt Cache's rule (alone) and kvserve's default
    # (after the schema's prefix: BOS, system turn).
    recompute = f"prompt cache + recompute {args.recompute}"
    variants = {
        "plain": (0.0, "prefix"), "prompt cache, modules alone": (0.0, "none"),
        f"{recompute}, modules alone": (args.recompute, "none"),
        "prompt cache, modules after the prefix": (0.0, "prefix"),
        f"{recompute}, modules after the prefix": (args.recompute, "prefix"),
    }  # fmt: skip
    outputs: dict[str, list] = {v: [] for v in variants}
    seconds = dict.fromkeys(variants, 0.0)
    golds = []
    for number, document in enumerate(documents):
        built = build_prompts(tokenizer, task, document, args.context)
        kept = tokenizer.decode(tokenizer.encode(document.text, add_special_tokens=False)[: built.kept_tokens])
        name = f"blend-{number}"
        schema, pml = split_schema(tokenizer, task, document, kept, name, args.modules)
        golds += document.answers
        for variant, (share, context) in variants.items():
            # A model with sliding-window layers (Gemma 3) keeps every layer in one KV group for Prompt Cache.
            config = EngineConfig(
                dtype=args.dtype, kv_cache_memory="1GiB", swap_space=0, prompt_cache_recompute=share,
                prompt_cache_context=context, kv_window_groups=False,
            )  # fmt: skip
            llm = LLM.from_engine(LLMEngine(config, loaded))
            start = time.perf_counter()
            if variant == "plain":
                outputs[variant] += llm.generate(built.prompts, params, use_tqdm=False)
            else:
                llm.engine.register_schema(schema)
                outputs[variant] += llm.generate(pml, params, use_tqdm=False)
            seconds[variant] += time.perf_counter() - start
        print(f"document {number + 1}/{len(documents)}: {len(pml)} questions", flush=True)
    plain = [first_token(o) for o in outputs["plain"]]
    summary = {}
    for variant, outs in outputs.items():
        firsts = [first_token(o) for o in outs]
        summary[variant] = {
            "option_acc": statistics.mean(
                score_answer(task, o.outputs[0].text, g)["option_acc"] for o, g in zip(outs, golds, strict=True)
            ),
            "l1_to_plain": statistics.mean(l1_top(f, p) for f, p in zip(firsts, plain, strict=True)),
            "top1_agrees_with_plain": statistics.mean(
                float(max(f, key=f.get) == max(p, key=p.get)) for f, p in zip(firsts, plain, strict=True)
            ),
            "answer_agrees_with_plain": statistics.mean(
                float(o.outputs[0].text == q.outputs[0].text) for o, q in zip(outs, outputs["plain"], strict=True)
            ),
            "seconds": seconds[variant],
        }
    report = {
        "model": loaded.path.name, "dtype": DTYPE_NAMES[dtype], "threads": args.threads,
        "machine": describe_machine(), "documents": len(documents), "questions": len(golds),
        "context": args.context, "modules": args.modules, "recompute": args.recompute, "results": summary,
    }  # fmt: skip
    (HERE / f"{args.output}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# L-Eval QuALITY, document cut into {args.modules} modules: selective recompute, {report['model']}, "
        f"{report['dtype']}",
        "",
        f"`python benchmarks/prompt_cache/accuracy.py{' --model ' + args.model if args.model else ''}"
        f"{' --chat-template ' + args.chat_template if args.chat_template else ''} --threads "
        f"{args.threads} --dtype {args.dtype} --modules "
        f"{args.modules} --recompute {args.recompute} --limit {args.limit} --context {args.context} --output "
        f"{args.output}`: {len(golds)} questions over "
        f"{len(documents)} documents, greedy.",
        "",
        "| prompts | option accuracy | first-token L1 to plain (top-20) | top-1 = plain | answer = plain | time (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for variant, r in summary.items():
        lines.append(
            f"| {variant} | {r['option_acc']:.3f} | {r['l1_to_plain']:.4f} | {r['top1_agrees_with_plain']:.3f} | "
            f"{r['answer_agrees_with_plain']:.3f} | {r['seconds']:.0f} |"
        )
    (HERE / f"{args.output}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
