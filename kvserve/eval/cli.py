"""``kvserve eval ppl | mc | longqa | needle | compare``.

Every eval builds its engine from the same options as ``serve`` (model, dtype, KV cache, prefix
caching, ...), prints its headline figure on the last line and writes a JSON report holding the full
configuration and the model's sha256.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

from kvserve.bench.results_dir import add_output_arg, output_path
from kvserve.entrypoints.engine_args import (
    add_engine_args,
    add_tokenizer_args,
    check_model_fit,
    describe_config,
    engine_config_from_args,
)
from kvserve.models.dtype import DTYPE_NAMES

PPL_CONTEXT = 2048
PPL_STRIDE = 512


def add_eval_parser(sub: argparse._SubParsersAction, add_model_args: Callable) -> None:
    from kvserve.eval.data import TEXTS
    from kvserve.eval.longqa import LONGQA_TASKS
    from kvserve.eval.multiple_choice import TASKS

    ev = sub.add_parser("eval", help="accuracy of any engine configuration: perplexity, multiple choice, long QA")
    evsub = ev.add_subparsers(dest="eval_command", required=True)

    ppl = evsub.add_parser("ppl", help="perplexity of a text with sliding windows")
    _add_common(ppl, add_model_args, likelihood=True)
    ppl.add_argument("--data", default="wikitext-2", help=f"{' | '.join(TEXTS)} | a text file")
    ppl.add_argument("--context", type=int, default=PPL_CONTEXT, help="tokens per window")
    ppl.add_argument("--stride", type=int, default=PPL_STRIDE, help="new tokens scored per window")
    ppl.add_argument("--limit-tokens", type=int, default=None, help="score only the text's first N tokens")
    add_output_arg(ppl, "ppl", "ppl-DATA-DTYPE.json", "the report, OUTPUT.json")
    ppl.set_defaults(func=cmd_ppl)

    mc = evsub.add_parser("mc", help="zero-shot multiple-choice accuracy from log-likelihoods")
    _add_common(mc, add_model_args, likelihood=True)
    mc.add_argument("--task", required=True, choices=TASKS)
    mc.add_argument("--limit", type=int, default=None, help="first N questions only")
    add_output_arg(mc, "mc", "mc-TASK-DTYPE.json", "the report, OUTPUT.json")
    mc.set_defaults(func=cmd_mc)

    qa = evsub.add_parser("longqa", help="L-Eval long-document tasks, documents truncated to the context")
    _add_common(qa, add_model_args, likelihood=False)
    qa.add_argument("--task", required=True, choices=LONGQA_TASKS)
    qa.add_argument("--context", type=int, default=None, help="prompt tokens at most (default: model's context "
                    "less --max-tokens)")  # fmt: skip
    qa.add_argument("--max-tokens", type=int, default=None, help="tokens generated per answer (default: per task)")
    qa.add_argument("--limit", type=int, default=None, help="first N documents only")
    qa.add_argument("--prompt-cache", action="store_true", help="each document a Prompt Cache module, each "
                    "question a PML prompt importing it (accuracy against the plain prompts)")  # fmt: skip
    add_output_arg(qa, "longqa", "longqa-TASK-DTYPE.json", "the report, OUTPUT.json")
    qa.set_defaults(func=cmd_longqa)

    needle = evsub.add_parser("needle", help="needle-in-a-haystack retrieval over Austen text, with a heatmap")
    _add_common(needle, add_model_args, likelihood=False)
    needle.add_argument("--lengths", default="1k,2k,4k,8k", help="haystack lengths in tokens, e.g. 1k,2k,4k,8k")
    needle.add_argument(
        "--depths", default="0..100%", help="needle depths: 0..100%% (11 steps), 0..100%%/5, or 0,50,100"
    )
    add_output_arg(needle, "needle", "needle-austen-DTYPE", "the report and heatmap, OUTPUT.json/.png")
    needle.set_defaults(func=cmd_needle)

    compare = evsub.add_parser("compare", help="table and plot of several eval reports")
    compare.add_argument("reports", nargs="+", type=Path, metavar="REPORT.json")
    add_output_arg(compare, "compare", "compare.png", "the plot, OUTPUT")
    compare.set_defaults(func=cmd_compare)


def _add_common(parser: argparse.ArgumentParser, add_model_args: Callable, likelihood: bool) -> None:
    add_model_args(parser)
    add_tokenizer_args(parser)
    add_engine_args(parser)
    if likelihood:
        parser.add_argument(
            "--backend", choices=("kvserve", "hf"), default="kvserve",
            help="hf: score with Hugging Face transformers on the same weights (the cross-check)",
        )  # fmt: skip


# ----- commands -----


def cmd_ppl(args: argparse.Namespace) -> int:
    from kvserve.eval.data import TEXTS, require
    from kvserve.eval.perplexity import evaluate_perplexity

    path = TEXTS.get(args.data) or Path(args.data).expanduser()
    text = require(path, "text").read_text(encoding="utf-8")
    session = _Session(args)
    tokens = session.tokenizer.encode(text, add_special_tokens=False)
    if args.limit_tokens is not None:
        if args.limit_tokens < 2:
            raise ValueError(f"--limit-tokens must be >= 2, got {args.limit_tokens}")
        tokens = tokens[: args.limit_tokens]
        text = session.tokenizer.decode(tokens)
    result = evaluate_perplexity(session.scorer(), tokens, text, args.context, args.stride)
    name = args.data if args.data in TEXTS else path.stem
    print(
        f"{result.num_windows:,} windows, {result.processed_tokens:,} tokens through the model in "
        f"{result.seconds:.1f} s ({result.processed_tokens / max(result.seconds, 1e-9):,.0f} tokens/s)"
    )
    headline = f"perplexity {result.perplexity:.3f} over {result.scored_tokens:,} tokens"
    options = {"data": str(path), "context": args.context, "stride": args.stride, "limit_tokens": args.limit_tokens}
    return session.finish("ppl", name, headline, result.as_dict(), options)


def cmd_mc(args: argparse.Namespace) -> int:
    from kvserve.eval.multiple_choice import evaluate_multiple_choice, load_questions

    questions = load_questions(args.task, args.limit)
    session = _Session(args)
    results = evaluate_multiple_choice(session.scorer(), session.tokenizer, args.task, questions)
    accuracy = f"{results['acc']:.4f} ± {results['acc_stderr']:.4f}"
    headline = f"{args.task} accuracy {accuracy} over {len(questions):,} questions"
    if "perplexity" in results:
        headline += f", perplexity {results['perplexity']:.3f}"
    return session.finish("mc", args.task, headline, results, {"task": args.task, "limit": args.limit})


def cmd_longqa(args: argparse.Namespace) -> int:
    from kvserve.eval.longqa import evaluate_longqa, longqa_headline

    session = _Session(args)
    results = evaluate_longqa(
        session.engine(), args.task, context=args.context, max_tokens=args.max_tokens, limit=args.limit,
        prompt_cache=args.prompt_cache,
    )  # fmt: skip
    options = {"task": args.task, "context": args.context, "max_tokens": args.max_tokens, "limit": args.limit,
               "prompt_cache": args.prompt_cache}  # fmt: skip
    return session.finish("longqa", args.task, longqa_headline(results), results, options)


def cmd_needle(args: argparse.Namespace) -> int:
    from kvserve.eval.needle import draw_needle_heatmap, evaluate_needle, needle_headline

    lengths, depths = parse_lengths(args.lengths), parse_depths(args.depths)
    session = _Session(args)
    results = evaluate_needle(session.engine(), lengths, depths)
    output = session.report_path("needle", "austen")
    output.parent.mkdir(parents=True, exist_ok=True)
    draw_needle_heatmap(results, output.with_suffix(".png"), title=session.label())
    options = {"lengths": lengths, "depths": depths}
    return session.finish("needle", "austen", needle_headline(results), results, options)


def cmd_compare(args: argparse.Namespace) -> int:
    from kvserve.eval.compare import compare_table, draw_comparison
    from kvserve.eval.report import load_eval_report

    reports = [load_eval_report(path) for path in args.reports]
    names = [path.stem for path in args.reports]
    print(compare_table(reports, names))
    output = output_path(args, "compare.png")
    output.parent.mkdir(parents=True, exist_ok=True)
    draw_comparison(reports, names, output)
    print(f"wrote {output}")
    return 0


# ----- shared pieces -----


class _Session:
    """Loads what one eval needs, once: the kvserve model and engine, or the transformers reference."""

    def __init__(self, args: argparse.Namespace) -> None:
        from kvserve.entrypoints.cli_common import load_from_args

        self.args = args
        self.config = engine_config_from_args(args)
        check_model_fit(self.config)  # before the weights load
        self.loaded = load_from_args(args)  # the tokenizer, and the weights the engine runs
        self.tokenizer = self.loaded.tokenizer
        self._engine = None

    def engine(self):  # noqa: ANN201 - LLMEngine
        from kvserve.core.engine import LLMEngine

        if self._engine is None:
            self._engine = LLMEngine(self.config, self.loaded)
        return self._engine

    @property
    def backend(self) -> str:
        return getattr(self.args, "backend", "kvserve")

    def scorer(self):  # noqa: ANN201 - a kvserve.eval.loglikelihood.Scorer
        if self.backend == "hf":
            from kvserve.eval.hf_reference import TransformersScorer

            return TransformersScorer.load(self.loaded.path, self.loaded.dtype)
        from kvserve.eval.loglikelihood import EngineScorer

        return EngineScorer(self.engine())

    def label(self) -> str:
        return f"{self.backend} {DTYPE_NAMES[self.config.torch_dtype]}{self._policy_tag(' ')}"

    def _policy_tag(self, sep: str) -> str:
        """'' for the full cache in the model's dtype, else e.g. ' pyramid@0.5' (label) or '-pyramid0.5' (file
        name), and the KV cache's dtype when it is not the model's (' int8 KV', '-kv-int8')."""
        if self.backend == "hf":
            return ""
        tag = ""
        if self.config.kv_policy != "full":
            budget = self.config.kv_budget if self.config.kv_budget is not None else 0.5
            tag = f"{sep}{self.config.kv_policy}{'@' if sep == ' ' else ''}{budget:g}"
        if self.config.kv_cache_dtype != "auto":
            tag += f" {self.config.kv_cache_dtype} KV" if sep == " " else f"-kv-{self.config.kv_cache_dtype}"
        return tag

    def report_path(self, kind: str, task: str) -> Path:
        suffix = "-hf" if self.backend == "hf" else self._policy_tag("-")
        suffix += "-prompt-cache" if getattr(self.args, "prompt_cache", False) else ""
        stem = f"{kind}-{task}-{DTYPE_NAMES[self.config.torch_dtype]}{suffix}"
        return output_path(self.args, f"{stem}.json").with_suffix(".json")

    def finish(self, kind: str, task: str, headline: str, results: dict, options: dict) -> int:
        from kvserve.eval.report import eval_report, write_eval_report
        from kvserve.models.fingerprint import model_fingerprint

        engine = describe_config(self.config)
        # What ran: native needs a Q4 GGUF, bfloat16 and a CPU; transformers always dequantises.
        engine["weights"] = self.loaded.weights if self.backend == "kvserve" else "dequant"
        if self.backend == "kvserve":
            engine["weights_detail"] = self.loaded.weights_summary
        if self.backend == "kvserve" and self._engine is not None:
            engine["max_model_len"] = self._engine.max_model_len
        backend = "transformers" if self.backend == "hf" else "kvserve"
        report = eval_report(
            kind, headline, results, backend=backend, engine=engine,
            model=model_fingerprint(self.loaded.path), options=options,
        )  # fmt: skip
        path = write_eval_report(report, self.report_path(kind, task))
        print(f"wrote {path}")
        print(headline)
        return 0


_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([kK]?)$")


def parse_lengths(spec: str) -> list[int]:
    """``"1k,2k,4k"`` -> [1000, 2000, 4000] (decimal, so 8k fits a context of 8,192); plain numbers are tokens."""
    lengths = []
    for part in spec.split(","):
        match = _SIZE.match(part.strip())
        if not match:
            raise ValueError(f"bad length {part!r} in {spec!r}; expected e.g. 1k,2k,4k or 1500")
        value = float(match.group(1)) * (1000 if match.group(2) else 1)
        if value < 16:
            raise ValueError(f"length {part!r} is too short; at least 16 tokens")
        lengths.append(int(value))
    return lengths


def parse_depths(spec: str) -> list[float]:
    """``"0..100%"`` -> 0, 10, ..., 100 (11 steps); ``"0..100%/5"`` -> 5 steps; ``"0,50,100"`` as given.
    Returned as fractions in [0, 1]."""
    spec = spec.strip()
    range_match = re.match(r"^(\d+(?:\.\d+)?)\.\.(\d+(?:\.\d+)?)%?(?:/(\d+))?$", spec)
    if range_match:
        lo, hi = float(range_match.group(1)), float(range_match.group(2))
        steps = int(range_match.group(3) or 11)
        if steps < 2 or lo > hi:
            raise ValueError(f"bad depth range {spec!r}; expected e.g. 0..100% or 0..100%/5")
        values = [lo + (hi - lo) * i / (steps - 1) for i in range(steps)]
    else:
        try:
            values = [float(part.strip().rstrip("%")) for part in spec.split(",")]
        except ValueError as exc:
            raise ValueError(f"bad depths {spec!r}; expected e.g. 0..100% or 0,25,50,75,100") from exc
    if any(not 0 <= v <= 100 for v in values):
        raise ValueError(f"depths must be within 0..100%, got {spec!r}")
    return [v / 100 for v in values]
