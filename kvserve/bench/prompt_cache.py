"""Time to first token with Prompt Cache against no cache and against automatic prefix caching.

The workload is the paper's long-document one: an L-Eval document (QuALITY stories, concatenated and
cut to N tokens) is a schema's module, and each request imports it and asks one question as new
text. With ``layout="behind-parameter"`` a short module with a per-request parameter (the reader's
name) comes before the document, as a personalised prompt would: the plain prompts then differ from
their first block on. Per document length, each method gets its own engine over the same loaded model
and answers the same questions with the same token ids (the Prompt Cache prompt's tokens in position
order), one request at a time:

- ``no cache``: prefix caching off, every prompt computed from scratch;
- ``prefix cache``: automatic prefix caching, warmed by one question first (the document is the
  prompt's prefix here, the case prefix caching handles; Prompt Cache's gain over it is for modules
  that are not a prefix);
- ``prompt cache (device)`` / ``(host)``: the schema registered first (its encoding timed apart), the
  module KV in blocks of the KV pool, or in CPU memory copied in per request.

TTFT is the request's arrival to its first sampled token, the median over the measured questions.
Memory per cached token: the bytes the stored module takes in its tier over its token count.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from kvserve.config import EngineConfig
from kvserve.core.engine import LLMEngine
from kvserve.eval.data import LEVAL, require
from kvserve.models.loader import LoadedModel
from kvserve.prompt_cache.pml import pml_escape
from kvserve.sampling.sampling_params import SamplingParams

METHODS = ("no cache", "prefix cache", "prompt cache (device)", "prompt cache (host)", "prompt cache + recompute")
LAYOUTS = ("prefix", "behind-parameter", "modules")
NUM_MODULES = 4  # layout "modules": the document cut into this many modules, each encoded alone
READERS = ("Ada", "Grace Hopper", "Alan", "Edsger W. Dijkstra", "Barbara", "Ken Thompson", "Frances", "Donald")
_FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass
class TTFTResult:
    method: str
    document_tokens: int
    prompt_tokens: int
    ttft_s: list[float]  # one per measured question
    computed_tokens: float  # prompt tokens computed before the first token (mean over questions)
    setup_s: float  # one-time work before the measured questions: encoding the schema, or the warm-up
    bytes_per_cached_token: float | None  # Prompt Cache: the stored module's bytes / its tokens

    @property
    def median_ttft_s(self) -> float:
        return statistics.median(self.ttft_s)

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "median_ttft_s": self.median_ttft_s}


def leval_text_and_questions(limit_questions: int) -> tuple[str, list[str]]:
    """All QuALITY stories joined (enough for 8k tokens) and the first questions (the options cut off)."""
    text, questions = [], []
    with require(LEVAL / "quality.jsonl", "L-Eval QuALITY data").open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            text.append(row["input"])
            questions += [q.split("\n")[0].strip() for q in row["instructions"]]
    return "\n\n".join(text), questions[:limit_questions]


def schema_and_prompts(
    name: str, document: str, questions: list[str], layout: str, name_tokens: int = 8
) -> tuple[str, list[str]]:
    """The document as a module; each question as new text after it (text kept exactly). ``behind-parameter``:
    a ``reader`` module with a ``name`` parameter of ``name_tokens`` first, a different reader per question."""
    head = f'<module name="reader">Reader: <param name="name" len="{name_tokens}"/>.\n\n</module>'
    head = head if layout != "prefix" else ""
    doc = f'<module name="doc">{pml_escape(document)}</module>'
    schema = f'<schema name="{name}" xml:space="preserve">{head}{doc}</schema>'
    prompts = []
    for i, question in enumerate(questions):
        reader = f'<reader name="{READERS[i % len(READERS)]}"/>' if layout != "prefix" else ""
        new_text = pml_escape(question_text(question))
        prompts.append(f'<prompt schema="{name}" xml:space="preserve">{reader}<doc/>{new_text}</prompt>')
    return schema, prompts


def modules_schema_and_prompts(name: str, parts: list[str], questions: list[str]) -> tuple[str, list[str]]:
    """Layout ``modules``: each part of the document a module of its own (they do not attend to each other); each
    question imports them all, in order, and asks as new text."""
    modules = "".join(f'<module name="doc{i}">{pml_escape(part)}</module>' for i, part in enumerate(parts))
    schema = f'<schema name="{name}" xml:space="preserve">{modules}</schema>'
    imports = "".join(f"<doc{i}/>" for i in range(len(parts)))
    prompts = [
        f'<prompt schema="{name}" xml:space="preserve">{imports}{pml_escape(question_text(q))}</prompt>'
        for q in questions
    ]
    return schema, prompts


def plain_token_ids(engine: LLMEngine, pml: str) -> list[int]:
    """The PML prompt's tokens in position order: what the same request would send without Prompt Cache."""
    prepared = engine.prompt_cache.prepare(pml)
    engine.prompt_cache.release(prepared.modules)
    return [t for _, t in sorted(zip(prepared.positions, prepared.token_ids, strict=True))]


def question_text(question: str) -> str:
    return f"\n\nQuestion: {question}\nAnswer:"


def time_to_first_token(engine: LLMEngine, prompt: str | list[int]) -> tuple[float, int, list[int]]:
    """(TTFT seconds, prompt tokens computed, prompt token ids) of one request run alone."""
    start = time.perf_counter()
    engine.add_request(prompt, _FIRST_TOKEN)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()  # a step that encodes a module reports nothing
    out = outputs[-1]
    ttft = time.perf_counter() - start
    return ttft, len(out.prompt_token_ids) - out.num_cached_tokens, list(out.prompt_token_ids)


