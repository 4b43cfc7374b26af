"""A benchmark report: the command, date and machine next to the figures, written as JSON and Markdown."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path

from kvserve.bench.redact import command_line, redact_keys
from kvserve.platform.machine import describe_machine


def new_report(benchmark: str, **fields: object) -> dict:
    return {
        "benchmark": benchmark,
        "date": date.today().isoformat(),
        "command": command_line(),
        "machine": describe_machine(),
        **fields,
    }


def write_report(out: Path, report: dict, markdown: str) -> None:
    """OUT.json and OUT.md; the Markdown is also printed. Secret values are masked (the command line's by
    :func:`new_report`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(redact_keys(report), indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown)
    print(markdown)
