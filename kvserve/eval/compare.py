"""``kvserve eval compare``: several eval reports of one kind side by side, as a Markdown table and a plot.

Each report is reduced to one main metric (the one its headline leads with):

- ``ppl``: token ``perplexity`` (lower is better; no standard error);
- ``mc``: ``acc`` ± ``acc_stderr`` (LAMBADA too: its perplexity stays in the report);
- ``longqa``: ``results["score"]`` ± ``results["score_stderr"]``, named by ``results["metric"]``;
- ``needle``: ``mean_score`` ± the standard error of the mean over its cells.

The table gives each report's configuration (backend, dtype, KV policy and the fraction of the KV
cache kept; ``full`` and 100% when the engine has none) and its difference from the first report.
With standard errors on both sides, a difference is *within noise* when it is at most two standard
errors of the difference: from per-item results when both reports have them for the same items
(mc ``correct``, needle cells), a paired comparison; otherwise ``sqrt(se_a² + se_b²)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvserve.eval.metrics import mean_stderr
from kvserve.platform.extras import pyplot

FULL_POLICY = "full"


@dataclass(frozen=True)
class Metric:
    """The number a report is compared by."""

    name: str
    value: float
    stderr: float | None
    higher_is_better: bool
    items: tuple[float, ...] | None = None  # per-question (per-cell) scores, for a paired difference


def main_metric(report: dict) -> Metric:
    """The headline metric of one report, by its ``eval`` kind. Raises ValueError for an unknown kind."""
    kind, results = report["eval"], report["results"]
    if kind == "ppl":
        return Metric("perplexity", float(results["perplexity"]), None, higher_is_better=False)
    if kind == "mc":
        items = tuple(float(c) for c in results["correct"]) if "correct" in results else None
        return Metric("acc", float(results["acc"]), _stderr(results.get("acc_stderr")), True, items)
    if kind == "longqa":
        if "score" not in results:
            raise ValueError(f"longqa report has no 'score' in its results (keys: {', '.join(sorted(results))})")
        name = str(results.get("metric", "score"))
        return Metric(name, float(results["score"]), _stderr(results.get("score_stderr")), True)
    if kind == "needle":
        cells = results.get("cells") or []
        scores = tuple(float(c["score"]) for c in cells)
        stderr = _stderr(mean_stderr(scores)) if len(scores) > 1 else None
        return Metric("retrieval", float(results["mean_score"]), stderr, True, scores or None)
    raise ValueError(f"unknown eval kind {kind!r}; expected ppl, mc, longqa or needle")


def kv_setting(report: dict) -> tuple[str, float]:
    """(KV policy, fraction of the KV cache kept) of a report's engine: ("full", 1.0) when it names none."""
    engine = report.get("engine") or {}
    policy = engine.get("kv_policy") or FULL_POLICY
    budget = engine.get("kv_budget")
    return str(policy), 1.0 if budget is None else float(budget)


def compare_table(reports: Sequence[dict], names: Sequence[str]) -> str:
    """A Markdown table, one row per report, with each report's difference from the first.

    Raises ValueError unless all reports are of one eval kind. Lines after the table warn when the
    reports come from different model files, tasks or options.
    """
    _check_same_kind(reports, names)
    metrics = [main_metric(r) for r in reports]
    metric_names = {m.name for m in metrics}
    metric_header = next(iter(metric_names)) if len(metric_names) == 1 else "metric"
    first = metrics[0]
    header = ["report", "eval", "backend", "dtype", "KV policy", "KV kept", f"{metric_header} ± stderr"]
    header.append(f"Δ vs {names[0]}")
    rows = []
    for i, (report, name, metric) in enumerate(zip(reports, names, metrics, strict=True)):
        policy, budget = kv_setting(report)
        value = _format_metric(metric, show_name=len(metric_names) > 1)
        delta = "—" if i == 0 else _format_delta(first, metric)
        engine = report.get("engine") or {}
        rows.append([
            name, _task_label(report), str(report.get("backend", "?")), str(engine.get("dtype", "?")), policy,
            f"{budget * 100:g}%", value, delta,
        ])  # fmt: skip
    lines = [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows)]
    warnings = _warnings(reports, names)
    return "\n".join(lines + ([""] if warnings else []) + [f"warning: {w}" for w in warnings])