def warm_up(loaded: LoadedModel, options: dict, text_ids: list[int]) -> None:
    """Run prompts of a few sizes once so that no method pays for first-call kernel set-up."""
    engine = LLMEngine(EngineConfig(**options, enable_prefix_caching=False), loaded)
    for n in (1, 3, 30, 600):
        time_to_first_token(engine, text_ids[:n])


def run_length(
    loaded: LoadedModel, options: dict, tokens: int, text_ids: list[int], questions: list[str], layout: str,
    log: Callable[[str], None], recompute: float = 0.0,
) -> list[TTFTResult]:  # fmt: skip
    """Every method at one document length; ``questions[0]`` warms the prefix cache, the rest are measured.
    ``recompute`` > 0 adds Prompt Cache with that share of the module tokens recomputed (device tier)."""
    schema, prompts = _workload(loaded, tokens, text_ids, questions, layout)
    results, token_ids = [], []
    engines = [("device", 0.0), ("host", 0.0)] + ([("device", recompute)] if recompute else [])
    for tier, share in engines:
        # With recompute, no prefix caching: a question would find the blocks an earlier one recomputed (same
        # modules, same share) and skip the recompute this run times.
        config = EngineConfig(**options, prompt_cache_tier=tier, prompt_cache_recompute=share,
                              enable_prefix_caching=not share)  # fmt: skip
        engine = LLMEngine(config, loaded)
        start = time.perf_counter()
        engine.register_schema(schema)
        engine.encode_modules()
        setup = time.perf_counter() - start
        info = engine.prompt_cache.info(f"leval-{tokens}").to_dict()
        runs = [time_to_first_token(engine, p) for p in prompts[1:]]
        token_ids = [plain_token_ids(engine, p) for p in prompts]
        store = engine.prompt_cache.store
        per_token = store.memory_bytes() / sum(m["tokens"] for m in info["modules"].values())
        doc_tokens = sum(m["tokens"] for n, m in info["modules"].items() if n.startswith("doc"))
        method = f"prompt cache ({tier})" if not share else "prompt cache + recompute"
        results.append(_result(method, doc_tokens, runs, setup, per_token))
    doc_tokens = results[0].document_tokens
    engine = LLMEngine(EngineConfig(**options, enable_prefix_caching=True), loaded)
    setup = time_to_first_token(engine, token_ids[0])[0]
    results.append(_result("prefix cache", doc_tokens, [time_to_first_token(engine, ids) for ids in token_ids[1:]],
                           setup))  # fmt: skip
    engine = LLMEngine(EngineConfig(**options, enable_prefix_caching=False), loaded)
    results.append(_result("no cache", doc_tokens, [time_to_first_token(engine, ids) for ids in token_ids[1:]], 0.0))
    for r in results:
        log(f"  {tokens} tokens, {r.method}: median TTFT {r.median_ttft_s * 1e3:.1f} ms, "
            f"{r.computed_tokens:.0f} tokens computed")  # fmt: skip
    return sorted(results, key=lambda r: METHODS.index(r.method))


def _workload(
    loaded: LoadedModel, tokens: int, text_ids: list[int], questions: list[str], layout: str
) -> tuple[str, list[str]]:
    """The schema and the PML prompts of one document length."""
    name = f"leval-{tokens}"
    if layout == "modules":
        size = tokens // NUM_MODULES
        parts = [loaded.tokenizer.decode(text_ids[i * size : (i + 1) * size]) for i in range(NUM_MODULES)]
        return modules_schema_and_prompts(name, parts, questions)
    document = loaded.tokenizer.decode(text_ids[:tokens])
    name_tokens = max(8, *(len(loaded.tokenizer.encode(r, add_special_tokens=False)) for r in READERS))
    return schema_and_prompts(name, document, questions, layout, name_tokens)


def _result(
    method: str, doc_tokens: int, runs: list[tuple[float, int, list[int]]], setup: float, per_token: float | None = None
) -> TTFTResult:
    return TTFTResult(
        method, doc_tokens, len(runs[0][2]), [t for t, _, _ in runs], statistics.mean(c for _, c, _ in runs), setup,
        per_token,
    )  # fmt: skip


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"# Prompt Cache: time to first token ({report['layout']}), {report['model']}, {report['dtype']}",
        "",
        f"`{report['command']}` on {report['date']}: {m['cpu']}, {m['nproc']} CPUs, torch {m['torch']}, "
        f"{report['threads']} threads, weights {report['weights']}. {report['workload']}",
        "",
        "| document tokens | method | median TTFT (ms) | vs no cache | tokens computed | setup (s) | "
        "bytes / cached token |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for length in report["lengths"]:
        rows = [r for r in report["results"] if r["target_tokens"] == length]
        base = next(r for r in rows if r["method"] == "no cache")["median_ttft_s"]
        for r in rows:
            per_token = f"{r['bytes_per_cached_token']:,.0f}" if r["bytes_per_cached_token"] else ""
            lines.append(
                f"| {r['document_tokens']:,} | {r['method']} | {r['median_ttft_s'] * 1e3:,.1f} | "
                f"{base / r['median_ttft_s']:.1f}x | {r['computed_tokens']:.0f} | {r['setup_s']:.2f} | {per_token} |"
            )
    return "\n".join(lines) + "\n"
