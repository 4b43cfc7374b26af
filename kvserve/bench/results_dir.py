"""Where ``kvserve bench`` and ``kvserve eval`` write when no ``--output`` is given.

Always ``./kvserve-results/SUBCOMMAND/STEM`` in the working folder, never the shipped ``benchmarks/``, so
a run from the checkout leaves the published reports alone; their regeneration commands pass ``--output``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

RESULTS_DIR = "kvserve-results"


def add_output_arg(
    parser: argparse.ArgumentParser, subcommand: str, stem: str, files: str = "OUTPUT.json/.md/.png"
) -> None:
    """``--output``, whose default :func:`output_path` builds under ``kvserve-results/SUBCOMMAND/``."""
    parser.add_argument("--output", default=None, help=f"writes {files} (default: {RESULTS_DIR}/{subcommand}/{stem})")
    parser.set_defaults(results_subcommand=subcommand)


def output_path(args: argparse.Namespace, stem: str) -> Path:
    """``--output`` if given, else ``kvserve-results/SUBCOMMAND/STEM``; the caller adds the suffixes (replacing one
    of its own, so a name with another dot in its last part is refused rather than cut short there)."""
    if args.output:
        out = Path(args.output)
        if out.suffix not in ("", ".json", ".md", ".png"):
            raise ValueError(
                f"--output {args.output}: the reports would be {out.with_suffix('.json').name} and "
                f"{out.with_suffix('.md').name}; name it without a dot after the last '/'"
            )
        return out
    return Path(RESULTS_DIR) / args.results_subcommand / stem