def draw_comparison(reports: Sequence[dict], names: Sequence[str], path: Path) -> None:
    """Metric vs KV retained % (one line per KV policy) when the reports differ in ``kv_budget``;
    otherwise a bar per report. Standard errors as error bars where the reports have them."""
    plt = pyplot("eval")

    _check_same_kind(reports, names)
    metrics = [main_metric(r) for r in reports]
    settings = [kv_setting(r) for r in reports]
    metric = metrics[0]
    direction = "higher is better" if metric.higher_is_better else "lower is better"
    kind = reports[0]["eval"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if len({budget for _, budget in settings}) > 1:
        _draw_budget_lines(ax, reports, metrics, settings)
        ax.set_xlabel("KV cache retained (%)")
        ax.set_title(f"{kind}: {metric.name} vs KV cache retained", fontsize=10)
    else:
        _draw_bars(ax, names, metrics)
        ax.set_title(f"{kind}: {metric.name} per report", fontsize=10)
    ax.set_ylabel(f"{metric.name} ({direction})")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----- table pieces -----


def _check_same_kind(reports: Sequence[dict], names: Sequence[str]) -> None:
    if not reports:
        raise ValueError("nothing to compare: no reports")
    if len(names) != len(reports):
        raise ValueError(f"got {len(names)} names for {len(reports)} reports")
    kinds = [r.get("eval") for r in reports]
    if len(set(kinds)) > 1:
        listed = ", ".join(f"{name}: {kind}" for name, kind in zip(names, kinds, strict=True))
        raise ValueError(f"reports are of different eval kinds ({listed}); compare one kind at a time")


def _task_label(report: dict) -> str:
    kind, results, options = report["eval"], report["results"], report.get("options") or {}
    if kind == "ppl":
        data = options.get("data")
        return f"ppl/{Path(data).name}" if data else "ppl"
    if kind == "needle":
        return "needle"
    task = results.get("task") or options.get("task")
    return f"{kind}/{task}" if task else kind


def _format_metric(metric: Metric, show_name: bool) -> str:
    digits = 3 if metric.name == "perplexity" else 4
    text = f"{metric.value:.{digits}f}"
    if metric.stderr is not None:
        text += f" ± {metric.stderr:.{digits}f}"
    return f"{metric.name} {text}" if show_name else text


def _format_delta(first: Metric, other: Metric) -> str:
    delta = other.value - first.value
    digits = 3 if first.name == "perplexity" else 4
    text = f"{delta:+.{digits}f}"
    if first.name != other.name:
        return f"{text} (different metrics)"
    if first.stderr is None or other.stderr is None:
        return f"{text} ({delta / first.value:+.1%})" if first.value else text
    se = _difference_stderr(first, other)
    if se is None:
        return text
    return f"{text} ({'within noise' if abs(delta) <= 2 * se else 'beyond 2 stderr'})"


def _difference_stderr(a: Metric, b: Metric) -> float | None:
    """Standard error of ``b - a``: paired over items when both have the same number of them."""
    if a.items is not None and b.items is not None and len(a.items) == len(b.items) and len(a.items) > 1:
        return _stderr(mean_stderr([y - x for x, y in zip(a.items, b.items, strict=True)]))
    if a.stderr is None or b.stderr is None:
        return None
    return math.sqrt(a.stderr**2 + b.stderr**2)


def _warnings(reports: Sequence[dict], names: Sequence[str]) -> list[str]:
    warnings = []
    shas = [(r.get("model") or {}).get("sha256") for r in reports]
    if len(set(shas)) > 1:
        listed = ", ".join(f"{name} {(sha or 'unknown')[:12]}" for name, sha in zip(names, shas, strict=True))
        warnings.append(f"the reports come from different model files (sha256 {listed})")
    tasks = [_task_label(r) for r in reports]
    if len(set(tasks)) > 1:
        warnings.append(f"the reports evaluate different tasks ({', '.join(sorted(set(tasks)))})")
    options = [r.get("options") or {} for r in reports]
    keys = sorted({k for o in options for k in o if len({repr(p.get(k)) for p in options}) > 1})
    if keys:
        warnings.append(f"the reports ran with different options ({', '.join(keys)})")
    return warnings


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _stderr(value: object) -> float | None:
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


# ----- plot pieces -----


def _draw_budget_lines(ax, reports: Sequence[dict], metrics: Sequence[Metric], settings) -> None:  # noqa: ANN001
    dtypes = {(r.get("engine") or {}).get("dtype") for r in reports}
    groups: dict[str, list[tuple[float, Metric]]] = {}
    for report, metric, (policy, budget) in zip(reports, metrics, settings, strict=True):
        label = policy if len(dtypes) < 2 else f"{policy} {(report.get('engine') or {}).get('dtype')}"
        groups.setdefault(label, []).append((budget * 100, metric))
    colours = (f"C{i}" for i in range(len(groups)))
    for label, points in groups.items():
        points.sort(key=lambda p: p[0])
        xs = [x for x, _ in points]
        ys = [m.value for _, m in points]
        errors = [m.stderr or 0.0 for _, m in points]
        if label.startswith(FULL_POLICY) and xs == [100.0]:  # the full cache: a reference level across the plot
            ax.axhline(ys[0], color="grey", linestyle="--", linewidth=1)
            if errors[0]:
                ax.axhspan(ys[0] - errors[0], ys[0] + errors[0], color="grey", alpha=0.15)
            ax.errorbar(xs, ys, yerr=errors if any(errors) else None, marker="s", capsize=3, color="grey", label=label)
            continue
        colour = next(colours)
        ax.errorbar(xs, ys, yerr=errors if any(errors) else None, marker="o", capsize=3, color=colour, label=label)
    ax.set_xlim(0, 105)
    ax.legend(fontsize=8)


def _draw_bars(ax, names: Sequence[str], metrics: Sequence[Metric]) -> None:  # noqa: ANN001
    errors = [m.stderr or 0.0 for m in metrics]
    bars = ax.bar(range(len(metrics)), [m.value for m in metrics], yerr=errors if any(errors) else None, capsize=4,
                  color=[f"C{i}" for i in range(len(metrics))])  # fmt: skip
    ax.bar_label(bars, labels=[f"{m.value:.3f}" for m in metrics], fontsize=8, padding=2)
    ax.set_xticks(
        range(len(names)), names, rotation=20 if len(names) > 3 else 0, ha="right" if len(names) > 3 else "center"
    )
