"""Optional dependencies: imported where they are used, with an error naming the extra that installs them.

Plots need ``kvserve[bench]`` (matplotlib), the serving load generator and the peers too (httpx, psutil,
transformers); ROUGE-L needs ``kvserve[eval]`` (rouge-score).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

from kvserve.errors import KVServeError


class MissingExtraError(KVServeError):
    """A package that only an optional feature needs is not installed."""


@contextmanager
def extra_imports(extra: str, purpose: str) -> Iterator[None]:
    """Imports inside the block that fail for a missing third-party package raise a MissingExtraError."""
    try:
        yield
    except ModuleNotFoundError as exc:
        if not exc.name or exc.name.split(".")[0] == "kvserve":
            raise  # a bug in kvserve, not a missing extra
        raise MissingExtraError(
            f"{purpose} needs the {exc.name!r} package, which kvserve does not install by default: "
            f"pip install 'kvserve[{extra}]'"
        ) from exc


def pyplot(extra: str = "bench") -> ModuleType:
    """matplotlib.pyplot on the headless Agg backend; ``extra`` is the one to name when it is missing."""
    with extra_imports(extra, "drawing plots"):
        import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
