"""Where the evaluation and benchmark data live: ``../shared/data`` next to the checkout, or ``$KVSERVE_DATA``."""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR = Path(os.environ.get("KVSERVE_DATA") or Path(__file__).resolve().parents[3] / "shared" / "data")
WIKITEXT2 = DATA_DIR / "wikitext-2" / "wiki.test.raw"
AUSTEN = DATA_DIR / "prose" / "austen.txt"
MULTIPLE_CHOICE = DATA_DIR / "multiple-choice"
LEVAL = DATA_DIR / "leval"
AZURE_CONV_TRACE = DATA_DIR / "traces" / "azure_llm_inference_conv_2023.csv"

# Names ``kvserve eval ppl --data`` accepts besides a path.
TEXTS = {"wikitext-2": WIKITEXT2, "austen": AUSTEN}


def require(path: Path, what: str) -> Path:
    if not path.is_file():
        raise ValueError(f"{what} {path} is missing (set KVSERVE_DATA to the data folder)")
    return path
