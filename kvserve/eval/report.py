"""An eval's JSON: the headline, the results, the full engine configuration, the model's hash, the machine."""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path

from kvserve.bench.redact import command_line, redact_keys
from kvserve.platform.machine import describe_machine


def eval_report(
    kind: str, headline: str, results: dict, *, backend: str, engine: dict, model: dict, options: dict
) -> dict:
    return {
        "eval": kind,
        "headline": headline,
        "results": results,
        "backend": backend,
        "engine": engine,
        "model": model,
        "options": options,
        "command": command_line(),
        "date": datetime.now().isoformat(timespec="seconds"),
        "machine": describe_machine(),
    }


def write_eval_report(report: dict, output: Path) -> Path:
    output = output if output.suffix == ".json" else output.with_suffix(".json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(_finite(redact_keys(report)), indent=2, allow_nan=False) + "\n")
    return output


def _finite(value: object) -> object:
    """NaN (a standard error of one sample) becomes null: strict JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def load_eval_report(path: Path) -> dict:
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a readable eval report: {exc}") from exc
    if not isinstance(report, dict) or "eval" not in report or "results" not in report:
        raise ValueError(f"{path} is not a kvserve eval report (no 'eval' and 'results' fields)")
    return report
